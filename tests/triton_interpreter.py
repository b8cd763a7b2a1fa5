"""Whether Triton's interpreter (TRITON_INTERPRET=1) can run our kernels here.

Triton 3.6's interpreter turns a kernel's scalar arguments into 1-element arrays and loops over
them with int(array), which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to
Python scalars": triton-lang/triton#9171). A kernel with `range(0, K, BLOCK_K)` then fails before it
computes anything. The tests that run our kernels under the interpreter ask `broken()` first and
skip with its reason; the same kernels' GPU tests still run on a GPU.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def _count(out_ptr, n):
    acc = 0
    for _ in range(0, n, 1):
        acc += 1
    tl.store(out_ptr, acc)

out = torch.zeros(1, dtype=torch.int32)
try:
    _count[(1,)](out, 3)
except Exception as e:  # the interpreter wraps what failed
    print("BROKEN", repr(e)[:300])
else:
    print("OK" if int(out[0]) == 3 else f"BROKEN counted {int(out[0])} of 3")
"""


@functools.cache
def broken() -> str | None:
    """None when the interpreter runs a loop over a runtime bound; else why not (versions included)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    if r.stdout.strip() == "OK":
        return None
    import numpy
    import triton

    why = (r.stdout.strip() or r.stderr.strip()[-300:]).removeprefix("BROKEN ")
    known = " (triton-lang/triton#9171)" if "0-dimensional" in why else ""
    return f"Triton {triton.__version__}'s interpreter fails under numpy {numpy.__version__}{known}: {why}"


def run_script(script: str, seed: int, timeout: float = 600) -> None:
    """Run `script` (test code that prints "ok" at its end) in a Python under TRITON_INTERPRET=1 (triton
    reads it at import; the rest of the session must not see it); skip when the interpreter is broken."""
    import pytest

    if why := broken():
        pytest.skip(why)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "ok" in r.stdout, f"seed {seed}\n{r.stdout}\n{r.stderr[-3000:]}"
