"""The job queue and the dispatcher: one job runs at a time, oldest PENDING first."""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from pathlib import Path
from typing import Any

import attrs

from swarm_core import jsonio
from swarm_core.config.schemas import ModelConfig, TrainingConfig, job_shape_error
from swarm_core.leader.errors import ApiError
from swarm_core.leader.events import EventHub
from swarm_core.leader.registry import FellowRecord, FellowRegistry
from swarm_core.leader.store import Store
from swarm_core.leader.uploads import complete_checkpoints
from swarm_core.paths import atomic_write
from swarm_core.pipeline.placement import FellowSlots, PlacementError, plan
from swarm_core.protocol import (
    JobInfo,
    JobState,
    JobStatusUpdate,
    JobSubmit,
    SmokeTraining,
    Topology,
    link_changes_in_all,
    perplexity,
)
from swarm_core.schema import (
    SchemaError,
    converter,
    structure,
    structure_persisted,
    unstructure,
)


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
    done_stages: list[int] = attrs.field(factory=list)
    reason: str = ""
    metrics: dict[str, Any] = attrs.field(factory=dict)
    placement: dict[str, Any] | None = None
    latest_shard_pushes: dict[str, Any] = attrs.field(factory=dict)
    attempt: int = 0
    restarts: list[dict[str, Any]] = attrs.field(factory=list)
    # Link limits set live on its fellows while it ran: the run's network, as it really was.
    link_changes: list[dict[str, Any]] = attrs.field(factory=list)
    link_changes_total: int = 0  # all of them, also those the capped list let go
    # Leader-local: when this leader process began watching the run (restart grace).
    watched_since: float | None = attrs.field(default=None, metadata={"transient": True})
    # Set while the job waits out the heartbeat timeout to see which fellows are really gone.
    recovering_since: float | None = attrs.field(default=None, metadata={"transient": True})
    recover_reason: str = attrs.field(default="", metadata={"transient": True})
    # A FAILED report that blames a neighbour's link, held until the cause shows (see
    # JobQueue._blamed): the reason to use if none does, the stage it blames, and until when
    # (kept across a leader restart, which re-arms the wait).
    held_reason: str = ""
    held_stage: int | None = None
    held_until: float = attrs.field(default=0.0, metadata={"transient": True})
    # The step being assembled from every stage's report (written through to the store).
    current: dict[int, dict[str, Any]] = attrs.field(factory=dict,
                                                     metadata={"transient": True})

    def persistable(self) -> dict[str, Any]:
        return {
            f.name: converter.unstructure(getattr(self, f.name))
            for f in attrs.fields(JobRecord) if not f.metadata.get("transient")
        }


MAX_LINK_CHANGES = 200


def _resume_policy(job: JobRecord) -> str:
    """What a lost stage leads to: "fail", or "replace" (recover on a spare fellow)."""
    return job.training.get("resume_policy", "fail") if job.kind == "train" else "fail"


