"""What the engine has done so far (LLMEngine.stats): the metrics' and the benchmarks' source."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: int
    prompt_tokens: int  # of all requests added
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    # Cumulative seconds: whole steps; scheduling and launching (runner.submit); waiting for a
    # step's result (runner.result); the model run and sampling (device time, measured by the
    # runner); output processing (stop checks, detokenizing).
    step_time: float
    schedule_time: float
    execute_time: float
    model_time: float
    sample_time: float
    output_time: float
    # Speculative decoding: request-steps that verified drafts; drafts proposed / accepted, overall
    # and per draft position (mean accepted length = 1 + accepted / verified).
    spec_verified: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafted_at: list[int] | None = None
    spec_accepted_at: list[int] | None = None

    @property
    def host_time(self) -> float:
        """Time of the step outside the model run."""
        return self.step_time - self.model_time


def engine_stats(engine) -> EngineStats:
    """The engine's counters now (LLMEngine.stats)."""
    bm = engine.block_manager
    return EngineStats(
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        kv_blocks_used=bm.num_used,
        kv_blocks_total=bm.num_blocks,
        steps=engine._steps,
        prompt_tokens=engine._prompt_tokens,
        generation_tokens=engine._gen_tokens,
        prefix_cache_queries=bm.prefix_queries,
        prefix_cache_hits=bm.prefix_hits,
        preemptions=engine._preemptions,
        step_time=engine._step_time,
        schedule_time=engine._schedule_time,
        execute_time=engine._execute_time,
        model_time=engine._model_time,
        sample_time=engine._sample_time,
        output_time=engine._output_time,
        spec_verified=engine.spec.stats.verified,
        spec_draft_tokens=engine.spec.stats.drafted,
        spec_accepted_tokens=engine.spec.stats.accepted,
        spec_drafted_at=list(engine.spec.stats.drafted_at),
        spec_accepted_at=list(engine.spec.stats.accepted_at),
    )
