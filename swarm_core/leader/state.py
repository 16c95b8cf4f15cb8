"""The leader's live state, shared by routes and background tasks under one AppKey."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import attrs

from swarm_core.contract.events import FellowUpdate, FellowUpdateType
from swarm_core.leader.events import EventHub
from swarm_core.leader.fellow_logs import FellowLogs
from swarm_core.leader.queue import JobQueue
from swarm_core.leader.registry import FellowRecord, FellowRegistry
from swarm_core.leader.store import Store, StoreWriteError


@attrs.define(eq=False)
class LeaderState:
    state_dir: Path
    store: Store
    registry: FellowRegistry
    jobs: JobQueue
    hub: EventHub
    started_at: float = attrs.field(factory=time.time)
    publishing: asyncio.Lock = attrs.field(factory=asyncio.Lock)  # (see routes.push_shard)
    logs: FellowLogs = attrs.field(factory=FellowLogs)  # fellows' own log tails, in memory

    def fellow_event(self, kind: FellowUpdateType, rec: FellowRecord) -> None:
        self.hub.publish(FellowUpdate(
            kind, rec.fellow_id, name=rec.name, status=self.registry.status(rec).value,
            job_id=rec.current_job or rec.assigned_job, step=rec.current_step,
            loss=rec.last_loss, tokens_per_s=rec.tokens_per_s, link=rec.link,
            counters=rec.counters))

    def flush(self, telemetry: bool = False) -> None:
        rows = self.registry.take_dirty(telemetry)
        try:
            self.store.save_fellows(rows)
        except StoreWriteError:
            self.registry.dirty.update(r["fellow_id"] for r in rows)  # (the next flush's)
            raise

