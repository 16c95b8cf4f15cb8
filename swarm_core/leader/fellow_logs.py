"""The latest tail of each fellow's own log, in memory: what fellows post while someone reads
their log, served by ``GET /fellows/{id}/log``. Nothing of it is written to the state dir."""

from __future__ import annotations

import collections
import time

import attrs

from swarm_core.contract.fellow_log import MAX_LINE_CHARS, MAX_LOG_LINES, FellowLogTail
from swarm_core.leader.errors import ApiError
from swarm_core.validators import log_line

HELD_BYTES = 256 * 1024  # per fellow
# How long after a read the fellow keeps sending: a console refreshing every 1-2 s keeps it
# on, and a reader that went away costs the fellow at most this many posts more.
WANT_S = 5.0


@attrs.define(eq=False)
class HeldLog:
    lines: collections.deque[str] = attrs.field(factory=collections.deque)
    bytes: int = 0
    seq: int = 0
    received_at: float = 0.0  # time.time()
    received_mono: float = 0.0


class FellowLogs:
    def __init__(self, want_s: float = WANT_S, held_bytes: int = HELD_BYTES) -> None:
        self.want_s, self.held_bytes = want_s, held_bytes
        self._held: dict[int, HeldLog] = {}
        self._wanted_until: dict[int, float] = {}

    def want(self, fellow_id: int) -> None:
        """Someone reads this fellow's log: ask it for its tail (in its heartbeat answers)."""
        self._wanted_until[fellow_id] = time.monotonic() + self.want_s

    def wanted(self, fellow_id: int) -> bool:
        until = self._wanted_until.get(fellow_id)
        if until is None:
            return False
        if time.monotonic() > until:
            del self._wanted_until[fellow_id]
            return False
        return True

    def forget(self, fellow_id: int) -> None:
        """A forgotten fellow's tail goes with it."""
        self._held.pop(fellow_id, None)
        self._wanted_until.pop(fellow_id, None)

    def held(self, fellow_id: int) -> HeldLog | None:
        return self._held.get(fellow_id)

    def post(self, fellow_id: int, tail: FellowLogTail) -> int:
        """Take a fellow's post; returns the seq now held. A post that continues a tail the
        leader does not hold (it restarted, or a post was lost) is a 409: the fellow then sends
        its whole tail."""
        held = self._held.get(fellow_id)
        if tail.replace or held is None:
            if not tail.replace:
                raise ApiError(409, f"no log of fellow {fellow_id} is held to continue; send "
                                    "the whole tail", code="log_out_of_step")
            held = self._held[fellow_id] = HeldLog()
        elif held.seq != tail.seq - len(tail.lines):
            raise ApiError(409, f"the held log of fellow {fellow_id} ends at line {held.seq}, "
                                f"the post continues line {tail.seq - len(tail.lines)}; send "
                                "the whole tail", code="log_out_of_step")
        for line in tail.lines:
            # Relayed to consoles and `swarm fellow-log`: a fellow's line is shown, never
            # obeyed (an OSC 2 in it retitled the reader's terminal). Cleaned as the fellow's
            # own ring cleans it, whatever the poster ran.
            line = log_line(line, MAX_LINE_CHARS)
            held.lines.append(line)
            held.bytes += len(line.encode()) + 1
        while held.lines and (len(held.lines) > MAX_LOG_LINES or held.bytes > self.held_bytes):
            held.bytes -= len(held.lines.popleft().encode()) + 1
        held.seq = tail.seq
        held.received_at, held.received_mono = time.time(), time.monotonic()
        return held.seq
