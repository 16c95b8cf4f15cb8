"""The leader's live state, shared by routes and background tasks under one AppKey."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import attrs

from swarm_core.leader.events import EventHub
from swarm_core.leader.fellow_logs import FellowLogs
from swarm_core.leader.queue import JobQueue
from swarm_core.leader.registry import FellowRecord, FellowRegistry
from swarm_core.leader.store import Store


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

    def fellow_event(self, kind: str, rec: FellowRecord) -> None:
        self.hub.publish(kind, {
            "fellow_id": rec.fellow_id, "name": rec.name, "status": self.registry.status(rec),
            "job_id": rec.current_job or rec.assigned_job, "step": rec.current_step,
            "loss": rec.last_loss,
            "tokens_per_s": rec.tokens_per_s, "link": _link(rec), "counters": _counters(rec),
        })

    def flush(self, telemetry: bool = False) -> None:
        self.store.save_fellows(self.registry.take_dirty(telemetry))


def _link(rec: FellowRecord) -> dict[str, float | None]:
    return {"tx_mbps": rec.link.tx_mbps, "rx_mbps": rec.link.rx_mbps,
            "latency_ms": rec.link.latency_ms}


def _counters(rec: FellowRecord) -> dict[str, int]:
    c = rec.counters
    return {"control_tx": c.control_tx, "control_rx": c.control_rx,
            "data_tx": c.data_tx, "data_rx": c.data_rx}
