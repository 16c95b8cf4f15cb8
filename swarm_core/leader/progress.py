"""A running job's figures: each stage's newest metrics, one record per step, the run files.

Stages report independently; :class:`ProgressBook` joins their reports into the job's metrics and
into one :class:`ProgressRecord` per step (stored in SQLite), and :class:`RunFiles` writes what
the leader keeps of a run under its state directory (``runs/<job>/``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from swarm_core import jsonio
from swarm_core.contract import JobStatusUpdate, MembershipChange, ProgressRecord, StageMetrics
from swarm_core.contract.job import export_complete, in_stage_order
from swarm_core.contract.metrics import JOB_LEVEL, REPLICA_COMBINE, MetricName
from swarm_core.leader.membership import cell_index_at
from swarm_core.leader.moves import placement_at
from swarm_core.leader.records import JobRecord
from swarm_core.leader.store import Store, StoreWriteError
from swarm_core.leader.uploads import drop_checkpoints_from
from swarm_core.paths import atomic_write
from swarm_core.schema import structure, unstructure

OPEN_STEPS = 8  # recent steps kept in memory while their stages' reports come in


class ProgressBook:
    def __init__(self, store: Store) -> None:
        self.store = store

    def merge(self, job: JobRecord, stage: int, replica: int, fellow_id: int,
              upd: JobStatusUpdate) -> None:
        """Keep the newest of each figure a cell reports (by the cell's label: its stage, for
        one replica); the last stage's loss figures are the job's (of several replicas: their
        mean, their tokens/s summed; the first replica's evaluation); once a cell completes,
        the bytes every cell sends per step."""
        assert job.placement is not None
        figures = upd.metrics
        if upd.tokens_per_s is not None:
            figures = figures.merged(StageMetrics(tokens_per_s=upd.tokens_per_s))
        if figures == StageMetrics():
            return
        m = job.metrics
        stages = m.stages if m.stages is not None else {}
        key = placement_at(job, upd.epoch).label(stage, replica)  # (a moved job's: then)
        cell = stages.get(key, StageMetrics(fellow_id=fellow_id)).merged(figures)
        # (reports of one cell arrive in order, but a catching-up one may repeat a step)
        cell.step = max(cell.step or 0, upd.step)
        stages[key] = cell
        m.stages = stages
        if stage == job.num_stages - 1:
            self._job_level(job, upd.metrics, stages)
        if upd.state == "COMPLETED" and upd.metrics.wire_tx_bytes_per_step is not None:
            m.wire_bytes_per_step = sum(s.wire_tx_bytes_per_step or 0 for s in stages.values())
            if any(s.sync_tx_bytes_per_step is not None for s in stages.values()):
                m.sync_bytes_per_step = sum(s.sync_tx_bytes_per_step or 0
                                            for s in stages.values())

    def _job_level(self, job: JobRecord, figures: StageMetrics,
                   stages: dict[str, StageMetrics]) -> None:
        assert job.placement is not None
        m, p = job.metrics, job.placement
        if p.layout is None and p.replicas == 1:
            for name in JOB_LEVEL:
                value = getattr(figures, name)
                if value is not None:
                    setattr(m, name, value)
            return
        # The members' cells only: one that left keeps its last figures in ``stages`` (its
        # tokens/s would be counted in a sum it no longer adds to, its loss in the mean).
        # (The last stage's cells: a layout's by its ids, which need not be the replicas.)
        last_ids = [c.replica for c in p.group(p.num_stages - 1)]
        members = last_ids if job.members is None else \
            [r for r in job.members if r in last_ids]
        last = [stages[k] for k in (p.label(p.num_stages - 1, r) for r in members)
                if k in stages]
        for name in JOB_LEVEL:
            values = [getattr(s, name) for s in last if getattr(s, name) is not None]
            if not values:
                continue
            how = REPLICA_COMBINE.get(name)
            if how == "sum":
                setattr(m, name, sum(values))
            elif how == "max":
                setattr(m, name, max(values))
            elif how == "first":
                setattr(m, name, values[0])
            else:
                setattr(m, name, sum(values) / len(values))
        final = self._final_step_loss(job)
        if final is not None:
            m.final_loss = final

    def _final_step_loss(self, job: JobRecord) -> float | None:
        """The loss of the job's last step as its record has it (of several replicas their
        mean, under swarm wiring weighted by the micro-batches each ran: step_loss), once the
        run's last step has a record; None before."""
        steps = job.spec.training.steps if job.spec.training is not None else 0
        if not steps or job.last_step < steps:
            return None
        rec = job.current.get(steps)
        if rec is None:
            stored = self.store.progress_record(job.job_id, steps)
            rec = None if stored is None else _load(stored)
        return None if rec is None else rec.loss

    def refresh(self, job: JobRecord) -> None:
        """The job-level figures again, from the cells' own (its members changed)."""
        p = job.placement
        if p is not None and (p.replicas > 1 or p.layout is not None):
            self._job_level(job, StageMetrics(), job.metrics.stages or {})

    def record(self, job: JobRecord, stage: int, replica: int, upd: JobStatusUpdate) -> None:
        """Join a cell's step report into that step's record. A report for an older step (a
        stage catching up after a leader restart) joins the stored record rather than
        replacing it."""
        assert job.placement is not None
        p = placement_at(job, upd.epoch)  # (a job whose peers move: its cells at that step)
        rec = self._open(job, upd.step)
        figures = upd.metrics
        if figures.eval_loss is not None:
            rec.add_eval(figures.eval_loss)
        if figures.wire_tx_bytes is not None:
            if not rec.add_stage(stage, figures,
                                 cell_index_at(job, p, upd.epoch, stage, replica),
                                 p.label(stage, replica)):
                return
            rec.ts = time.time()
            if p.layout is None and p.replicas == 1:
                if upd.loss is not None:
                    rec.loss = upd.loss
                if stage == job.num_stages - 1:
                    rec.tokens_per_s = upd.tokens_per_s
            elif stage == job.num_stages - 1:
                if upd.loss is not None:
                    rec.add_replica_loss(replica, upd.loss, figures.micro_batches)
                    job.last_loss = rec.loss
                    if job.spec.training is not None and upd.step == job.spec.training.steps:
                        job.metrics.final_loss = rec.loss  # (the run's last step's, as recorded)
                rec.tokens_per_s = (rec.tokens_per_s or 0.0) + (upd.tokens_per_s or 0.0)
            if stage == job.num_stages - 1:
                rec.step_seconds = figures.step_seconds
                rec.lr = figures.lr
        self.store.put_progress(job.job_id, upd.step, unstructure(rec))

    def restart(self, job: JobRecord, step: int) -> None:
        """A step trained again (swarm wiring's regroup): its record as if none had come,
        so the cells' second reports are the ones it keeps."""
        old = self._open(job, step)
        rec = job.current[step] = ProgressRecord(step=step, membership=old.membership)
        self.store.put_progress(job.job_id, step, unstructure(rec))

    def membership(self, job: JobRecord, change: MembershipChange) -> None:
        """A replica left or joined: noted in the record of the first step it changes."""
        rec = self._open(job, change.step)
        rec.membership = [*(rec.membership or []), change]
        self.store.put_progress(job.job_id, change.step, unstructure(rec))

    def _open(self, job: JobRecord, step: int) -> ProgressRecord:
        """The record of ``step`` being assembled: kept in memory with the newest few."""
        rec = job.current.get(step)
        if rec is None:
            stored = self.store.progress_record(job.job_id, step)
            rec = ProgressRecord(step=step) if stored is None else _load(stored)
            job.current[step] = rec
            for old in sorted(job.current)[:-OPEN_STEPS]:
                del job.current[old]
        return rec

    def rows(self, job_id: str, after: int = 0) -> list[dict[str, Any]]:
        """The stored records as they were written (unstructured ProgressRecords): passed on
        as they are, not rebuilt, since a long run holds a hundred thousand."""
        return self.store.progress(job_id, after)

    def histories(self, job: JobRecord) -> tuple[list[list[float]], list[list[float]]]:
        """[step, loss] of every step with a loss, and [step, eval_loss] of every evaluated
        step: a job's curves, in one pass over its records."""
        losses: list[list[float]] = []
        evals: list[list[float]] = []
        step, loss, eval_loss = MetricName.STEP, MetricName.LOSS, MetricName.EVAL_LOSS
        for r in self.store.progress(job.job_id):
            if r.get(loss) is not None:
                losses.append([r[step], r[loss]])
            if r.get(eval_loss) is not None:
                evals.append([r[step], r[eval_loss]])
        return losses, evals


