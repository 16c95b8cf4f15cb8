"""The fellow registry: identities, liveness, link limits and the per-fellow signal queue."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any

import attrs

from swarm_core.contract import CellRef, Heartbeat
from swarm_core.leader.errors import ApiError
from swarm_core.protocol import (
    ByteCounters,
    FellowInfo,
    FellowStatus,
    LinkLimits,
    NodeInfo,
    PeerLinkState,
    RegisterRequest,
    Signal,
    SignalKind,
)
from swarm_core.schema import structure_persisted

THROTTLED_MBPS = 1.0
STUCK_AFTER_S = 30.0


@attrs.define(eq=False)
class FellowRecord:
    fellow_id: int
    name: str
    instance_id: str
    host: str
    pid: int
    devices: list[str]
    threads: int
    data_addr: str | None
    registered_at: float
    data_addrs: list[str] = attrs.field(factory=list)
    reported_status: FellowStatus = FellowStatus.READY
    current_job: str | None = None
    current_stage: int | None = None
    current_step: int = 0
    last_loss: float | None = None
    tokens_per_s: float = 0.0
    counters: ByteCounters = attrs.field(factory=ByteCounters)
    link: LinkLimits = attrs.field(factory=LinkLimits)
    last_heartbeat: float | None = None
    # Not persisted: they belong to one leader process and one fellow process.
    session: str = attrs.field(default="", metadata={"transient": True})
    assigned_job: str | None = attrs.field(default=None, metadata={"transient": True})
    last_seen: float | None = attrs.field(default=None, metadata={"transient": True})
    # Its last heartbeat's (not its registration's): only a heartbeat says what it runs.
    last_beat: float | None = attrs.field(default=None, metadata={"transient": True})
    step_changed: float | None = attrs.field(default=None, metadata={"transient": True})
    next_seq: int = attrs.field(default=1, metadata={"transient": True})
    pending: list[Signal] = attrs.field(factory=list, metadata={"transient": True})
    # The cells its last heartbeat said it runs (what the leader reconciles its jobs with).
    running: list[CellRef] = attrs.field(factory=list, metadata={"transient": True})
    peers: list[PeerLinkState] = attrs.field(factory=list, metadata={"transient": True})
    slowdown: float = attrs.field(default=1.0, metadata={"transient": True})
    wakeup: asyncio.Event = attrs.field(factory=asyncio.Event, metadata={"transient": True})

    def status(self, now: float, stale_after: float) -> FellowStatus:
        if self.reported_status.left:
            return self.reported_status
        if self.last_seen is None:
            return FellowStatus.OFFLINE
        if now - self.last_seen > stale_after:
            return FellowStatus.STALE
        return self.reported_status

    def persistable(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _PLAIN_FIELDS}
        out["devices"] = list(self.devices)
        out["data_addrs"] = list(self.data_addrs)
        c, lk = self.counters, self.link
        out["counters"] = {"control_tx": c.control_tx, "control_rx": c.control_rx,
                           "data_tx": c.data_tx, "data_rx": c.data_rx}
        out["link"] = {"tx_mbps": lk.tx_mbps, "rx_mbps": lk.rx_mbps,
                       "latency_ms": lk.latency_ms}
        return out


_PLAIN_FIELDS = tuple(
    f.name for f in attrs.fields(FellowRecord)
    if not f.metadata.get("transient") and f.name not in ("devices", "data_addrs", "counters",
                                                           "link"))


class FellowRegistry:
    def __init__(self, stale_after_s: float, heartbeat_interval_s: float) -> None:
        self.stale_after_s = stale_after_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self._by_id: dict[int, FellowRecord] = {}
        self._by_name: dict[str, FellowRecord] = {}
        self._by_session: dict[str, FellowRecord] = {}
        # Identity and status changes are written soon; telemetry (counters, step) rarely.
        self.dirty: set[int] = set()
        self.telemetry_dirty: set[int] = set()
        self.closing = False
        self.id_floor = 0  # a new fellow's id is at least this (forgotten ids are not reused)

    # loading ----------------------------------------------------------------------------------
    def load(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            rec = structure_persisted(row, FellowRecord)
            self._by_id[rec.fellow_id] = rec
            self._by_name[rec.name] = rec

    # queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[FellowRecord]:
        return sorted(self._by_id.values(), key=lambda r: r.fellow_id)

    def get(self, fellow_id: int) -> FellowRecord:
        rec = self._by_id.get(fellow_id)
        if rec is None:
            raise ApiError(404, f"no fellow with id {fellow_id}", code="unknown_fellow")
        return rec

    def find(self, fellow_id: int) -> FellowRecord | None:
        return self._by_id.get(fellow_id)

    def by_session(self, session: str | None, fellow_id: int | None = None) -> FellowRecord:
        rec = self._by_session.get(session or "")
        if rec is None:
            raise ApiError(401, "unknown fellow session; register again", code="unknown_session")
        if fellow_id is not None and rec.fellow_id != fellow_id:
            raise ApiError(403, f"this session belongs to fellow {rec.fellow_id}, "
                                f"not fellow {fellow_id}", code="wrong_fellow")
        return rec

    def status(self, rec: FellowRecord, now: float | None = None) -> FellowStatus:
        return rec.status(time.monotonic() if now is None else now, self.stale_after_s)

    def ready(self) -> list[FellowRecord]:
        now = time.monotonic()
        return [r for r in self.all()
                if r.assigned_job is None and self.status(r, now) is FellowStatus.READY]

    def info(self, rec: FellowRecord, now_mono: float | None = None) -> FellowInfo:
        now_mono = time.monotonic() if now_mono is None else now_mono
        return FellowInfo(
            fellow_id=rec.fellow_id, name=rec.name, host=rec.host, pid=rec.pid,
            devices=list(rec.devices), threads=rec.threads, data_addr=rec.data_addr,
            status=self.status(rec, now_mono), reported_status=rec.reported_status,
            current_job=rec.current_job or rec.assigned_job, current_stage=rec.current_stage,
            current_step=rec.current_step, last_loss=rec.last_loss,
            tokens_per_s=rec.tokens_per_s, counters=rec.counters, link=rec.link,
            registered_at=rec.registered_at, last_heartbeat=rec.last_heartbeat,
            heartbeat_age_s=None if rec.last_seen is None else round(now_mono - rec.last_seen, 3),
            note=self.note(rec, now_mono), data_addrs=list(rec.data_addrs),
            peers=list(rec.peers), slowdown=rec.slowdown,
        )

    def note(self, rec: FellowRecord, now_mono: float) -> str:
        """A live fellow on a starved link is slow, not dead: say so instead of staling it."""
        notes = []
        for name, mbps in (("tx", rec.link.tx_mbps), ("rx", rec.link.rx_mbps)):
            if mbps is not None and mbps < THROTTLED_MBPS:
                notes.append(f"throttled link: {name} {mbps:g} Mbit/s")
        if rec.slowdown > 1.0:  # (slow on purpose: a peer emulating a slower machine)
            notes.append(f"slowed {rec.slowdown:g}x (emulated)")
        if rec.reported_status is FellowStatus.BUSY and rec.step_changed is not None \
                and now_mono - rec.step_changed > STUCK_AFTER_S:
            notes.append(f"no new step for {now_mono - rec.step_changed:.0f}s "
                         f"(at step {rec.current_step})")
        return "; ".join(notes)

    def node(self, rec: FellowRecord) -> NodeInfo:
        c = rec.counters
        return NodeInfo(
            fellow_id=rec.fellow_id, name=rec.name, host=rec.host, status=self.status(rec),
            control_tx=c.control_tx, control_rx=c.control_rx,
            data_tx=c.data_tx, data_rx=c.data_rx,
        )

    # mutations --------------------------------------------------------------------------------
    def register(self, req: RegisterRequest) -> tuple[FellowRecord, bool]:
        """Returns the record and whether it replaced another process (a new instance)."""
        now_mono, now = time.monotonic(), time.time()
        rec = self._by_name.get(req.name)
        replaced = False
        if rec is not None:
            live = self.status(rec, now_mono).live
            if live and rec.instance_id != req.instance_id:
                age = now_mono - (rec.last_seen or now_mono)
                raise ApiError(
                    409,
                    f"fellow name {req.name!r} is held by a live fellow (pid {rec.pid} on "
                    f"{rec.host}, heartbeat {age:.1f}s ago); pick another --name or retry "
                    f"after {self.stale_after_s:g}s",
                    code="name_in_use", field="$.name",
                )
            replaced = rec.instance_id != req.instance_id
            self._by_session.pop(rec.session, None)
        else:
            fellow_id = max(max(self._by_id, default=-1) + 1, self.id_floor)
            rec = FellowRecord(
                fellow_id=fellow_id, name=req.name, instance_id=req.instance_id, host=req.host,
                pid=req.pid, devices=list(req.devices), threads=req.threads,
                data_addr=req.data_addr, registered_at=now,
            )
            self._by_id[fellow_id] = rec
            self._by_name[req.name] = rec
        rec.instance_id = req.instance_id
        rec.host, rec.pid, rec.devices = req.host, req.pid, list(req.devices)
        rec.threads, rec.data_addr = req.threads, req.data_addr
        rec.data_addrs = list(req.data_addrs)
        rec.registered_at = now if replaced or rec.last_heartbeat is None else rec.registered_at
        rec.session = secrets.token_urlsafe(24)
        rec.reported_status = FellowStatus.READY
        rec.last_seen = now_mono
        rec.last_heartbeat = now
        if replaced:
            rec.running = []
            rec.pending.clear()
            rec.next_seq = 1
            rec.link = LinkLimits()
        self._by_session[rec.session] = rec
        self.dirty.add(rec.fellow_id)
        return rec, replaced

    def heartbeat(self, rec: FellowRecord, hb: Heartbeat) -> str:
        """Apply a heartbeat; returns the status before it (to spot transitions)."""
        now_mono = time.monotonic()
        before = self.status(rec, now_mono)
        rec_link_before, slowdown_before = rec.link, rec.slowdown
        if hb.current_step != rec.current_step or rec.step_changed is None \
                or hb.status != FellowStatus.BUSY:
            rec.step_changed = now_mono
        rec.reported_status = FellowStatus(hb.status)
        rec.current_job, rec.current_stage = hb.current_job, hb.current_stage
        rec.current_step, rec.last_loss = hb.current_step, hb.last_loss
        rec.tokens_per_s, rec.counters, rec.link = hb.tokens_per_s, hb.counters, hb.link
        rec.last_seen, rec.last_heartbeat = now_mono, time.time()
        rec.last_beat = now_mono
        rec.running = list(hb.running)
        rec.peers = list(hb.peers)
        rec.slowdown = hb.slowdown
        # Signals up to the fellow's signal_seq are applied; forget them.
        rec.pending = [s for s in rec.pending if s.seq > hb.signal_seq]
        if rec.reported_status != before or hb.link != rec_link_before \
                or hb.slowdown != slowdown_before:
            self.dirty.add(rec.fellow_id)
        else:
            self.telemetry_dirty.add(rec.fellow_id)
        if rec.reported_status.left:
            self._by_session.pop(rec.session, None)
        return before

    def forget(self, rec: FellowRecord) -> None:
        """Drop a fellow's record (one that is gone: the caller checked). Should it come back
        under its name, it registers as a new fellow with a new id."""
        self._by_id.pop(rec.fellow_id, None)
        if self._by_name.get(rec.name) is rec:
            del self._by_name[rec.name]
        self._by_session.pop(rec.session, None)
        self.dirty.discard(rec.fellow_id)
        self.telemetry_dirty.discard(rec.fellow_id)
        self.id_floor = max(self.id_floor, rec.fellow_id + 1)
        rec.wakeup.set()  # (a poll still waiting ends)

    def send(self, rec: FellowRecord, kind: SignalKind, job_id: str | None = None,
             payload: dict[str, Any] | None = None) -> Signal:
        sig = Signal(seq=rec.next_seq, kind=kind, job_id=job_id, payload=payload or {})
        rec.next_seq += 1
        rec.pending.append(sig)
        rec.wakeup.set()
        return sig

    async def wait_signals(self, rec: FellowRecord, after: int, timeout: float) -> list[Signal]:
        rec.pending = [s for s in rec.pending if s.seq > after]
        if not rec.pending and timeout > 0 and not self.closing:
            rec.wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rec.wakeup.wait(), timeout)
        return [s for s in rec.pending if s.seq > after]

    def pending(self, rec: FellowRecord, kind: SignalKind, job_id: str,
                **payload: Any) -> bool:
        """Whether a signal of this kind for this job, whose payload has these values, waits
        for the fellow to take it."""
        return any(s.kind == kind and s.job_id == job_id
                   and all(s.payload.get(k) == v for k, v in payload.items())
                   for s in rec.pending)

    def release_polls(self) -> None:
        """Answer every long poll now, and later ones at once: the leader is shutting down.
        (A poll's handler outlives a fellow that went away, and the server waits for it.)"""
        self.closing = True
        for rec in self._by_id.values():
            rec.wakeup.set()

    def take_dirty(self, telemetry: bool = False) -> list[dict[str, Any]]:
        """Records to write: changed ones, plus (``telemetry``) those with only new counters."""
        ids = self.dirty | self.telemetry_dirty if telemetry else self.dirty
        rows = [self._by_id[i].persistable() for i in sorted(ids) if i in self._by_id]
        self.dirty.clear()
        if telemetry:
            self.telemetry_dirty.clear()
        else:
            self.telemetry_dirty -= ids
        return rows
