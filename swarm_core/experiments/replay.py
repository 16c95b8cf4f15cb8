"""Replaying a run's link trace and churn script live, against its running job.

The run's clock starts when the replay first sees its job RUNNING with a step done (set-up
time, which varies, is not part of the scenario). From then each trace change is a set-speed
through the leader's API (so the job records it, as `swarm set-speed` is recorded), to every
fellow of the job's placement or to the fellows the trace names; a fellow that joins later is
given the trace's current value. Each churn event is a kill (SIGKILL of the fellow's process),
a leave (the leader releases it) or a join (its process started), at its planned time. What
happened, planned time beside actual time, is written to ``churn_timeline.json`` and
``trace_timeline.json`` in the run's folder as it happens.

Kills and joins need the fellows' processes: :class:`LocalFellows` are the local cluster's
(``swarm restart-cluster``), started and stopped through its record; against any other
leader a script that kills is refused before the sweep queues anything
(:func:`check_processes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import attrs

from swarm_core import jsonio
from swarm_core.client import ClientError, SwarmClient
from swarm_core.config.traces import (
    ChurnScript,
    LinkTrace,
    LinkTraceSpec,
    PlannedEvent,
    TraceError,
    TracePoint,
    churn_timeline,
    load_trace,
)
from swarm_core.contract import JobInfo
from swarm_core.paths import atomic_write
from swarm_core.protocol import LinkLimits, SetSpeedRequest
from swarm_core.schema import structure, unstructure

CHURN_FILE = "churn_timeline.json"
TRACE_FILE = "trace_timeline.json"
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
# How often the replay looks at its job: until the clock starts (its precision), and for a
# fellow that joined and lacks the trace's current value.
START_POLL_S = 0.1
CATCH_UP_S = 1.0
CATCH_UP_GRACE_S = 3.0


# A trace's target: a fellow, and the peer fellow whose pair link it sets (None: its own).
Target = tuple[int, int | None]


def _target_name(target: Target) -> str:
    fellow, to = target
    return str(fellow) if to is None else f"{fellow}->{to}"


class ReplayError(Exception):
    """A replay that cannot run as asked (one line)."""


class _Skipped(Exception):
    """An event with nothing to act on (its fellow already down, its kill took none)."""


class FellowProcesses(Protocol):
    """What kills and joins need: a fellow's process, by its name."""

    def kill(self, name: str) -> int | None:
        """SIGKILL it; its pid, None when it was not running."""

    def start(self, name: str) -> int:
        """Start it (again); its pid."""


class LocalFellows:
    """The local cluster's fellow processes (swarm_core.local_cluster's record)."""

    def kill(self, name: str) -> int | None:
        from swarm_core.local_cluster import ClusterError, kill_fellow

        try:
            return kill_fellow(name)
        except ClusterError as exc:
            raise ReplayError(str(exc)) from None

    def start(self, name: str) -> int:
        from swarm_core.local_cluster import ClusterError, start_fellow

        try:
            return start_fellow(name).pid
        except ClusterError as exc:
            raise ReplayError(str(exc)) from None


def local_processes(leader_url: str) -> LocalFellows | None:
    """The local cluster's processes when ``leader_url`` is its leader; None otherwise."""
    from swarm_core.local_cluster import record_of

    return None if record_of(leader_url) is None else LocalFellows()


def check_processes(script: ChurnScript, run_name: str, leader_url: str,
                    processes: FellowProcesses | None) -> None:
    """ReplayError, before anything runs, when ``script`` kills or starts fellows and there
    are no processes to do it with."""
    if script.kills and processes is None:
        raise ReplayError(
            f"run {run_name}: churn script {script.name} kills or starts fellows, which needs "
            f"their processes: the leader at {leader_url} is not the local cluster's "
            "('swarm restart-cluster'); only 'leave' events work against other leaders")