def _load(row: dict[str, Any]) -> ProgressRecord:
    return structure(row, ProgressRecord, trust=True)


class RunFiles:
    """What the leader writes of a run under ``runs/<job_id>/`` (atomically): the placement,
    the final job record and the export's run manifest."""

    def __init__(self, runs_dir: Path | None) -> None:
        self.runs_dir = runs_dir

    def write(self, job: JobRecord, name: str, data: Any) -> None:
        if self.runs_dir is None:
            return
        try:
            atomic_write(self.runs_dir / job.job_id / name,
                         jsonio.dumps(unstructure(data), pretty=True))
        except OSError as exc:
            # On the state dir's disk, as the store: refused as a write of it is (undo.py).
            raise StoreWriteError(f"runs/{job.job_id}/{name}: {exc.strerror or exc}",
                                  transient=True) from exc

    def placement(self, job: JobRecord) -> None:
        self.write(job, "placement_plan.json", job.placement)

    def undone_checkpoints(self, job: JobRecord, step: int) -> None:
        """The job's checkpoints at 1-based ``step`` and after are gone: the step is trained
        again, so they hold a state the cells undid (a resume takes the newest before it)."""
        if self.runs_dir is not None:
            drop_checkpoints_from(self.runs_dir, job.job_id, step)

    def run_manifest(self, job: JobRecord) -> dict[str, Any]:
        pushes = in_stage_order(job.latest_shard_pushes)
        steps = {p.step for p in pushes}
        spec = unstructure(job.spec)
        return {
            "job_id": job.job_id, "name": job.spec.name, "state": job.state.value,
            "num_stages": job.num_stages, "model": spec["model"], "training": spec["training"],
            "placement": unstructure(job.placement),
            "step": max(steps) if steps else None,
            "complete": export_complete(pushes, job.num_stages),
            "shards": [{**unstructure(p), "dir": f"shards/stage-{p.stage}-fellow-{p.fellow_id}"}
                       for p in pushes],
        }
