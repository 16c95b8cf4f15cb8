"""The job queue and the dispatcher: one job runs at a time, oldest PENDING first."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import attrs

from swarm_core.leader.errors import ApiError
from swarm_core.leader.events import EventHub
from swarm_core.leader.registry import FellowRecord, FellowRegistry
from swarm_core.leader.store import Store
from swarm_core.protocol import JobInfo, JobState, JobStatusUpdate, JobSubmit, Topology
from swarm_core.schema import converter, structure_persisted


@attrs.define(eq=False)
class JobRecord:
    job_id: str
    seq: int
    name: str
    kind: str
    state: JobState
    created_at: float
    topology: Topology
    model: dict[str, Any]
    training: dict[str, Any]
    started_at: float | None = None
    finished_at: float | None = None
    last_step: int = 0
    last_loss: float | None = None
    fellows: list[int] = attrs.field(factory=list)
    done_fellows: list[int] = attrs.field(factory=list)
    reason: str = ""
    # Leader-local: when this leader process began watching the run (restart grace).
    watched_since: float | None = attrs.field(default=None, metadata={"transient": True})

    def persistable(self) -> dict[str, Any]:
        return {
            f.name: converter.unstructure(getattr(self, f.name))
            for f in attrs.fields(JobRecord) if not f.metadata.get("transient")
        }


class JobQueue:
    def __init__(self, store: Store, registry: FellowRegistry, hub: EventHub) -> None:
        self.store = store
        self.registry = registry
        self.hub = hub
        self._jobs: dict[str, JobRecord] = {}
        for row in store.load_jobs():
            job = structure_persisted(row, JobRecord)
            self._jobs[job.job_id] = job
            if job.state is JobState.RUNNING:
                # Its fellows get a heartbeat timeout to come back after a leader restart.
                job.watched_since = time.monotonic()
                for fid in job.fellows:
                    with contextlib.suppress(ApiError):
                        registry.get(fid).assigned_job = job.job_id

    # queries ----------------------------------------------------------------------------------
    def all(self) -> list[JobRecord]:
        return sorted(self._jobs.values(), key=lambda j: j.seq)

    def get(self, job_id: str) -> JobRecord:
        job = self._jobs.get(job_id)
        if job is None:
            raise ApiError(404, f"no job {job_id!r}", code="unknown_job")
        return job

    def count(self, state: JobState) -> int:
        return sum(1 for j in self._jobs.values() if j.state is state)

    def running(self) -> JobRecord | None:
        return next((j for j in self.all() if j.state is JobState.RUNNING), None)

    def info(self, job: JobRecord) -> JobInfo:
        return JobInfo(
            job_id=job.job_id, name=job.name, kind=job.kind, state=job.state.value,
            created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
            last_step=job.last_step, last_loss=job.last_loss, fellows=list(job.fellows),
            topology=job.topology, reason=job.reason, model=job.model, training=job.training,
            waiting_for=self.waiting_for(job),
        )

    def waiting_for(self, job: JobRecord) -> str:
        if job.state is not JobState.PENDING:
            return ""
        running = self.running()
        if running is not None:
            return f"job {running.job_id} is running"
        ahead = [j for j in self.all() if j.state is JobState.PENDING and j.seq < job.seq]
        if ahead:
            return f"{len(ahead)} job(s) ahead in the queue"
        ready = len(self.registry.ready())
        return f"needs {job.topology.fellows} ready fellow(s), {ready} ready"

    # mutations --------------------------------------------------------------------------------
    def submit(self, req: JobSubmit) -> JobRecord:
        seq = self.store.next_job_seq()
        job = JobRecord(
            job_id=f"job-{seq:06d}", seq=seq, name=req.name, kind=req.kind,
            state=JobState.PENDING, created_at=time.time(), topology=req.topology,
            model=req.model, training=req.training,
        )
        self.store.insert_job(seq, job.persistable())
        self._jobs[job.job_id] = job
        self._event(job, "job.submitted")
        return job

    def cancel(self, job_id: str) -> JobRecord:
        job = self.get(job_id)
        if job.state.terminal:
            raise ApiError(409, f"job {job_id} is already {job.state.value}",
                           code="job_finished")
        self._finish(job, JobState.CANCELLED, "cancelled by request")
        return job

    def status_update(self, job_id: str, fellow: FellowRecord, upd: JobStatusUpdate) -> JobRecord:
        job = self.get(job_id)
        if upd.fellow_id not in job.fellows:
            raise ApiError(409, f"fellow {upd.fellow_id} is not part of job {job_id}",
                           code="not_in_job", field="$.fellow_id")
        if job.state is not JobState.RUNNING:
            raise ApiError(409, f"job {job_id} is {job.state.value}, not RUNNING",
                           code="job_not_running")
        if upd.step > job.last_step:
            job.last_step = upd.step
        if upd.loss is not None:
            job.last_loss = upd.loss
        self.hub.publish("metric", {
            "job_id": job_id, "fellow_id": fellow.fellow_id, "step": upd.step,
            "loss": upd.loss, "tokens_per_s": upd.tokens_per_s, "state": upd.state,
        })
        if upd.state == "FAILED":
            msg = f": {upd.message}" if upd.message else ""
            self._finish(job, JobState.FAILED,
                         f"fellow {fellow.fellow_id} ({fellow.name}) failed at step "
                         f"{upd.step}{msg}")
        elif upd.state == "COMPLETED":
            if fellow.fellow_id not in job.done_fellows:
                job.done_fellows.append(fellow.fellow_id)
            fellow.assigned_job = None
            if set(job.done_fellows) >= set(job.fellows):
                self._finish(job, JobState.COMPLETED, upd.message or "")
            else:
                self._save(job)
        else:
            self._save(job, quiet=True)
        return job

    def dispatch(self) -> JobRecord | None:
        """Start the oldest PENDING job if nothing runs and enough fellows are ready."""
        if self.running() is not None:
            return None
        pending = [j for j in self.all() if j.state is JobState.PENDING]
        if not pending:
            return None
        job = pending[0]
        ready = self.registry.ready()
        if len(ready) < job.topology.fellows:
            return None
        chosen = ready[: job.topology.fellows]
        job.state = JobState.RUNNING
        job.started_at = time.time()
        job.watched_since = time.monotonic()
        job.fellows = [f.fellow_id for f in chosen]
        placement = [
            {"stage": i, "fellow_id": f.fellow_id, "name": f.name, "data_addr": f.data_addr}
            for i, f in enumerate(chosen)
        ]
        for i, fellow in enumerate(chosen):
            fellow.assigned_job = job.job_id
            self.registry.send(fellow, "START", job.job_id, {
                "job_id": job.job_id, "kind": job.kind, "name": job.name,
                "stage": i, "num_stages": len(chosen), "placement": placement,
                "model": job.model, "training": job.training,
            })
        self._save(job)
        self._event(job, "job.started")
        return job

    def check_liveness(self) -> None:
        """Fail the running job when one of its fellows stopped heartbeating or left."""
        job = self.running()
        if job is None:
            return
        now = time.monotonic()
        grace = self.registry.stale_after_s
        if job.watched_since is not None and now - job.watched_since < grace:
            return
        for fid in job.fellows:
            if fid in job.done_fellows:
                continue
            try:
                rec = self.registry.get(fid)
            except ApiError:
                self._finish(job, JobState.FAILED, f"fellow {fid} vanished from the registry")
                return
            status = self.registry.status(rec, now)
            if status in ("stale", "offline", "released", "leaving"):
                what = {"stale": "stopped heartbeating", "offline": "did not come back",
                        "released": "was released", "leaving": "left"}[status]
                self._finish(job, JobState.FAILED,
                             f"fellow {fid} ({rec.name}) {what} at step {rec.current_step}")
                return

    def fellow_replaced(self, rec: FellowRecord) -> None:
        """A fellow process restarted under the same name: the job it ran lost its state."""
        job_id = rec.assigned_job
        if job_id is None or job_id not in self._jobs:
            return
        job = self._jobs[job_id]
        if job.state is JobState.RUNNING:
            self._finish(job, JobState.FAILED,
                         f"fellow {rec.fellow_id} ({rec.name}) restarted at step "
                         f"{rec.current_step}")

    # internals --------------------------------------------------------------------------------
    def _finish(self, job: JobRecord, state: JobState, reason: str) -> None:
        was_running = job.state is JobState.RUNNING
        job.state, job.reason, job.finished_at = state, reason, time.time()
        if was_running:
            for fid in job.fellows:
                try:
                    rec = self.registry.get(fid)
                except ApiError:
                    continue
                if rec.assigned_job == job.job_id:
                    rec.assigned_job = None
                    if fid not in job.done_fellows:
                        self.registry.send(rec, "STOP", job.job_id, {"reason": reason})
        self._save(job)
        self._event(job, f"job.{state.value.lower()}")

    def _save(self, job: JobRecord, quiet: bool = False) -> None:
        self.store.save_job(job.persistable())
        if not quiet:
            self._event(job, "job.updated")

    def _event(self, job: JobRecord, kind: str) -> None:
        self.hub.publish(kind, {
            "job_id": job.job_id, "name": job.name, "state": job.state.value,
            "last_step": job.last_step, "last_loss": job.last_loss, "fellows": job.fellows,
            "reason": job.reason,
        })
