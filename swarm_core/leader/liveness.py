"""Whether the running job's fellows are still there, and what happens when one is not.

A lost stage fails the job, or (``resume_policy: replace``) stops every fellow, waits out the
heartbeat timeout to see which come back, hands the stages of those that did not to ready
fellows outside the job and resumes from the newest checkpoint every stage pushed. A FAILED
report that blames a neighbour's link is held (:class:`HeldFailure`) until the neighbour's
own report or its going stale names the cause better.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from swarm_core.contract import Placement, Replacement, Restart
from swarm_core.leader import moves
from swarm_core.leader.records import HeldFailure, JobRecord, Recovering
from swarm_core.leader.registry import FellowRecord, FellowRegistry
from swarm_core.leader.uploads import complete_checkpoints
from swarm_core.protocol import FellowStatus, JobState

if TYPE_CHECKING:
    from swarm_core.leader.queue import JobQueue

# How a job's loss reads, by the status its fellow was found in.
LOST_AS = {FellowStatus.STALE: "stopped heartbeating", FellowStatus.OFFLINE: "did not come back",
           FellowStatus.RELEASED: "was released", FellowStatus.LEAVING: "left"}


class Liveness:
    def __init__(self, queue: JobQueue, registry: FellowRegistry,
                 runs_dir: Path | None) -> None:
        self.queue = queue
        self.registry = registry
        self.runs_dir = runs_dir

    def hold_s(self) -> float:
        # A fellow that died just now goes stale one heartbeat timeout after its last beat.
        return self.registry.stale_after_s + self.registry.heartbeat_interval_s

    def watch_s(self) -> float:
        """How long a running job's fellows get to show up after a dispatch or a leader
        restart: a heartbeat timeout, plus the longest a fellow backs off between tries to
        reach the leader (a quarter of the timeout, see fellow.daemon.reconnect_cap), plus
        one heartbeat."""
        stale = self.registry.stale_after_s
        return stale + stale / 4 + self.registry.heartbeat_interval_s

    def watch(self, job: JobRecord) -> None:
        """Begin watching a running job: its fellows get a heartbeat timeout to show up (after
        a dispatch, or a leader restart), and a held failure waits anew."""
        job.watched_since = job.active_at = time.monotonic()
        if job.held is not None:
            job.held.until = job.watched_since + self.hold_s()

    def check(self) -> None:
        """React when a fellow of the running job stopped heartbeating or left."""
        job = self.queue.running()
        if job is None:
            return
        now = time.monotonic()
        if job.recovering is not None:
            if self._stopped(job, now) or \
                    now - job.recovering.since >= self.registry.stale_after_s + 0.5:
                self.resume(job)
            return
        self.queue.membership.check(job)
        if job.state is not JobState.RUNNING or job.recovering is not None:
            return
        # A replica that left (a joiner called off, a cell lost) may have been the last cell
        # not done: no report is coming to complete the job, and the idle rule would fail it.
        if self.queue.complete_if_done(job):
            return
        self.queue.membership.maybe_join(job)
        settled = job.watched_since is None or now - job.watched_since >= self.watch_s()
        # A held failure due now looks for its cause even inside the window: the neighbour it
        # blames has had a heartbeat timeout to be seen stale.
        if settled or (job.held is not None and now >= job.held.until):
            self._check_fellows(job, now)
        # After the fellows: a fellow gone stale by now names the cause of a held failure.
        if job.state is JobState.RUNNING and job.held is not None and now >= job.held.until:
            self.lost(job, job.held.reason)
        idle = now - (job.active_at or now)
        if job.state is JobState.RUNNING and job.recovering is None and job.held is None \
                and idle > self.idle_s():
            # The last resort (see reconcile.py): whatever was lost, the queue goes on.
            self.lost(job, f"none of its fellows has run attempt {job.attempt} of it for "
                           f"{idle:.0f}s")

    def idle_s(self) -> float:
        """How long a running job may go without a fellow that runs it: two heartbeat
        timeouts, and never less than a restarted leader's grace."""
        return max(2 * self.registry.stale_after_s, self.watch_s())

    def _stopped(self, job: JobRecord, now: float) -> bool:
        """Whether every fellow a recovery stopped said so in a heartbeat since (runs no cell
        of the job), or is gone (removed, stale, or left): then it need not wait out the
        heartbeat timeout. A fellow that is still stopping (its stage thread winding down) is
        waited for, not blamed. So is one a restarted leader has yet to hear from (offline),
        or has heard only register: what it runs comes with its heartbeat, and a resume
        before it would start the new attempt on a fellow still running the old one."""
        assert job.recovering is not None
        since = job.recovering.since
        for fid in dict.fromkeys(job.fellows):
            rec = self.registry.find(fid)
            if rec is None:
                continue
            status = self.registry.status(rec, now)
            if status is FellowStatus.STALE or status.left:
                continue
            if status is FellowStatus.OFFLINE or rec.last_beat is None \
                    or rec.last_beat <= since \
                    or any(c.job_id == job.job_id for c in rec.running):
                return False
        return True

    def _check_fellows(self, job: JobRecord, now: float) -> None:
        for fid in dict.fromkeys(job.fellows):
            if job.stages_done_by(fid):
                continue
            rec = self.registry.find(fid)
            if rec is None:
                self.lost(job, f"fellow {fid} vanished from the registry")
                return
            status = self.registry.status(rec, now)
            if status in LOST_AS:
                reason = f"fellow {fid} ({rec.name}) {LOST_AS[status]} at step " \
                         f"{rec.current_step}"
                if self.queue.membership.fellow_lost(job, fid, reason):
                    continue  # (its replica leaves; the others train on)
                self.lost(job, reason)
                return

    def blamed(self, job: JobRecord, reason: str, stage: int, blamed: int) -> None:
        """Stage ``stage`` failed because the link to ``blamed`` closed, broke or went quiet:
        that neighbour is the likelier cause. Its own report (a bad frame, an error) or its
        going stale names the cause better than "closed the link", so wait for either until
        the heartbeat timeout has passed; then the held reason stands. In a chain, the stage
        a held report blames may itself report a link to the stage beyond: that one is nearer
        the cause and replaces it (within the same deadline)."""
        held = job.held
        if held is None:
            job.held = HeldFailure(reason, blamed, time.monotonic() + self.hold_s())
        elif held.stage == stage:
            job.held = HeldFailure(reason, blamed, held.until)
        else:
            return  # another survivor of the same failure: the first reason is kept
        self.queue.save(job, quiet=True)

    def fellow_replaced(self, rec: FellowRecord) -> None:
        """A fellow process restarted under the same name: the job it ran lost its state."""
        running = self.queue.running()
        if running is not None:
            self.queue.membership.fellow_restarted(running, rec.fellow_id)
        job = self.queue.find(rec.assigned_job)
        if job is not None and job.state is JobState.RUNNING and job.recovering is None:
            reason = f"fellow {rec.fellow_id} ({rec.name}) restarted at step {rec.current_step}"
            if not self.queue.membership.fellow_lost(job, rec.fellow_id, reason):
                self.lost(job, reason)

    def lost(self, job: JobRecord, reason: str) -> None:
        """A stage is gone: fail, or (resume_policy replace) stop everyone and recover."""
        train = job.spec.train
        if train is None or job.resume_policy != "replace":
            self.queue.finish(job, JobState.FAILED, reason)
            return
        if len(job.restarts) >= train.max_restarts:
            self.queue.finish(job, JobState.FAILED,
                              f"{reason} (after {train.max_restarts} restart(s))")
            return
        self.queue.membership.forget(job)
        job.recovering = Recovering(time.monotonic(), reason)
        self.queue.stop_fellows(job, reason)
        job.reason = f"recovering: {reason}"
        self.queue.save(job)
        self.queue.event(job, "job.recovering")

    def resume(self, job: JobRecord) -> None:
        """After the heartbeat timeout: keep the fellows that are back to ready, replace the
        others with ready fellows outside the job, restart from the latest complete
        checkpoint. Nothing of the job changes until its new placement and STARTs are made:
        a recovery that cannot go on fails the job, it never leaves it RUNNING."""
        assert job.placement is not None and job.recovering is not None
        first = job.recovering.reason
        step = self.latest_checkpoint(job)
        try:
            # (a job whose peers moved: the cells it had at that step; later moves made
            # again)
            at_step, membership = moves.rewound(job, step)
            placement, replaced, lost = self._replacement(job, at_step)
            if isinstance(placement, str):
                raise ValueError(placement)
            starts = self.queue.starts(job, placement, attempt=job.attempt + 1,
                                       resume_step=step)
        except ValueError as exc:  # (PlacementError is one)
            job.recovering = None
            self.queue.finish(job, JobState.FAILED, f"{exc} (first report: {first})")
            return
        reason = "; ".join(lost) if lost else "every fellow came back"
        job.restarts.append(Restart(at_step=job.last_step, resume_step=step,
                                    reason=f"{reason} (first report: {first})",
                                    replaced=replaced, at=time.time()))
        job.placement = placement
        job.attempt += 1
        job.members, job.epoch = None, 0  # (the new attempt runs every replica again)
        job.membership = membership
        job.moves_base = len(moves.moves_of(job))
        job.data_key, job.resume_step = starts[0].key, step
        job.recovering = None
        job.done_stages = []
        job.current = {}
        job.last_step = step
        job.reason = ""
        self.queue.store.delete_progress_after(job.job_id, step)
        for change in membership:  # (a kept move's mark on its first step, just deleted)
            if change.moved is not None and change.step > step:
                self.queue.progress.membership(job, change)
        self.queue.files.placement(job)
        self.watch(job)
        self.queue.send(job, starts)
        self.queue.save(job)
        self.queue.event(job, "job.resumed")

    def _replacement(self, job: JobRecord, placement: Placement
                     ) -> tuple[Placement | str, dict[str, Replacement], list[str]]:
        """The placement to resume on (``placement``'s cells): each stage whose fellow is not
        back to ready goes to a spare (for a train job, one with a data address), every fellow
        at the address it registers now. A stage no spare can take: why, instead of a
        placement."""
        now = time.monotonic()
        spare = [r for r in self.registry.ready() if r.fellow_id not in job.fellows
                 and (r.data_addr or job.spec.train is None)]
        replaced: dict[str, Replacement] = {}
        lost: list[str] = []
        stages = []
        for st in placement.stages:
            rec = self.registry.find(st.fellow_id)
            status = "gone" if rec is None else self.registry.status(rec, now)
            if not (status is FellowStatus.READY and rec is not None
                    and rec.assigned_job is None):
                what = f"fellow {st.fellow_id} ({st.name}) is {status}" + (
                    f" since step {rec.current_step}" if rec is not None else "")
                lost.append(what)
                if not spare:
                    return f"{what}; no ready fellow can take stage {st.stage}", replaced, lost
                rec = spare.pop(0)
                replaced[placement.label(st.stage, st.replica)] = Replacement(
                    from_=st.fellow_id, to=rec.fellow_id, lost=what)
                st = attrs.evolve(st, fellow_id=rec.fellow_id, name=rec.name, slot=0,
                                  device=rec.devices[0])
            # A fellow that re-registered may listen on new data addresses.
            addrs: Sequence[str | None] = rec.data_addrs or [rec.data_addr]
            stages.append(attrs.evolve(
                st, data_addr=addrs[st.slot] if st.slot < len(addrs) else rec.data_addr))
        return attrs.evolve(placement, stages=stages), replaced, lost

    def latest_checkpoint(self, job: JobRecord) -> int:
        """The newest step at which every stage has a pushed shard; 0 if none."""
        if self.runs_dir is None:
            return 0
        steps = complete_checkpoints(self.runs_dir, job.job_id, job.num_stages)
        return steps[0] if steps else 0

