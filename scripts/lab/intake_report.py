#!/usr/bin/env python3
"""Each hop's delays from an LLMSERVE_INTAKE_TRACE file (server/llmserve/serving/intake_trace.py).

Requests are grouped into bursts: a group ends where the next request's first mark comes more than
--gap seconds after the last mark of the group so far. For each group: its requests, for each layer the
spread of its marks (last minus first, ms: how long that layer took to see the whole burst) and for
each hop (a layer to the next one the request met; `http_sent` beside the path, from `http`) the delay
p50 / p90 / max in ms.

Usage: PYTHONPATH=server python scripts/lab/intake_report.py TRACE [--gap 1.0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llmserve.bench.metrics import stats
from llmserve.serving.intake_trace import LAYERS


def load(path: str) -> dict[str, dict[str, float]]:
    """req_id -> {layer: time of its first mark there}."""
    reqs: dict[str, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[1] not in LAYERS:
            continue
        t, layer, rid = float(parts[0]), parts[1], parts[2]
        reqs.setdefault(rid, {}).setdefault(layer, t)
    return reqs


def groups(reqs: dict[str, dict[str, float]], gap: float) -> list[list[dict[str, float]]]:
    out: list[list[dict[str, float]]] = []
    last = None
    for marks in sorted(reqs.values(), key=lambda m: min(m.values())):
        if last is None or min(marks.values()) - last > gap:
            out.append([])
        out[-1].append(marks)
        last = max(last or 0.0, max(marks.values()))
    return out


def summarize(group: list[dict[str, float]]) -> dict:
    layers = [la for la in LAYERS if any(la in m for m in group)]
    spread = {la: 1e3 * (max(m[la] for m in group if la in m) - min(m[la] for m in group if la in m)) for la in layers}
    hops = {}
    path = [la for la in layers if la != "http_sent"]  # its mark may follow the adapter's: a side hop
    pairs = list(zip(path, path[1:])) + ([("http", "http_sent")] if "http_sent" in layers else [])
    for a, b in pairs:
        d = [m[b] - m[a] for m in group if a in m and b in m]  # seconds
        if d:
            hops[f"{a}->{b}"] = {"n": len(d), **stats(d), "max": 1e3 * max(d)}  # ms
    return {"requests": len(group), "layers": layers, "spread_ms": spread, "hops_ms": hops}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds without marks that end a group")
    ap.add_argument("--json", default="", help="also write the summaries here")
    a = ap.parse_args()
    summaries = [summarize(g) for g in groups(load(a.trace), a.gap)]
    for i, s in enumerate(summaries):
        spread = ", ".join(f"{la} {ms:.1f}" for la, ms in s["spread_ms"].items())
        print(f"group {i}: {s['requests']} requests; spread of each layer's marks (ms): {spread}")
        for hop, d in s["hops_ms"].items():
            print(f"  {hop:<26} n {d['n']:>5}  p50 {d['p50']:8.2f}  p90 {d['p90']:8.2f}  max {d['max']:8.2f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps(summaries, indent=1))
    return 0 if summaries else 1


if __name__ == "__main__":
    sys.exit(main())
