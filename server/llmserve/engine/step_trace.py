"""LLMSERVE_STEP_TRACE: one line per engine step, for finding where time goes (docs/engine.md).

wall-clock time (s)  running  waiting  prompt tokens  decoding requests  admitted  KV blocks used
  schedule ms  launch ms  take-in ms

The last three are the host's time in `LLMEngine.step` for this step: scheduling it, launching it
(the runner's submit), then taking in the step before it (overlapped) or itself (serial), the wait
for the device included.
"""

from __future__ import annotations

import time

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler import Scheduler, SchedulerOutput


class StepTrace:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the engine's life

    def scheduled(self, sched: SchedulerOutput, scheduler: Scheduler, bm: BlockManager) -> str:
        """The step just scheduled: running and waiting requests after scheduling, its prompt tokens
        (proposals included) and decoding requests, the requests whose first chunk it carries."""
        decodes = sum(1 for c in sched.chunks if c.num_tokens - len(c.draft_token_ids) == 1)
        prompt = sum(c.num_tokens for c in sched.chunks) - decodes
        admitted = sum(
            1 for c in sched.chunks if c.start == c.request.num_cached_tokens and c.start < c.request.num_prompt_tokens
        )
        return f"{time.time():.6f} {len(scheduler.running)} {len(scheduler.waiting)} {prompt} {decodes} {admitted} {bm.num_used}"

    def write(self, line: str, schedule_s: float, launch_s: float, take_in_s: float) -> None:
        self.file.write(f"{line} {1e3 * schedule_s:.2f} {1e3 * launch_s:.2f} {1e3 * take_in_s:.2f}\n")

    def close(self) -> None:
        self.file.close()
