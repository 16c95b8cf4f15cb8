"""A change to a job is kept only once it is stored.

A fellow's report, a regroup, a push, a cancel or a tick changes a job in memory, then writes
it. When the store refuses the write (a full disk: :class:`StoreWriteError`), the change must
not live on in memory alone: the caller would be told it failed while the leader acted on it,
its retry would find it done (a COMPLETED job answers 409), and a restart would bring back the
stored record, older than what the leader had said and done. So such a change runs inside
:func:`kept`: what it may touch is noted first, the events it publishes are held back, and a
refused write puts everything back as it was and drops them; the caller is answered 503 and
its retry, once the disk has room, is taken as the first try would have been.

What it puts back: the job's stored fields (from its row as the change began), its
leader-local timers, the open step records (reloaded from the store on demand), its regroup
round, and each given fellow's assignment and signal queue (signals sent in the block are
taken back before any poll can see them: nothing awaits inside a change). Run files written
in the block stay; they are written again with the change that next succeeds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import attrs

from swarm_core.leader.records import JobRecord
from swarm_core.leader.registry import FellowRecord
from swarm_core.leader.store import StoreWriteError

if TYPE_CHECKING:
    from swarm_core.leader.queue import JobQueue


def _fellows_as_now(fellows: Iterable[FellowRecord]) -> Callable[[], None]:
    kept = [(rec, rec.assigned_job, rec.next_seq) for rec in fellows]

    def undo() -> None:
        for rec, assigned, next_seq in kept:
            rec.assigned_job = assigned
            if rec.next_seq != next_seq:
                rec.pending = [s for s in rec.pending if s.seq < next_seq]
                rec.next_seq = next_seq

    return undo


def _job_as_now(job: JobRecord) -> Callable[[], None]:
    row = job.row()
    held = None if job.held is None else attrs.evolve(job.held)
    recovering = None if job.recovering is None else attrs.evolve(job.recovering)
    watched_since, active_at = job.watched_since, job.active_at

    def undo() -> None:
        job.restore(row)
        job.held, job.recovering = held, recovering
        job.watched_since, job.active_at = watched_since, active_at
        job.current = {}  # (the steps being assembled come back from the store as needed)

    return undo


@contextlib.contextmanager
def kept(queue: JobQueue, job: JobRecord, fellows: Iterable[FellowRecord] = (),
         whole: bool = False) -> Iterator[None]:
    """Run a change of ``job`` (and of ``fellows``' assignments and signals): if a write of
    it raises StoreWriteError, put all of it back, drop its events, and re-raise. ``whole``:
    the change's writes are one transaction (``Store.batch``), rolled back whatever ends it,
    so whatever ends it puts the memory back too."""
    undo = [_job_as_now(job), _fellows_as_now(fellows), queue.membership.as_now(job.job_id)]
    refused: type[Exception] = Exception if whole else StoreWriteError
    try:
        with queue.hub.held():
            yield
    except refused:
        for step in undo:
            step()
        queue.forget_order()
        raise
