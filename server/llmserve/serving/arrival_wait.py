"""How long the engine core waits for the requests that replace those that just finished.

A client whose request just ended often sends its next one at once (a chat turn, a batch job, a
benchmark at fixed concurrency). In-process, that request joins the step after next; served, it
travels the engine server, the adapter and the client and back first (a few to tens of ms), and a
step scheduled before it arrives leaves it to the step after. Where the prefill queue runs at
capacity (fixed-length work: requests finish, and their successors arrive, at the rate prefill takes
them) that one step is never made up: every successor waits it, a whole prefill step of TTFT.

So after a step whose outputs finished requests, the core takes in new requests before it schedules
the next step, until as many have come as finished, or:

- free: while the step launched before runs on the device, so that this costs no device time: its
  expected device time left, less the host time the next step takes to launch (the engine's
  `step_left`, from the device times of earlier steps of its size: a step that prefills takes several
  times a decode step). Before a step of that size was seen: FREE_SHARE of the loop's recent time per
  step;
- extended: up to CAP_S in all, while the device may idle for it. Only where finishes have been
  answered by arrivals (closed-loop clients: `answered`, the decayed share of finishes followed by an
  arrival within CAP_S), and only out of a budget: the time the device was seen idle while the core
  waited (polled every POLL_S) is charged to a bucket that fills at IDLE_SHARE of the time the core
  is busy and holds at most BUCKET_S. So waiting costs at most ~IDLE_SHARE of throughput, spent where
  it pays (the first finishes of a wave, whose in-flight step is a short decode step) and not on
  every step of an open-loop or random-length load.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

CAP_S = 0.05
FREE_SHARE = 0.5
IDLE_SHARE = 0.02
BUCKET_S = 0.1
POLL_S = 0.001
ANSWERED_MIN = 0.5
ANSWERED_DECAY = 0.05  # weight of each finish in `answered`
DELAYS_KEPT = 4096  # successor delays kept for that log


@dataclass
class WaitStats:
    """What the waits did, for the core's log at the end of each busy stretch."""

    waits: int = 0
    by_arrivals: int = 0  # ended because as many had come as finished
    extended: int = 0  # went past the free part
    idle_s: float = 0.0  # charged: waited while the device had nothing to run
    delays: deque = field(default_factory=lambda: deque(maxlen=DELAYS_KEPT))  # finish -> arrival, seconds

    def summary(self) -> str:
        d = sorted(self.delays)
        pct = "/".join(f"{d[int(q * (len(d) - 1))] * 1e3:.1f}" for q in (0.1, 0.5, 0.9)) if d else "-"
        return (
            f"arrival waits {self.waits} (ended by arrivals {self.by_arrivals}, extended {self.extended}, "
            f"device idle {self.idle_s * 1e3:.0f} ms); successor delay p10/p50/p90 {pct} ms of {len(d)}"
        )


class ArrivalWait:
    """The policy above, and its bookkeeping of finishes, arrivals, busy time and idle charged."""

    def __init__(self) -> None:
        self.unanswered: deque[float] = deque()  # finish times not yet followed by an arrival
        self.bucket = BUCKET_S
        self.stats = WaitStats()
        self.rest()

    def rest(self) -> WaitStats:
        """The engine ran out of work: a busy stretch ended; returns what its waits did. Its last
        finishes go unanswered because its load ended, not because its clients do not answer (a
        benchmark's last wave, a batch job's end): without forgetting them, the next load's first
        finishes (the first of its waves, where the step in flight is a short decode step and the
        free part alone misses the successors) would get no extension. Each stretch's clients are
        taken to answer until seen otherwise."""
        self.unanswered.clear()
        self.answered = 1.0
        stats, self.stats = self.stats, WaitStats()
        return stats

    def busy(self, seconds: float) -> None:
        """The core ran steps for `seconds`: the idle budget grows."""
        self.bucket = min(BUCKET_S, self.bucket + IDLE_SHARE * seconds)

    def finished(self, n: int, now: float) -> None:
        self._expire(now)
        self.unanswered.extend([now] * n)

    def arrived(self, when: float) -> None:
        """A new request reached the server at `when` (the clock of `finished`): it answers the
        oldest finish still waiting for one, if it came after it."""
        self._expire(when)
        if self.unanswered and self.unanswered[0] <= when:
            self.stats.delays.append(when - self.unanswered.popleft())
            self.answered += ANSWERED_DECAY * (1.0 - self.answered)

    def _expire(self, now: float) -> None:
        while self.unanswered and now - self.unanswered[0] > CAP_S:
            self.unanswered.popleft()
            self.answered -= ANSWERED_DECAY * self.answered

    def free(self, period: float) -> float:
        """Seconds of waiting that overlap the step in flight (`period`: recent seconds per step)."""
        return min(CAP_S, FREE_SHARE * period)

    def may_extend(self, idle: float) -> bool:
        """Whether to wait on, having seen the device idle for `idle` seconds of this wait so far."""
        return self.answered >= ANSWERED_MIN and self.bucket > idle

    def charge(self, idle: float) -> None:
        self.bucket -= idle
        self.stats.idle_s += idle
