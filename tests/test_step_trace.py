"""LLMSERVE_STEP_TRACE: one line per step, whose counts are the step's (engine/step_trace.py)."""

from __future__ import annotations

from llmserve.config import Config
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.sampling_params import SamplingParams


def test_one_line_per_step_with_its_counts(tiny_hf_dir, tmp_path):
    from llmserve.runners.torch.runner import TorchRunner

    trace = tmp_path / "steps.txt"
    cfg = Config(
        block_size=4, max_seq_len=128, batch_size=8, block_bs=8, max_num_batched_tokens=16, step_trace=str(trace)
    )
    engine = LLMEngine(cfg, TorchRunner(str(tiny_hf_dir), cfg))
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 23)), p)  # 20 prompt tokens: chunks of 16 and 4
    engine.add_request("b", [5, 6, 7], p)
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    steps = stats.steps
    engine.shutdown()
    rows = [[float(x) for x in line.split()] for line in trace.read_text().splitlines()]
    assert len(rows) == steps
    assert [r[1:6] for r in rows[:2]] == [
        [1, 1, 16, 0, 1],
        [2, 0, 4 + 3, 0, 1],
    ]  # running waiting prompt decodes admitted
    assert all(r[3] == 0 and r[4] >= 1 for r in rows[2:])  # then decodes only
    assert all(r[6] > 0 for r in rows) and rows == sorted(rows)
    # schedule, launch and take-in ms: the host's time in step(), which the engine's own clock bounds
    assert all(len(r) == 10 and min(r[7:]) >= 0 for r in rows)
    assert 0 < sum(sum(r[7:]) for r in rows) <= 1e3 * stats.step_time + 0.02 * len(rows)  # (rounded)
