"""Python's cyclic collector and a long-lived serving process's startup objects.

A loaded model brings 10^5-10^6 objects that live as long as the process (modules, torch modules,
Triton kernels, CUDA graphs, the tokenizer). Each full collection scans them all: 75-107 ms in an 8B
engine on an H100 host (scripts/bench_spec.py's gc_pauses), 408 ms in a tiny one on a 2-core VM: a
stall of the step loop (or of every stream of an HTTP worker) whenever one runs. Frozen once startup is done,
they are out of the collector's reach and a full collection scans only what serving created since.
(Startup objects that become garbage later are then not reclaimed: fine for what lives for good.)
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what startup left over, then move every surviving object to the permanent generation;
    returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