class JobQueue:
    def __init__(self, store: Store, registry: FellowRegistry, hub: EventHub,
                 runs_dir: Path | None = None) -> None:
        self.store = store
        self.runs_dir = runs_dir
        self.registry = registry
        self.hub = hub
        self._jobs: dict[str, JobRecord] = {}
        for row in store.load_jobs():
            job = structure_persisted(row, JobRecord)
            self._jobs[job.job_id] = job
            if job.state is JobState.RUNNING:
                # Its fellows get a heartbeat timeout to come back after a leader restart.
                job.watched_since = time.monotonic()
                if job.held_reason:
                    job.held_until = job.watched_since + self._hold_s()
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

    def info(self, job: JobRecord, with_history: bool = False) -> JobInfo:
        return JobInfo(
            job_id=job.job_id, name=job.name, kind=job.kind, state=job.state.value,
            created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
            last_step=job.last_step, last_loss=job.last_loss, fellows=list(job.fellows),
            topology=job.topology, reason=job.reason, model=job.model, training=job.training,
            waiting_for=self.waiting_for(job), metrics=job.metrics, placement=job.placement,
            loss_history=self.loss_history(job) if with_history else [],
            latest_shard_pushes=job.latest_shard_pushes, attempt=job.attempt,
            restarts=job.restarts, link_changes=job.link_changes,
            link_changes_total=link_changes_in_all(job.link_changes, job.link_changes_total),
        )

    def loss_history(self, job: JobRecord) -> list[list[float]]:
        return [[r["step"], r["loss"]] for r in self.store.progress(job.job_id)
                if r.get("loss") is not None]

    def waiting_for(self, job: JobRecord) -> str:
        if job.state is not JobState.PENDING:
            return ""
        running = self.running()
        if running is not None:
            return f"job {running.job_id} is running"
        ahead = [j for j in self.all() if j.state is JobState.PENDING and j.seq < job.seq]
        if ahead:
            return f"{len(ahead)} job(s) ahead in the queue"
        ready = self.registry.ready()
        per_fellow = job.topology.slots_per_fellow
        if per_fellow > 1:
            able = sum(1 for f in ready if len(f.devices) >= per_fellow)
            return (f"needs {job.topology.fellows} ready fellow(s) with {per_fellow} device "
                    f"slots, {able} ready")
        return f"needs {job.topology.fellows} ready fellow(s), {len(ready)} ready"

    # mutations --------------------------------------------------------------------------------
    def submit(self, req: JobSubmit) -> JobRecord:
        model, training = req.model, req.training
        if req.kind == "train":
            model, training = resolve_train_payload(req)
        else:
            model, training = resolve_smoke_payload(req)
        seq = self.store.next_job_seq()
        job = JobRecord(
            job_id=f"job-{seq:06d}", seq=seq, name=req.name, kind=req.kind,
            state=JobState.PENDING, created_at=time.time(), topology=req.topology,
            model=model, training=training,
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
        stage = job.fellows.index(upd.fellow_id) if upd.stage is None else upd.stage
        if not self.holds(job, upd.fellow_id, stage):
            raise ApiError(409, f"fellow {upd.fellow_id} does not hold stage {stage} of "
                                f"{job_id}", code="not_in_job", field="$.stage")
        if job.state is not JobState.RUNNING:
            raise ApiError(409, f"job {job_id} is {job.state.value}, not RUNNING",
                           code="job_not_running")
        if upd.attempt != job.attempt or job.recovering_since is not None:
            return job  # from before a restart, or while recovering: nothing to learn
        if upd.step > job.last_step:
            job.last_step = upd.step
        if upd.loss is not None:
            job.last_loss = upd.loss
        self._merge_metrics(job, stage, fellow.fellow_id, upd)
        if upd.state == "RUNNING" and upd.metrics and job.kind == "train":
            self._record_progress(job, stage, upd)
        self.hub.publish("metric", {
            "job_id": job_id, "fellow_id": fellow.fellow_id, "stage": stage, "step": upd.step,
            "loss": upd.loss, "tokens_per_s": upd.tokens_per_s, "state": upd.state,
            "metrics": upd.metrics,
        })
        if upd.state == "FAILED":
            msg = f": {upd.message}" if upd.message else ""
            reason = f"fellow {fellow.fellow_id} ({fellow.name}) failed at step {upd.step}{msg}"
            blamed = upd.blames_stage
            # Only under resume_policy fail: a recovery waits out the heartbeat timeout anyway
            # and names the fellows it lost from their status.
            if blamed is not None and abs(blamed - stage) == 1 and blamed < len(job.fellows) \
                    and blamed not in job.done_stages and _resume_policy(job) == "fail":
                self._blamed(job, reason, stage, blamed)
            else:
                self._lost(job, reason)
        elif upd.state == "COMPLETED":
            if stage not in job.done_stages:
                job.done_stages.append(stage)
            if all(s in job.done_stages for s, f in enumerate(job.fellows)
                   if f == fellow.fellow_id):
                fellow.assigned_job = None
            if len(set(job.done_stages)) >= len(job.fellows):
                reason = upd.message if job.kind == "smoke" else \
                    f"all {len(job.fellows)} stage(s) finished at step {job.last_step}"
                self._finish(job, JobState.COMPLETED, reason)
            else:
                self._save(job)
        else:
            self._save(job, quiet=True)
        return job

    def dispatch(self) -> JobRecord | None:
        """Start the oldest PENDING job if nothing runs and enough fellows are ready."""
        if self.running() is not None:
            return None
        # Called on every fellow change: a linear scan, not a sort of the whole history.
        pending = [j for j in self._jobs.values() if j.state is JobState.PENDING]
        if not pending:
            return None
        job = min(pending, key=lambda j: j.seq)
        ready = self.registry.ready()
        if len(ready) < job.topology.fellows:
            return None
        stages = job.topology.num_stages
        per_fellow = job.topology.slots_per_fellow
        able = [f for f in ready if len(f.devices) >= per_fellow]
        if len(able) < job.topology.fellows:
            return None
        chosen = able[: job.topology.fellows]
        n_layers = int(job.model.get("n_layers", stages)) if job.kind == "train" else stages
        weights = job.training.get("stage_weights") if job.kind == "train" else None
        try:
            # Neighbouring stages share a fellow where they can: its slots fill first.
            placement = plan([FellowSlots(f.fellow_id, f.name, list(f.devices), f.data_addr,
                                          list(f.data_addrs)) for f in chosen],
                             stages, n_layers, weights, slots_per_fellow=per_fellow)
        except PlacementError as exc:
            self._finish(job, JobState.FAILED, f"placement failed: {exc}")
            return job
        missing = [s.fellow_id for s in placement.stages if not s.data_addr]
        if job.kind == "train" and missing:
            self._finish(job, JobState.FAILED,
                         f"fellow(s) {missing} registered without a data-plane address")
            return job
        job.state = JobState.RUNNING
        job.started_at = time.time()
        job.watched_since = time.monotonic()
        job.placement = placement.to_json()
        job.fellows = [s.fellow_id for s in placement.stages]
        self._write_run_file(job, "placement_plan.json", job.placement)
        self._send_start(job, resume_step=0)
        self._save(job)
        self._event(job, "job.started")
        return job

    def _hold_s(self) -> float:
        # A fellow that died just now goes stale one heartbeat timeout after its last beat.
        return self.registry.stale_after_s + self.registry.heartbeat_interval_s

    def _blamed(self, job: JobRecord, reason: str, stage: int, blamed: int) -> None:
        """Stage ``stage`` failed because the link to ``blamed`` closed, broke or went quiet:
        that neighbour is the likelier cause. Its own report (a bad frame, an error) or its
        going stale names the cause better than "closed the link", so wait for either until
        the heartbeat timeout has passed; then the held reason stands. In a chain, the stage
        a held report blames may itself report a link to the stage beyond: that one is nearer
        the cause and replaces it (within the same deadline)."""
        if not job.held_reason:
            job.held_until = time.monotonic() + self._hold_s()
        elif job.held_stage != stage:
            return  # another survivor of the same failure: the first reason is kept
        job.held_reason, job.held_stage = reason, blamed
        self._save(job, quiet=True)

    def check_liveness(self) -> None:
        """React when a fellow of the running job stopped heartbeating or left."""
        job = self.running()
        if job is None:
            return
        now = time.monotonic()
        if job.recovering_since is not None:
            if now - job.recovering_since >= self.registry.stale_after_s + 0.5:
                self._resume(job)
            return
        grace = self.registry.stale_after_s
        if job.watched_since is None or now - job.watched_since >= grace:
            self._check_fellows(job, now)
        # After the fellows: a fellow gone stale by now names the cause of a held failure.
        if job.state is JobState.RUNNING and job.held_reason and now >= job.held_until:
            self._lost(job, job.held_reason)

    def _check_fellows(self, job: JobRecord, now: float) -> None:
        for fid in dict.fromkeys(job.fellows):
            if all(s in job.done_stages for s, f in enumerate(job.fellows) if f == fid):
                continue
            try:
                rec = self.registry.get(fid)
            except ApiError:
                self._lost(job, f"fellow {fid} vanished from the registry")
                return
            status = self.registry.status(rec, now)
            if status in ("stale", "offline", "released", "leaving"):
                what = {"stale": "stopped heartbeating", "offline": "did not come back",
                        "released": "was released", "leaving": "left"}[status]
                self._lost(job, f"fellow {fid} ({rec.name}) {what} at step {rec.current_step}")
                return

    def fellow_replaced(self, rec: FellowRecord) -> None:
        """A fellow process restarted under the same name: the job it ran lost its state."""
        job_id = rec.assigned_job
        if job_id is None or job_id not in self._jobs:
            return
        job = self._jobs[job_id]
        if job.state is JobState.RUNNING and job.recovering_since is None:
            self._lost(job, f"fellow {rec.fellow_id} ({rec.name}) restarted at step "
                            f"{rec.current_step}")

    # recovery ---------------------------------------------------------------------------------
    def _lost(self, job: JobRecord, reason: str) -> None:
        """A stage is gone: fail, or (resume_policy replace) stop everyone and recover."""
        limit = int(job.training.get("max_restarts", 3))
        if _resume_policy(job) != "replace":
            self._finish(job, JobState.FAILED, reason)
            return
        if len(job.restarts) >= limit:
            self._finish(job, JobState.FAILED, f"{reason} (after {limit} restart(s))")
            return
        job.recovering_since = time.monotonic()
        job.recover_reason = reason
        self._stop_fellows(job, reason)
        job.reason = f"recovering: {reason}"
        self._save(job)
        self._event(job, "job.recovering")

    def _resume(self, job: JobRecord) -> None:
        """After the heartbeat timeout: keep the fellows that are back to ready, replace the
        others with ready fellows outside the job, restart from the latest complete
        checkpoint."""
        now = time.monotonic()
        assert job.placement is not None
        spare = [r for r in self.registry.ready() if r.fellow_id not in job.fellows]
        stages = job.placement["stages"]
        replaced = {}
        lost = []
        for st in stages:
            rec = self._maybe(st["fellow_id"])
            status = "gone" if rec is None else self.registry.status(rec, now)
            if status == "ready" and rec is not None and rec.assigned_job is None:
                continue
            what = f"fellow {st['fellow_id']} ({st['name']}) is {status}" + (
                f" since step {rec.current_step}" if rec is not None else "")
            lost.append(what)
            if not spare:
                job.recovering_since = None
                self._finish(job, JobState.FAILED,
                             f"{what}; no ready fellow can take stage {st['stage']} "
                             f"(first report: {job.recover_reason})")
                return
            new = spare.pop(0)
            replaced[str(st["stage"])] = {"from": st["fellow_id"], "to": new.fellow_id,
                                          "lost": what}
            st.update(fellow_id=new.fellow_id, name=new.name, data_addr=new.data_addr,
                      slot=0, device=new.devices[0])
        step = self.latest_checkpoint(job)
        for st in stages:  # addresses may have changed when a fellow re-registered
            rec = self._maybe(st["fellow_id"])
            if rec is not None:
                addrs = rec.data_addrs or [rec.data_addr]
                slot = int(st.get("slot", 0))
                st["data_addr"] = addrs[slot] if slot < len(addrs) else rec.data_addr
        reason = "; ".join(lost) if lost else "every fellow came back"
        job.restarts.append({"at_step": job.last_step, "resume_step": step,
                             "reason": f"{reason} (first report: {job.recover_reason})",
                             "replaced": replaced, "at": time.time()})
        job.attempt += 1
        job.recovering_since = None
        job.fellows = [st["fellow_id"] for st in stages]
        job.done_stages = []
        job.current = {}
        job.last_step = step
        job.reason = ""
        self.store.delete_progress_after(job.job_id, step)
        self._write_run_file(job, "placement_plan.json", job.placement)
        self._send_start(job, resume_step=step)
        self._save(job)
        self._event(job, "job.resumed")

    def latest_checkpoint(self, job: JobRecord) -> int:
        """The newest step at which every stage has a pushed shard; 0 if none."""
        if self.runs_dir is None:
            return 0
        steps = complete_checkpoints(self.runs_dir, job.job_id, len(job.fellows))
        return steps[0] if steps else 0

    def _maybe(self, fellow_id: int) -> FellowRecord | None:
        try:
            return self.registry.get(fellow_id)
        except ApiError:
            return None

    def shard_pushed(self, job: JobRecord, stage: int, fellow: FellowRecord,
                     manifest: dict[str, Any]) -> dict[str, Any]:
        receipt = {
            "stage": stage, "fellow_id": fellow.fellow_id, "step": manifest.get("step"),
            "weights_sha256": manifest.get("weights_sha256"),
            "weights_bytes": manifest.get("weights_bytes"),
            "optimizer_bytes": manifest.get("optimizer_bytes"),
            "config_fingerprint": manifest.get("config_fingerprint"),
            "received_at": manifest.get("received_at"),
        }
        job.latest_shard_pushes[str(stage)] = receipt
        self.store.save_job(job.persistable())
        self.hub.publish("job.shard", {"job_id": job.job_id, **receipt})
        return receipt

    def link_set(self, fellow: FellowRecord, link: dict[str, Any]) -> str | None:
        """Note a set-speed in the running job of ``fellow``, if it runs one: the fellow applies
        it at once, so the job's record says from which step its link changed. Returns that
        job's id."""
        job = self._jobs.get(fellow.assigned_job or "")
        if job is None or job.state is not JobState.RUNNING:
            return None
        job.link_changes_total = link_changes_in_all(job.link_changes, job.link_changes_total) + 1
        job.link_changes.append({"at_step": job.last_step, "fellow_id": fellow.fellow_id,
                                 "link": link, "at": time.time()})
        # A script setting speeds in a loop must not grow the record without end. The first
        # change stays: it is the step from which the run left its network profile.
        excess = len(job.link_changes) - MAX_LINK_CHANGES
        if excess > 0:
            del job.link_changes[1:1 + excess]
        self._save(job, quiet=True)
        return job.job_id

    def holds(self, job: JobRecord, fellow_id: int, stage: int) -> bool:
        """Whether this fellow runs this stage of the job (a fellow may run several)."""
        if job.placement is None:
            return 0 <= stage < len(job.fellows) and job.fellows[stage] == fellow_id
        stages = job.placement["stages"]
        return 0 <= stage < len(stages) and stages[stage]["fellow_id"] == fellow_id

    # internals --------------------------------------------------------------------------------
    def _send_start(self, job: JobRecord, resume_step: int) -> None:
        """One START per stage (a fellow with several slots gets one for each)."""
        assert job.placement is not None
        key = secrets.token_hex(16)  # the data plane admits only connections that present it
        stages = job.placement["stages"]
        for st in stages:
            fellow = self.registry.get(st["fellow_id"])
            fellow.assigned_job = job.job_id
            self.registry.send(fellow, "START", job.job_id, {
                "job_id": job.job_id, "kind": job.kind, "name": job.name,
                "stage": st["stage"], "num_stages": len(stages), "placement": job.placement,
                "model": job.model, "training": job.training, "key": key,
                "attempt": job.attempt, "resume_step": resume_step,
            })

    def _merge_metrics(self, job: JobRecord, stage: int, fellow_id: int,
                       upd: JobStatusUpdate) -> None:
        if not upd.metrics and upd.tokens_per_s is None:
            return
        per_stage = job.metrics.setdefault("stages", {})
        entry = per_stage.setdefault(str(stage), {"fellow_id": fellow_id})
        entry.update(upd.metrics)
        if upd.tokens_per_s is not None:
            entry["tokens_per_s"] = upd.tokens_per_s
        # The last stage holds the loss: its numbers are the job's.
        if stage == len(job.fellows) - 1:
            for key in ("eval_loss", "perplexity", "final_loss", "best_loss", "tokens_per_s",
                        "wall_s"):
                if key in upd.metrics:
                    job.metrics[key] = upd.metrics[key]
        if upd.state == "COMPLETED" and "wire_tx_bytes_per_step" in upd.metrics:
            job.metrics["wire_bytes_per_step"] = sum(
                s.get("wire_tx_bytes_per_step", 0) for s in per_stage.values())

    def _run_manifest(self, job: JobRecord) -> dict[str, Any]:
        pushes = [job.latest_shard_pushes[k] for k in sorted(job.latest_shard_pushes, key=int)]
        steps = {p["step"] for p in pushes}
        return {
            "job_id": job.job_id, "name": job.name, "state": job.state.value,
            "num_stages": len(job.fellows), "model": job.model, "training": job.training,
            "placement": job.placement,
            "step": max(steps) if steps else None,
            "complete": len(pushes) == len(job.fellows) and len(steps) == 1
            and len({p["config_fingerprint"] for p in pushes}) == 1,
            "shards": [{**p, "dir": f"shards/stage-{p['stage']}-fellow-{p['fellow_id']}"}
                       for p in pushes],
        }

    def _record_progress(self, job: JobRecord, stage: int, upd: JobStatusUpdate) -> None:
        """One record per step: the last stage's loss and tokens/s, every stage's wire bytes.

        Stages report independently, so a few recent steps stay open in memory; a report for an
        older step (a stage catching up after a leader restart) joins the stored record rather
        than replacing it."""
        rec = job.current.get(upd.step)
        if rec is None:
            rec = self.store.progress_record(job.job_id, upd.step) or \
                {"step": upd.step, "wire_bytes": 0, "stages_reported": []}
            job.current[upd.step] = rec
            for old in sorted(job.current)[:-8]:
                del job.current[old]
        if "eval_loss" in upd.metrics:
            rec["eval_loss"] = upd.metrics["eval_loss"]
            if isinstance(rec["eval_loss"], int | float):
                rec["perplexity"] = perplexity(rec["eval_loss"])
        if "wire_tx_bytes" in upd.metrics:
            if stage in rec["stages_reported"]:
                return
            rec["stages_reported"].append(stage)
            rec["wire_bytes"] += int(upd.metrics["wire_tx_bytes"])
            peak = upd.metrics.get("activation_peak_bytes")
            if isinstance(peak, int | float):
                # Per stage (keyed by its index as text: a JSON object), since the schedule
                # gives each stage its own share.
                rec.setdefault("activation_peak_bytes", {})[str(stage)] = int(peak)
            # Each stage's own step time beside its wait: a stage's first step also waits
            # for its neighbours to start, so the last stage's step_seconds is no denominator.
            for key, src in (("wait_seconds", "wait_seconds"), ("stage_seconds", "step_seconds")):
                v = upd.metrics.get(src)
                if isinstance(v, int | float) and math.isfinite(v):
                    rec.setdefault(key, {})[str(stage)] = float(v)
            errors = upd.metrics.get("codec_error")
            if isinstance(errors, dict):
                kept = {k: float(v) for k, v in errors.items() if k in ("act", "grad")
                        and isinstance(v, int | float) and math.isfinite(v)}
                if kept:
                    rec.setdefault("codec_error", {})[str(stage)] = kept
            rec["ts"] = time.time()
            if upd.loss is not None:
                rec["loss"] = upd.loss
            if stage == len(job.fellows) - 1:
                rec["tokens_per_s"] = upd.tokens_per_s
                rec["step_seconds"] = upd.metrics.get("step_seconds")
                rec["lr"] = upd.metrics.get("lr")
        self.store.put_progress(job.job_id, upd.step, rec)

    def progress(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        self.get(job_id)
        return self.store.progress(job_id, after)

    def _write_run_file(self, job: JobRecord, name: str, data: Any) -> None:
        if self.runs_dir is None:
            return
        atomic_write(self.runs_dir / job.job_id / name, jsonio.dumps(data, pretty=True))

    def _stop_fellows(self, job: JobRecord, reason: str) -> None:
        """Free the job's fellows and tell those still working on it to STOP."""
        for fid in dict.fromkeys(job.fellows):
            rec = self._maybe(fid)
            if rec is not None and rec.assigned_job == job.job_id:
                rec.assigned_job = None
                self.registry.send(rec, "STOP", job.job_id, {"reason": reason})

    def _finish(self, job: JobRecord, state: JobState, reason: str) -> None:
        was_running = job.state is JobState.RUNNING
        job.state, job.reason, job.finished_at = state, reason, time.time()
        job.held_reason, job.held_stage, job.held_until = "", None, 0.0
        if was_running:
            self._stop_fellows(job, reason)
        self._save(job)
        if job.kind == "train" and was_running:
            self._write_run_file(job, "job_final.json",
                                 unstructure(self.info(job, with_history=True)))
            if job.latest_shard_pushes:
                self._write_run_file(job, "model_export/run_manifest.json",
                                     self._run_manifest(job))
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


def resolve_smoke_payload(req: JobSubmit) -> tuple[dict[str, Any], dict[str, Any]]:
    """A smoke job's settings checked at submit (a bad one used to fail on its fellows)."""
    if req.model:
        raise SchemaError("a smoke job takes no model", "$.model")
    return {}, unstructure(structure(req.training, SmokeTraining, "$.training"))


def resolve_train_payload(req: JobSubmit) -> tuple[dict[str, Any], dict[str, Any]]:
    """Structure a train job's configs (400 naming the field when wrong), return them resolved
    with every default filled in, so the job record says exactly what ran."""
    model = structure(req.model, ModelConfig, "$.model")
    training = structure(req.training, TrainingConfig, "$.training")
    shape = job_shape_error(model, training, req.topology.num_stages)
    if shape is not None:
        raise SchemaError(shape[0], f"$.{shape[1]}")
    return unstructure(model), unstructure(training)
