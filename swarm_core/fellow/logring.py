"""A fellow's own log lines, kept in memory in a bounded ring, so the leader can relay their
tail to a console on another machine (the leader keeps no fellow output; a fellow's log file,
when it has one, is on the fellow's machine)."""

from __future__ import annotations

import collections
import contextvars
import logging
import threading

from swarm_core.contract.fellow_log import MAX_LINE_CHARS, MAX_LOG_LINES
from swarm_core.validators import log_line

RING_BYTES = 256 * 1024  # what one fellow's ring holds at most (UTF-8 of its lines)

# The daemon whose task logged a record. Several daemons may share a process (the console's
# tests run them in one event loop): each ring takes its own records, and those logged outside
# any daemon's tasks (a stage's worker thread) go to every ring.
current_owner: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "swarm_fellow_log_owner", default=None)

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class LogRing(logging.Handler):
    """The newest lines logged, at most ``max_lines`` and ``max_bytes``; each line numbered
    (``seq``: how many lines were ever kept), so a reader asks for what is new since a line."""

    def __init__(self, owner: object | None = None, *, max_bytes: int = RING_BYTES,
                 max_lines: int = MAX_LOG_LINES, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.owner = owner
        self.max_bytes, self.max_lines = max_bytes, max_lines
        self.setFormatter(logging.Formatter(FORMAT))
        self._lines: collections.deque[tuple[str, int]] = collections.deque()
        self._bytes = 0
        self.seq = 0
        # (emit runs on any thread that logs; readers run on the event loop)
        self._ring_lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        owner = current_owner.get()
        return (owner is None or owner is self.owner) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # (a bad %-format in someone's log call must not break logging)
            self.handleError(record)
            return
        for line in text.splitlines() or [""]:
            self.add(line)

    def add(self, line: str) -> None:
        # Shown on someone's terminal later: no control characters, and no line without end.
        line = log_line(line, MAX_LINE_CHARS)
        size = len(line.encode()) + 1
        with self._ring_lock:
            self._lines.append((line, size))
            self._bytes += size
            self.seq += 1
            # (the newest line always stays, however small the ring)
            while len(self._lines) > 1 and (len(self._lines) > self.max_lines
                                            or self._bytes > self.max_bytes):
                self._bytes -= self._lines.popleft()[1]

    def since(self, seq: int | None) -> tuple[int, list[str], bool]:
        """(newest seq, lines, whole tail?): the lines after line ``seq``, or the whole ring
        when ``seq`` is None or its successor was already dropped (then ``whole`` is True)."""
        with self._ring_lock:
            held = len(self._lines)
            new = None if seq is None else self.seq - seq
            if new is None or new < 0 or new > held:
                return self.seq, [line for line, _ in self._lines], True
            return self.seq, [line for line, _ in list(self._lines)[held - new:]], False