@attrs.define
class Replay:
    """One run's trace and churn, played against its job (:meth:`run` until the job ends)."""

    client: SwarmClient
    job_id: str
    run_dir: Path
    trace_spec: LinkTraceSpec | None = None
    base_link: LinkLimits | None = None
    churn: ChurnScript | None = None
    seed: int = 0
    processes: FellowProcesses | None = None
    on_line: Any = print
    t0: float | None = None  # monotonic, once the job has done a step
    t0_wall: float | None = None
    churn_log: list[dict[str, Any]] = attrs.field(factory=list)
    trace_log: list[dict[str, Any]] = attrs.field(factory=list)
    _killed: dict[int, str] = attrs.field(factory=dict)  # event index -> the fellow it took
    _owed: dict[str, int] = attrs.field(factory=dict)  # fellow down -> the event that took it
    _job: JobInfo | None = None

    @property
    def elapsed(self) -> float:
        assert self.t0 is not None
        return time.monotonic() - self.t0

    async def run(self) -> None:
        """Wait for the job's first step, then play both until the job ends; the fellows a
        kill took down and whose restart is still owed are started at the end."""
        if not await self._wait_start():
            self._write()
            return
        tasks = []
        if self.trace_spec is not None:
            tasks.append(asyncio.create_task(self._play_trace()))
        if self.churn is not None:
            tasks.append(asyncio.create_task(self._play_churn()))
        tasks.append(asyncio.create_task(self._watch()))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self._restart_owed()
            self._write()

    # the job ----------------------------------------------------------------------------
    async def _poll(self) -> JobInfo | None:
        try:
            self._job = await self.client.job(self.job_id)
        except ClientError:
            return None  # (the next poll; the monitor says when the leader is gone)
        return self._job

    async def _wait_start(self) -> bool:
        while True:
            job = await self._poll()
            if job is not None and job.state in TERMINAL:
                return False
            if job is not None and job.state == "RUNNING" and job.last_step >= 1:
                self.t0, self.t0_wall = time.monotonic(), time.time()
                self.on_line(f"{self.job_id}: replay clock started at step {job.last_step}")
                return True
            await asyncio.sleep(START_POLL_S if job is not None and job.state == "RUNNING"
                                else 1.0)

    async def _watch(self) -> None:
        """Returns when the job has ended (which ends the replay)."""
        while True:
            await asyncio.sleep(CATCH_UP_S)
            job = await self._poll()
            if job is not None and job.state in TERMINAL:
                return

    async def _until(self, at_s: float) -> None:
        delay = at_s - self.elapsed
        if delay > 0:
            await asyncio.sleep(delay)

    def _cell_fellow(self, replica: int, stage: int) -> tuple[int, str] | None:
        job = self._job
        if job is None or job.placement is None:
            return None
        for cell in job.placement.stages:
            if cell.replica == replica and cell.stage == stage:
                return cell.fellow_id, cell.name
        return None

    async def _fellow_id(self, name: str) -> int | None:
        """The live fellow of that name (the newest registration of a restarted process)."""
        try:
            fellows = await self.client.fellows()
        except ClientError:
            return None
        live = [f for f in fellows if f.name == name and f.status.live]
        return max(live, key=lambda f: f.fellow_id).fellow_id if live else None

    # the trace --------------------------------------------------------------------------
    def _trace_targets(self) -> list[int]:
        job = self._job
        if job is None or job.placement is None:
            return []
        cells = job.placement.stages
        wanted = self.trace_spec.fellows if self.trace_spec else None
        return sorted({c.fellow_id for c in cells if wanted is None or c.name in wanted})

    def _pair_targets(self) -> list[Target]:
        """Per pair (the trace's ``to``): each target fellow with each named peer's fellow;
        else each target fellow alone (its own limits)."""
        spec, job = self.trace_spec, self._job
        if spec is None or spec.to is None:
            return [(f, None) for f in self._trace_targets()]
        if job is None or job.placement is None:
            return []
        peers = sorted({c.fellow_id for c in job.placement.stages if c.name in spec.to})
        return [(f, p) for f in self._trace_targets() for p in peers if p != f]

    async def _set(self, target: Target, link: LinkLimits) -> str | None:
        fellow_id, to = target
        try:
            await self.client.set_speed(fellow_id, SetSpeedRequest(
                tx_mbps=link.tx_mbps, rx_mbps=link.rx_mbps, latency_ms=link.latency_ms,
                to=to))
        except ClientError as exc:
            return str(exc)
        return None

    async def _play_trace(self) -> None:
        assert self.trace_spec is not None
        trace: LinkTrace = load_trace(Path(self.trace_spec.file))
        sent: dict[Target, float] = {}  # when each target was last sent the current value
        current: LinkLimits | None = None
        changes: Iterator[tuple[float, TracePoint]] = trace.schedule(self.trace_spec.loop)
        for at_s, point in changes:
            link = point.link(self.base_link)
            while (wait := at_s - self.elapsed) > 0:
                await asyncio.sleep(min(wait, CATCH_UP_S))
                if current is not None and wait > CATCH_UP_S:
                    await self._catch_up(current, sent)
            if link == current:
                continue
            current = link
            sent.clear()
            await self._give(link, self._pair_targets(), sent, at_s)
        while current is not None:  # (after the last row: the catch-up goes on)
            await asyncio.sleep(CATCH_UP_S)
            await self._catch_up(current, sent)

    async def _catch_up(self, link: LinkLimits, sent: dict[Target, float]) -> None:
        """``link`` again to each target whose reported link differs: a fellow that joined
        since (or was restarted), or whose job's own ``training.link`` replaced it when its
        stage started (per pair: a pair its heartbeat reports otherwise). Not twice within a
        few heartbeats (its report lags the change)."""
        targets = self._pair_targets()
        if not targets:
            return
        try:
            fellows = await self.client.fellows()
        except ClientError:
            return
        # (a pair reports its rate and latency only: what a pair set-speed sets)
        reported: dict[Target, Any] = {(f.fellow_id, None): f.link for f in fellows}
        reported.update({(f.fellow_id, p.peer_fellow): (p.tx_mbps, p.latency_ms)
                         for f in fellows for p in f.peers if p.peer_fellow is not None})
        now = time.monotonic()
        stale = [t for t in targets if t in reported
                 and reported[t] != (link if t[1] is None else (link.tx_mbps, link.latency_ms))
                 and now - sent.get(t, -1e9) > CATCH_UP_GRACE_S]
        if stale:
            await self._give(link, stale, sent, None)

    async def _give(self, link: LinkLimits, targets: list[Target], sent: dict[Target, float],
                    at_s: float | None) -> None:
        """``link`` to ``targets``, logged: ``at_s`` a change of the trace (logged even when
        no fellow is there to take it), None a catch-up."""
        actual = self.elapsed
        errors = {}
        for target in targets:
            err = await self._set(target, link)
            if err is None:
                sent[target] = time.monotonic()
            else:
                errors[_target_name(target)] = err
        pairs = self.trace_spec is not None and self.trace_spec.to is not None
        self.trace_log.append({
            "planned_s": at_s, "actual_s": round(actual, 3),
            "event": "change" if at_s is not None else "catch-up",
            "link": unstructure(link),
            **({"pairs": [list(t) for t in targets]} if pairs
               else {"fellow_ids": [f for f, _ in targets]}),
            **({"errors": errors} if errors else {})})
        self._write()

    # churn ------------------------------------------------------------------------------
    async def _play_churn(self) -> None:
        assert self.churn is not None
        job = self._job
        replicas = job.placement.replicas if job and job.placement else 1
        stages = job.placement.num_stages if job and job.placement else 1
        try:
            planned = churn_timeline(self.churn, self.seed, replicas, stages)
            for index, event in enumerate(planned):
                await self._until(event.at_s)
                await self._do(index, event)
        except TraceError as exc:
            self.churn_log.append({"error": str(exc)})
            self.on_line(f"{self.job_id}: churn stopped: {exc}")
            self._write()
        await asyncio.Event().wait()  # (the job's end ends the replay)

    async def _do(self, index: int, event: PlannedEvent) -> None:
        actual = self.elapsed
        entry: dict[str, Any] = {"index": index, "planned_s": event.at_s,
                                 "actual_s": round(actual, 3), "event": event.action,
                                 "target": event.target}
        if event.of_event is not None:
            entry["restarts"] = event.of_event
        try:
            name = await self._target_name(event)
            entry["fellow"] = name
            entry.update(await self._act(event, name))
            if event.action == "join":
                self._owed.pop(name, None)
            elif entry["outcome"] == "done":
                self._killed[index] = name
                if event.restart_after_s is not None:
                    self._owed[name] = index
        except _Skipped as exc:
            entry["outcome"] = f"skipped: {exc}"
        except (ReplayError, ClientError, OSError) as exc:
            entry["outcome"] = f"failed: {exc}"
        self.churn_log.append(entry)
        who = entry.get("fellow") or event.target
        self.on_line(f"{self.job_id}: t={actual:.1f}s {event.action} {who}: "
                     f"{entry.get('outcome', 'done')}")
        self._write()

    async def _target_name(self, event: PlannedEvent) -> str:
        if event.of_event is not None:  # (a restart: only of a fellow its event took down)
            name = self._killed.get(event.of_event)
            if name is None:
                raise _Skipped(f"event {event.of_event} took no fellow down")
            return name
        if event.fellow is not None:
            return event.fellow
        assert event.replica is not None
        await self._poll()
        cell = self._cell_fellow(event.replica, event.stage)
        if cell is None:
            raise ReplayError(f"the job has no cell replica {event.replica} stage "
                              f"{event.stage}")
        return cell[1]

    async def _act(self, event: PlannedEvent, name: str) -> dict[str, Any]:
        if event.action == "leave":
            fid = await self._fellow_id(name)
            if fid is None:
                raise _Skipped("not live")
            await self.client.release([fid])
            return {"outcome": "done", "fellow_id": fid}
        if self.processes is None:
            raise ReplayError("no fellow processes to act on")
        proc = self.processes
        if event.action == "kill":
            pid = await asyncio.to_thread(proc.kill, name)
            if pid is None:
                raise _Skipped("not running")
            return {"outcome": "done", "pid": pid}
        pid = await asyncio.to_thread(proc.start, name)
        return {"outcome": "done", "pid": pid}

    async def _restart_owed(self) -> None:
        """A fellow whose restart falls after the run's end still gets it (the next run of
        the sweep needs its fellows)."""
        if self.processes is None or self.t0 is None:
            return
        for name, index in list(self._owed.items()):
            try:
                pid = await asyncio.to_thread(self.processes.start, name)
                outcome: dict[str, Any] = {"outcome": "done", "pid": pid}
            except Exception as exc:  # (recorded: the run is over)
                outcome = {"outcome": f"failed: {exc}"}
            del self._owed[name]
            self.churn_log.append({"index": None, "planned_s": None,
                                   "actual_s": round(self.elapsed, 3), "event": "join",
                                   "target": f"fellow {name}", "fellow": name,
                                   "restarts": index, "note": "after the run ended",
                                   **outcome})

    # artifacts --------------------------------------------------------------------------
    def _write(self) -> None:
        common = {"job_id": self.job_id, "clock_started_at": self.t0_wall,
                  "clock": "seconds since the replay first saw the job RUNNING with a step "
                           "done"}
        with contextlib.suppress(OSError):  # (the run's folder is the runner's to report)
            if self.churn is not None:
                atomic_write(self.run_dir / CHURN_FILE, jsonio.dumps({
                    **common, "script": unstructure(self.churn), "seed": self.seed,
                    "events": self.churn_log}, pretty=True))
            if self.trace_spec is not None:
                atomic_write(self.run_dir / TRACE_FILE, jsonio.dumps({
                    **common, "trace": unstructure(self.trace_spec),
                    "base_link": unstructure(self.base_link), "changes": self.trace_log},
                    pretty=True))


def replay_for(client: SwarmClient, job_id: str, run_dir: Path, network: dict[str, Any],
               churn: dict[str, Any] | None, seed: int,
               processes: FellowProcesses | None, on_line: Any) -> Replay | None:
    """The replay a run's resolved network profile and churn ask for; None when neither."""
    trace = network.get("trace")
    if trace is None and churn is None:
        return None
    link = {k: network[k] for k in ("tx_mbps", "rx_mbps", "latency_ms") if k in network}
    base = structure(link, LinkLimits) if any(v for v in link.values()) else None
    script = structure(churn, ChurnScript) if churn is not None else None
    gen_seed = script.generator.seed if script and script.generator else None
    return Replay(client, job_id, run_dir,
                  trace_spec=structure(trace, LinkTraceSpec) if trace is not None else None,
                  base_link=base, churn=script,
                  seed=seed if gen_seed is None else gen_seed,
                  processes=processes, on_line=on_line)
