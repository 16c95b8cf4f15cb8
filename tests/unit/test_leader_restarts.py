"""A leader's stop and restart. Restarted under a running job, it waits for its fellows as
long as their reconnect backoff can take: a healthy job is not failed because its fellows were
between two tries. Stopping, it answers its open long polls at once instead of waiting out
its shutdown grace. A real leader app on a loopback port, restarted on the same state and
port; the real fellow daemon code in this process, with its default backoff."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from swarm_core.contract import JobSubmit
from swarm_core.fellow import daemon as fellow_daemon
from swarm_core.fellow.daemon import reconnect_cap
from swarm_core.protocol import RegisterRequest
from swarm_core.schema import structure
from tests.support import TOKEN
from tests.support import wait_async as _wait
from tests.tui_support import LiveLeader, no_engine  # noqa: F401  (a fixture)

STALE_S = 1.0


def test_a_fellow_backs_off_at_most_a_quarter_of_the_heartbeat_timeout():
    assert reconnect_cap(5.0, 2.0) == 0.5
    assert reconnect_cap(5.0, 60.0) == 5.0  # (never beyond its own cap)
    assert reconnect_cap(5.0, 0.4) == 0.2


async def test_a_job_survives_a_leader_restart_longer_than_the_heartbeat_timeout(
        tmp_path, no_engine):  # noqa: F811
    leader = LiveLeader(tmp_path / "state", stale_after_s=STALE_S)
    await leader.start()
    daemons = [fellow_daemon.FellowDaemon(fellow_daemon.FellowOptions(
        leader_url=leader.url, token=TOKEN, name=f"f{i}", heartbeat_s=0.25, poll_wait_s=2.0))
        for i in range(2)]
    tasks = [asyncio.create_task(d.run()) for d in daemons]
    try:
        async with leader.client() as c:
            await _wait(lambda: _ready(c, 2), "two ready fellows")
            job = await c.submit(structure({
                "kind": "smoke", "topology": {"fellows": 2},
                "training": {"steps": 80, "step_seconds": 0.05}}, JobSubmit))
            await _wait(lambda: _past(c, job.job_id, 5), "the job to take steps")
        assert all(d.backoff_cap == reconnect_cap(5.0, STALE_S) for d in daemons)
        await leader.stop()
        # Down for 3.5 heartbeat timeouts: backing off to its own 5 s cap, a fellow's next
        # try came ~2.7 s after the restart, past the grace, and the job failed.
        await asyncio.sleep(3.5 * STALE_S)
        await leader.start()
        async with leader.client() as c:
            done = await _wait(lambda: _finished(c, job.job_id), "the job to end", 60)
        assert done.state == "COMPLETED", done.reason
        assert done.last_step == 80
    finally:
        for d in daemons:
            d.request_stop("test over")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # the daemons installed these
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
        await leader.stop()


async def _ready(c, n: int) -> bool:
    return sum(f.status == "ready" for f in await c.fellows()) >= n


async def _past(c, job_id: str, step: int) -> bool:
    return (await c.job(job_id)).last_step >= step


async def _finished(c, job_id: str):
    job = await c.job(job_id)
    return job if job.state in ("COMPLETED", "FAILED", "CANCELLED") else None


async def test_a_stopping_leader_answers_its_long_polls_at_once(tmp_path):
    """A poll's handler outlives the fellow that made it; the server waits for running
    handlers when it stops, so a leader with fellows stopped only when their 15 s polls ran
    out (or its shutdown grace did: `swarm stop-cluster` took 6 s)."""
    leader = LiveLeader(tmp_path / "state")
    await leader.start()
    async with leader.client() as c:
        reg = await c.register(RegisterRequest(name="f0", instance_id="f0-1"))
        poll = asyncio.create_task(c.poll_signals(reg.fellow_id, reg.session, 0, 10.0))
        await asyncio.sleep(0.3)  # (the poll is waiting in the leader)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await leader.stop()
        stopped_in = loop.time() - t0
        batch = await asyncio.wait_for(poll, 5)
    assert batch.signals == []
    assert stopped_in < 3.0, stopped_in
