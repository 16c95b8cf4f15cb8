"""Fan-out of leader events to WebSocket subscribers (console, ``swarm watch``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any

import attrs

from swarm_core import jsonio

# A console that falls this far behind is cut off (and reconnects) rather than letting the
# leader's memory grow without bound.
SUBSCRIBER_BACKLOG = 20_000


@attrs.define(eq=False)
class Subscriber:
    queue: asyncio.Queue[bytes | None]
    types: frozenset[str] | None = None
    job_id: str | None = None
    overflowed: bool = False

    def wants(self, kind: str, data: dict[str, Any]) -> bool:
        if self.types is not None and kind.split(".", 1)[0] not in self.types:
            return False
        return self.job_id is None or data.get("job_id") == self.job_id


RECENT = 1000  # kept for plain GET /events (polling without a WebSocket)


class EventHub:
    def __init__(self) -> None:
        self._subs: set[Subscriber] = set()
        self.seq = 0
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)

    def recent(self, after: int = 0, types: frozenset[str] | None = None,
               job_id: str | None = None) -> list[dict[str, Any]]:
        probe = Subscriber(asyncio.Queue(1), types, job_id)
        return [e for e in self._recent
                if e["seq"] > after and probe.wants(e["type"], e["data"])]

    def subscribe(self, types: frozenset[str] | None = None,
                  job_id: str | None = None) -> Subscriber:
        sub = Subscriber(asyncio.Queue(SUBSCRIBER_BACKLOG), types, job_id)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subs.discard(sub)

    @property
    def subscriber_count(self) -> int:
        return len(self._subs)

    def publish(self, kind: str, data: dict[str, Any]) -> None:
        self.seq += 1
        self._recent.append({"seq": self.seq, "ts": time.time(), "type": kind, "data": data})
        if not self._subs:
            return
        frame: bytes | None = None
        for sub in list(self._subs):
            if sub.overflowed or not sub.wants(kind, data):
                continue
            if frame is None:
                frame = jsonio.dumps(
                    {"seq": self.seq, "ts": time.time(), "type": kind, "data": data}
                )
            try:
                sub.queue.put_nowait(frame)
            except asyncio.QueueFull:
                sub.overflowed = True
                self._subs.discard(sub)
                # Wake the writer so it closes the socket with a reason.
                sub.queue._queue.clear()  # type: ignore[attr-defined]
                sub.queue.put_nowait(None)

    def close_all(self) -> None:
        for sub in list(self._subs):
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait(None)
        self._subs.clear()
