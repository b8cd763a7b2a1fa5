"""For the GPU tests of kernels/pdl.py: a chain of kernels gives the same bits launched with PDL as without it,
eagerly and replayed in a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable

import torch


def assert_same_bits_with_pdl(monkeypatch, chain: Callable, state: Callable[[], tuple], what: str) -> None:
    """`chain(*state())` returns a tensor and may write into its state's tensors (residual, caches): the result and
    every state tensor must be the same with PDL off, on (eager), and on in a CUDA graph replayed twice from a fresh
    state."""
    from llmserve.kernels import switches

    monkeypatch.setattr(switches.current, "pdl", False)
    s = state()
    want = (chain(*s), *s)
    monkeypatch.setattr(switches.current, "pdl", True)
    s = state()
    assert all(torch.equal(a, b) for a, b in zip((chain(*s), *s), want)), f"eager, {what}"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(*state())  # compiled, warmed up
    torch.cuda.current_stream().wait_stream(side)
    s, graph = state(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(*s)
    for _ in range(2):  # replayed from the same start: the same bits each time
        for t, t0 in zip(s, state()):
            t.copy_(t0)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip((out, *s), want)), f"graph, {what}"
