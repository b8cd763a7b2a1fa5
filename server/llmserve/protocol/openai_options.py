"""OpenAI request option objects beside the sampling fields: `stream_options` and `prediction`."""

from __future__ import annotations

from typing import Literal

from llmserve.protocol.openai_tools import StrictModel


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's (guidellm sends it): with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class PredictionPart(StrictModel):
    type: Literal["text"]
    text: str


class Prediction(StrictModel):
    """OpenAI's predicted output: text the answer will mostly repeat (an edit), tried as speculative
    proposals (SamplingParams.prediction)."""

    type: Literal["content"]
    content: str | list[PredictionPart]

    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
