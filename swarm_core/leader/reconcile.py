"""What the leader believes of its jobs, checked against what each heartbeat says a fellow runs.

The leader's signals live in its memory and a fellow's last report may never arrive (the
leader was down longer than the fellow's patience), so belief and fact part ways across a
restart. Each heartbeat lists the cells its fellow runs and the final reports it could not
deliver; from them the leader:

- applies a final report it missed, as if it had come by the status route;
- sends a cell's START again when its fellow neither runs it nor has one waiting (the START
  died with a leader, or was never taken), from what the job record stores;
- stops a cell its fellow should not run: of a job that is over, recovering, or at an older
  attempt, or a cell the job's placement gives to another fellow;
- marks the running job active, for the last resort in :class:`Liveness`: a job that no
  fellow has run for two heartbeat timeouts is resumed or failed, never left RUNNING.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from swarm_core.contract import CellRef, Heartbeat
from swarm_core.leader import moves
from swarm_core.leader.errors import ApiError
from swarm_core.leader.records import JobRecord
from swarm_core.leader.registry import FellowRecord, FellowRegistry
from swarm_core.protocol import JobState

if TYPE_CHECKING:
    from swarm_core.leader.queue import JobQueue

log = logging.getLogger("swarm.leader")


class Reconciler:
    def __init__(self, queue: JobQueue, registry: FellowRegistry) -> None:
        self.queue = queue
        self.registry = registry

    def heartbeat(self, rec: FellowRecord, hb: Heartbeat) -> None:
        for final in hb.unreported:
            try:
                self.queue.status_update(final.job_id, rec, final.report)
                log.info("job %s: fellow %d's final report (%s, stage %s) came with its "
                         "heartbeat", final.job_id, rec.fellow_id, final.report.state,
                         final.report.stage)
            except ApiError:
                pass  # (a job that ended meanwhile, a cell moved elsewhere: nothing to learn)
        for cell in hb.running:
            self._keep_or_stop(rec, cell)
        job = self.queue.running()
        if job is not None and rec.fellow_id in job.fellows:
            # (A fellow that lists no cells, an older one, says which job it is on.)
            if any(c.job_id == job.job_id and c.attempt == job.attempt for c in hb.running) \
                    or (not hb.running and hb.current_job == job.job_id):
                job.active_at = time.monotonic()
            self._start_missing(job, rec, hb.running)

    def _keep_or_stop(self, rec: FellowRecord, cell: CellRef) -> None:
        job = self.queue.find(cell.job_id)
        why = _why_not(job, rec, cell)
        if why is None:
            return
        # One attempt's cells only, when the job runs on: the fellow may hold a cell of the
        # current attempt beside the old one.
        attempt = cell.attempt if job is not None and not job.state.terminal \
            and job.recovering is None else None
        payload = {"attempt": attempt} if attempt is not None else {}
        if self.registry.pending(rec, "STOP", cell.job_id, **payload):
            return
        log.warning("fellow %d runs stage %d of %s (attempt %d) %s: stopping it",
                    rec.fellow_id, cell.stage, cell.job_id, cell.attempt, why)
        self.registry.send(rec, "STOP", cell.job_id, {"reason": why, **payload})

    def _start_missing(self, job: JobRecord, rec: FellowRecord, running: list[CellRef]) -> None:
        """START again each cell of the running job this fellow should run and does not."""
        placement = job.placement
        if placement is None or job.recovering is not None or job.held is not None \
                or not job.data_key or not self.registry.status(rec).live:
            # (A held failure ends the job soon, a leaving fellow is lost to it, and a row
            # from an older leader has no key.)
            return
        ran = {(c.stage, c.replica) for c in running
               if c.job_id == job.job_id and c.attempt == job.attempt}
        # (it runs the cell it became, named as its old one for now)
        ran |= {new for old, new in moves.in_flight(job, rec.fellow_id).items() if old in ran}
        for cell, st in enumerate(placement.stages):
            if st.fellow_id != rec.fellow_id or cell in job.done_stages \
                    or (st.stage, st.replica) in ran or self.queue.membership.out(job,
                                                                                st.replica):
                continue
            if self.registry.pending(rec, "START", job.job_id, stage=st.stage,
                                     replica=st.replica, attempt=job.attempt):
                continue
            log.warning("job %s: fellow %d does not run stage %d (attempt %d) and has no "
                        "START for it: sending it again", job.job_id, rec.fellow_id, st.stage,
                        job.attempt)
            self.queue.send(job, [self.queue.start_of(job, cell)])


def _why_not(job: JobRecord | None, rec: FellowRecord, cell: CellRef) -> str | None:
    """Why this fellow should not run this cell; None if it should."""
    if job is None:
        return "of a job this leader does not know"
    if job.state is not JobState.RUNNING:
        return f"of a job that is {job.state.value}"
    if job.recovering is not None:
        return "of a job that is recovering"
    if cell.attempt != job.attempt:
        return f"of attempt {cell.attempt}, which attempt {job.attempt} replaced"
    if job.placement is None or not job.placement.holds(rec.fellow_id, cell.stage, cell.replica):
        if (cell.stage, cell.replica) in moves.in_flight(job, rec.fellow_id):
            return None  # (its peer moved: the same task runs the new cell, named next beat)
        return "that the job's placement gives to another fellow"
    return None
