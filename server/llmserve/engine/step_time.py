"""What a step costs the device, by its size, and how much of the step in flight is left.

The engine core waits for new requests while the step in flight runs (serving/arrival_wait.py); how
long it may wait for free is that step's device time left. A step's time depends mostly on its
tokens (a decode step of the batch against one that also prefills 2,048 prompt tokens: 10 against
66 ms on an 8B model), so the times are kept per size class (powers of two of the token count), each
a decayed mean of the steps seen in it. An overlapped step starts on the device when the one before
it ends, and the next cannot start before the host has launched it (`launch_s`).
"""

from __future__ import annotations

import time

DECAY = 0.3  # weight of the newest step in its class's mean (and of the newest launch's host time)


class StepTimes:
    def __init__(self) -> None:
        self._by_size: dict[int, float] = {}
        self._device_done = 0.0  # when the device finished the last step taken in (perf_counter)
        self.launch_s = 0.0  # decayed host seconds from the engine's step() to a launched step

    def launched(self, host_seconds: float) -> None:
        self.launch_s += DECAY * (host_seconds - self.launch_s)

    def observe(self, tokens: int, seconds: float, done_at: float | None = None) -> None:
        """A step of `tokens` tokens took `seconds` of device time, and ended at `done_at`."""
        size = tokens.bit_length()
        old = self._by_size.get(size)
        self._by_size[size] = seconds if old is None else old + DECAY * (seconds - old)
        if done_at is not None:
            self._device_done = done_at

    def expect(self, tokens: int) -> float | None:
        """Device seconds of a step of `tokens` tokens (None: no step of its size seen yet)."""
        return self._by_size.get(tokens.bit_length())

    def left(self, expect: float) -> float:
        """Seconds the host may spend before the device waits, for a step expected to take `expect`
        that started when the last one taken in ended, with the next still to be launched."""
        return max(0.0, expect - (time.perf_counter() - self._device_done) - self.launch_s)
