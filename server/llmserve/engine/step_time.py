"""What a step costs the device, by its size.

The engine core waits for new requests while the step in flight runs (serving/arrival_wait.py); how
long it may wait for free is that step's device time left. A step's time depends mostly on its
tokens (a decode step of the batch against one that also prefills 2,048 prompt tokens: 10 against
66 ms on an 8B model), so the times are kept per size class (powers of two of the token count), each
a decayed mean of the steps seen in it.
"""

from __future__ import annotations

DECAY = 0.3  # weight of the newest step in its class's mean


class StepTimes:
    def __init__(self) -> None:
        self._by_size: dict[int, float] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        size = tokens.bit_length()
        old = self._by_size.get(size)
        self._by_size[size] = seconds if old is None else old + DECAY * (seconds - old)

    def expect(self, tokens: int) -> float | None:
        """Device seconds of a step of `tokens` tokens (None: no step of its size seen yet)."""
        return self._by_size.get(tokens.bit_length())
