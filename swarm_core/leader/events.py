"""Fan-out of leader events to WebSocket subscribers (console, ``swarm watch``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Iterator

import attrs

from swarm_core import jsonio
from swarm_core.contract.events import Event, EventData, event_json

# A console that falls this far behind is cut off (and reconnects) rather than letting the
# leader's memory grow without bound.
SUBSCRIBER_BACKLOG = 20_000


class Published:
    """An event as published; its frame is encoded when a WebSocket first sends it, and once
    however many subscribers send it."""

    __slots__ = ("_frame", "event")

    def __init__(self, event: Event) -> None:
        self.event = event
        self._frame: bytes | None = None

    def frame(self) -> bytes:
        if self._frame is None:
            self._frame = jsonio.dumps(event_json(self.event))
        return self._frame


@attrs.define(eq=False)
class Subscriber:
    queue: asyncio.Queue[Published | None]
    types: frozenset[str] | None = None
    job_id: str | None = None
    overflowed: bool = False

    def wants(self, event: Event) -> bool:
        if self.types is not None and event.type.split(".", 1)[0] not in self.types:
            return False
        # (a fellow's events name the job it runs: they reach that job's subscribers too)
        return self.job_id is None or getattr(event.data, "job_id", None) == self.job_id


RECENT = 1000  # kept for plain GET /events (polling without a WebSocket)


class EventHub:
    def __init__(self) -> None:
        self._subs: set[Subscriber] = set()
        self.seq = 0
        self._recent: collections.deque[Event] = collections.deque(maxlen=RECENT)
        self._held: list[EventData] | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Events published in the block go out when it ends, none if it raises: a change
        the store refused is not announced (``leader/undo.py``)."""
        held: list[EventData] = []
        outer, self._held = self._held, held
        try:
            yield
        finally:
            self._held = outer
        for data in held:
            self.publish(data)  # (into the outer block's, when nested)

    def recent(self, after: int = 0, types: frozenset[str] | None = None,
               job_id: str | None = None) -> list[Event]:
        probe = Subscriber(asyncio.Queue(1), types, job_id)
        return [e for e in self._recent if (e.seq or 0) > after and probe.wants(e)]

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

    def publish(self, data: EventData) -> None:
        if self._held is not None:
            self._held.append(data)
            return
        self.seq += 1
        event = Event(data, self.seq, time.time())
        self._recent.append(event)
        if not self._subs:
            return
        published = Published(event)
        for sub in list(self._subs):
            if sub.overflowed or not sub.wants(event):
                continue
            try:
                sub.queue.put_nowait(published)
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
