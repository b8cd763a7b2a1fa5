"""LLMSERVE_STEP_TRACE: one line per engine step, for finding where time goes (docs/engine.md).

wall-clock time (s)  running  waiting  prompt tokens  decoding requests  admitted  KV blocks used
"""

from __future__ import annotations

import time

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler import Scheduler, SchedulerOutput


class StepTrace:
    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the engine's life

    def write(self, sched: SchedulerOutput, scheduler: Scheduler, bm: BlockManager) -> None:
        """The step just scheduled: running and waiting requests after scheduling, its prompt tokens
        (proposals included) and decoding requests, the requests whose first chunk it carries."""
        decodes = sum(1 for c in sched.chunks if c.num_tokens - len(c.draft_token_ids) == 1)
        prompt = sum(c.num_tokens for c in sched.chunks) - decodes
        admitted = sum(
            1 for c in sched.chunks if c.start == c.request.num_cached_tokens and c.start < c.request.num_prompt_tokens
        )
        self.file.write(
            f"{time.time():.6f} {len(scheduler.running)} {len(scheduler.waiting)} {prompt} {decodes} {admitted} "
            f"{bm.num_used}\n"
        )

    def close(self) -> None:
        self.file.close()
