"""Print a run's metrics as a table, save them as JSON, draw PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llmserve.bench.metrics import RequestResult, tpot

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def format_table(summary: dict) -> str:
    conc = summary.get("max_concurrency") or "inf"
    lines = [
        f"{' Serving benchmark: ' + str(summary.get('backend', '')) + ' ':=^62}",
        f"{'Max concurrency:':<40}{conc:>22}",
        f"{'Request rate (req/s):':<40}{summary.get('request_rate', 'inf'):>22}",
        f"{'Requests (completed / failed):':<40}{summary['completed']:>13} / {summary['failed']:<6}",
    ]
    for code, n in summary["failures"].items():
        lines.append(f"{'  failed with ' + code + ':':<40}{n:>22}")
    rows = [
        ("Duration (s):", summary["duration_s"]),
        ("Total input tokens:", summary["total_input_tokens"]),
        ("Total output tokens:", summary["total_output_tokens"]),
        ("Request throughput (req/s):", summary["request_throughput"]),
        ("Input token throughput (tok/s):", summary["input_throughput"]),
        ("Output token throughput (tok/s):", summary["output_throughput"]),
        ("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    if "client_cpu_share" in summary:
        rows.append(("Client CPU / wall time:", summary["client_cpu_share"]))
    if summary.get("client_processes", 1) > 1:
        rows.append(("Client processes:", summary["client_processes"]))
        rows.append(("  busiest one's CPU / wall time:", summary["client_cpu_share_max"]))
    for label, v in rows:
        lines.append(f"{label:<40}{v:>22.2f}" if isinstance(v, float) else f"{label:<40}{v:>22}")
    if summary.get("output_len_mismatch"):
        lines.append(f"{'Outputs of another length than asked:':<40}{summary['output_len_mismatch']:>22}")
    for key, name in LATENCIES:
        s = summary[key]
        lines.append(f"{' ' + name + ' (ms) ':-^62}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{stat.capitalize() + ' ' + name + ':':<40}{s[stat]:>22.2f}")
    if "send_ms" in summary:
        s = summary["send_ms"]
        lines.append(f"{'Sent by the client, median / p90 (ms):':<40}{s['median']:>11.2f} / {s['p90']:<8.2f}")
    if "ttft_after_send_ms" in summary:  # (not in results saved before it was measured)
        s = summary["ttft_after_send_ms"]
        lines.append(f"{'TTFT from the send, median / p90 (ms):':<40}{s['median']:>11.2f} / {s['p90']:<8.2f}")
    lines += _spec_lines(summary.get("spec_decode"))
    lines.append("=" * 62)
    return "\n".join(lines)


def _spec_lines(spec: dict | None) -> list[str]:
    """Speculative decoding's figures, when drafts were verified during the level."""
    if not spec:
        return []
    per_pos = " ".join("-" if r is None else f"{r:.2f}" for r in spec["acceptance_rate_per_pos"])
    return [
        f"{' Speculative decoding ':-^62}",
        f"{'Drafts verified (request-steps):':<40}{spec['num_drafts']:>22}",
        f"{'Draft tokens (accepted / proposed):':<40}{spec['accepted_tokens']:>13} / {spec['draft_tokens']:<6}",
        f"{'Draft acceptance rate:':<40}{spec['acceptance_rate']:>22.3f}",
        f"{'Mean accepted length (tokens/step):':<40}{spec['mean_accepted_len']:>22.3f}",
        f"{'Acceptance rate per draft position:':<40}{per_pos:>22}",
    ]


def save_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_latencies(path: Path, results: list[RequestResult], title: str) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2E (ms) of the successful requests."""
    plt = _plt()
    ok = [r for r in results if r.success]
    data = {
        "TTFT": [r.ttft * 1e3 for r in ok],
        "TPOT": [t * 1e3 for t in map(tpot, ok) if t is not None],
        "ITL": [g * 1e3 for r in ok for g in r.itl],
        "E2E": [r.latency * 1e3 for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, vals) in zip(axes.flat, data.items()):
        if vals:
            ax.hist(vals, bins=min(50, max(5, len(vals) // 4)), color="tab:blue", alpha=0.8)
            for q, style in ((50, "-"), (90, "--"), (99, ":")):
                v = float(np.percentile(vals, q))
                ax.axvline(v, color="tab:red", linestyle=style, label=f"p{q} {v:.1f}")
            ax.legend(fontsize=8)
        ax.set_title(f"{name} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("requests" if name != "ITL" else "gaps")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_sweep(path: Path, summaries: list[dict], title: str) -> Path:
    """Throughput and TTFT against max concurrency."""
    plt = _plt()
    xs = [s["max_concurrency"] or 0 for s in summaries]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    a1.plot(xs, [s["output_throughput"] for s in summaries], "o-", label="output tok/s")
    a1.plot(xs, [s["total_token_throughput"] for s in summaries], "s--", label="total tok/s")
    a1.set_ylabel("tokens/s")
    a1b = a1.twinx()
    a1b.plot(xs, [s["request_throughput"] for s in summaries], "^:", color="tab:green", label="req/s")
    a1b.set_ylabel("requests/s")
    a1.legend(loc="upper left", fontsize=8)
    a1b.legend(loc="lower right", fontsize=8)
    a1.set_title("throughput")
    for stat, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
        a2.plot(xs, [s["ttft_ms"][stat] for s in summaries], style, label=f"TTFT {stat}")
    a2.set_ylabel("ms")
    a2.set_title("time to first token")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.set_xlabel("max concurrency")
        if len(xs) > 1 and min(xs) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
