"""A fellow's step reports: one at a time and in order, and what queued while one was in
flight goes to the leader as one batch (a stage training faster than one HTTP report a step
would otherwise fall ever further behind)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from swarm_core.contract import JobStatusUpdate
from swarm_core.fellow.jobs import JobContext, Progress
from swarm_core.fellow.train import StepReporter


@pytest.mark.parametrize("batches", [True, False], ids=["batched", "one-by-one"])
async def test_reports_that_queue_while_one_is_in_flight_go_as_one_batch_in_order(batches):
    sent: list[list[int]] = []
    in_flight = asyncio.Event()

    async def report(upd: JobStatusUpdate) -> None:
        sent.append([upd.step])
        if upd.step == 1:
            await in_flight.wait()  # (the leader is slow to answer the first)

    async def report_steps(updates: list[JobStatusUpdate]) -> None:
        assert all(u.state == "RUNNING" and u.fellow_id == 3 for u in updates)
        sent.append([u.step for u in updates])

    ctx = JobContext(fellow_id=3, progress=Progress(), report=report,
                     report_steps=report_steps if batches else None)
    reporter = StepReporter(SimpleNamespace(stage=1, replica=0, attempt=0), ctx,
                            asyncio.get_running_loop())
    running = asyncio.create_task(reporter.run())
    reporter.on_eval(1, 3.0)
    while not sent:
        await asyncio.sleep(0.01)
    for step in range(2, 6):
        reporter.on_eval(step, 3.0)
    await asyncio.sleep(0.05)
    in_flight.set()
    while sum(map(len, sent)) < 5:
        await asyncio.sleep(0.01)
    await asyncio.to_thread(reporter.on_eval, 6, 3.0)  # (as the stage thread ends)
    reporter.close()
    await asyncio.wait_for(running, 2.0)
    assert sent == ([[1], [2, 3, 4, 5], [6]] if batches else [[s] for s in range(1, 7)])


async def test_a_leader_older_than_batches_gets_the_reports_one_by_one():
    """A leader without ``/statuses`` answers a batch 404 (or 405): the fellow sends the same
    reports one by one, in order, rather than dropping them."""
    from swarm_core.client import ApiError
    from swarm_core.fellow.daemon import FellowDaemon, FellowOptions

    daemon = FellowDaemon(FellowOptions(leader_url="http://127.0.0.1:9", token="t"))
    sent: list[int] = []

    async def job_statuses(job_id, session, updates):
        raise ApiError(404, "not_found", "no route")

    async def job_status(job_id, session, upd):
        sent.append(upd.step)

    daemon.client.job_statuses = job_statuses  # type: ignore[method-assign]
    daemon.client.job_status = job_status  # type: ignore[method-assign]
    updates = [JobStatusUpdate(fellow_id=1, state="RUNNING", step=s) for s in (4, 5, 6)]
    await daemon._report("job-1", updates)
    assert sent == [4, 5, 6]
    await daemon.client.close()
