"""A job of several replicas that loses one after its groups' last synchronisation: the
replicas that finished hold the job's weights, so the job completes on them, unless the one
lost was to export a stage's final weights and they never reached the leader."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from swarm_core.contract.job import ShardReceipt
from swarm_core.leader import LeaderConfig, create_app
from swarm_core.leader.keys import STATE_KEY
from tests.api_support import (
    A,
    beating,
    expect_ok,
    get_job,
    grid_job,
    heartbeat,
    register,
    replicated_job,
    report,
    wait_for,
)
from tests.support import AUTH, TOKEN

STEPS = 50  # (the helpers' jobs)


@pytest.fixture
async def quick(aiohttp_client, tmp_path: Path) -> TestClient:
    """A leader whose heartbeat timeout is a second: a dead fellow goes stale, and a round
    waits out its timeout, within a test's patience."""
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, stale_after_s=1.0,
                       heartbeat_interval_s=0.2, tick_s=0.05)
    return await aiohttp_client(create_app(cfg))


async def _ended(api: TestClient, jid: str) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        job = await get_job(api, jid)
        return job if job["state"] != "RUNNING" else None

    # (past the round's heartbeat timeout, and a recovery's: whichever way it goes, it has)
    return await wait_for(ended, timeout=6.0, interval=0.05)


async def _complete(api: TestClient, jid: str, reg: dict[str, Any], replica: int,
                    stage: int = 0) -> None:
    assert (await report(api, jid, reg, "COMPLETED", step=STEPS, stage=stage,
                         replica=replica, loss=1.5, epoch=0)).status == 200


@pytest.mark.parametrize("dies", ["failed", "stale"])
async def test_a_replica_lost_after_the_others_finished_leaves_a_completed_job(quick, dies):
    """Replicas 0 and 1 of three completed; replica 2 (not the one that exports) then fails,
    or its fellow stops heartbeating, before its own COMPLETED. Every synchronisation is
    behind it, the others hold the job's weights: the job completes (it used to wait out the
    heartbeat timeout for the finished cells to ask for a regroup, and failed with "no
    replica left to train on"), and replica 2's departure is recorded as any other is: in
    the job's membership, members and completion reason."""
    api = quick
    jid, by_replica = await replicated_job(api, 7800)
    for r in range(3):
        assert (await report(api, jid, by_replica[r], "RUNNING", step=STEPS - 1, stage=0,
                             replica=r, loss=2.0, tokens_per_s=100.0,
                             metrics={"wire_tx_bytes": 10})).status == 200
    assert (await get_job(api, jid))["metrics"]["tokens_per_s"] == 300.0
    for r in (0, 1):
        await _complete(api, jid, by_replica[r], r)
    assert (await get_job(api, jid))["state"] == "RUNNING"  # (replica 2's cell to come)
    if dies == "failed":
        assert (await report(api, jid, by_replica[2], "FAILED", step=STEPS - 1, stage=0,
                             replica=2, message="killed")).status == 200
        job = await _ended(api, jid)
    else:
        # (the finished fellows beat on, ready; replica 2's has stopped)
        async with beating(api, [by_replica[0], by_replica[1]], STEPS):
            job = await _ended(api, jid)
    assert job["state"] == "COMPLETED", job["reason"]
    assert job["reason"].startswith(f"all 1 stage(s) x 3 replicas (1 replica(s) left) "
                                    f"finished at step {STEPS}")
    assert job["restarts"] == []
    # Recorded as any departure, after the last step (it trained every one of them).
    [change] = job["membership"]
    assert (change["step"], change["left"], change["members"]) == (STEPS + 1, [2], [0, 1])
    assert change["reason"] and job["members"] == [0, 1]
    assert job["metrics"]["tokens_per_s"] == 200.0  # (the members' alone, as after any change)


async def test_a_replica_lost_while_the_others_train_their_last_steps_is_not_waited_for(quick):
    """Replica 2 fails after the last synchronisation while replicas 0 and 1 still train
    their last steps (nothing is left to break their rings: they never ask for a regroup).
    They are at work, so the round waits for them; once they complete, the job does."""
    api = quick
    jid, by_replica = await replicated_job(api, 7810)
    job = await get_job(api, jid)
    for r in (0, 1):
        await heartbeat(api, by_replica[r], status="busy", running=[
            {"job_id": jid, "stage": 0, "replica": r, "attempt": job["attempt"]}])
    assert (await report(api, jid, by_replica[2], "FAILED", step=STEPS - 1, stage=0,
                         replica=2, message="killed")).status == 200
    for r in (0, 1):
        await _complete(api, jid, by_replica[r], r)
    job = await _ended(api, jid)
    assert job["state"] == "COMPLETED", job["reason"]


@pytest.mark.parametrize("pushed", [True, False], ids=["exported", "not-exported"])
async def test_the_exporting_replica_lost_at_the_end_completes_only_with_its_export(quick,
                                                                                   pushed):
    """Replica 0 leads its stage group: it alone writes the stage's final shard (the job's
    export), before its COMPLETED. Lost after the others finished: where its final shard
    reached the leader, nothing of the job is missing and it completes; where not, no
    replica left holds the export, and the job ends as a chain's lost stage does (here
    resume_policy fail), naming what is missing and why."""
    api = quick
    jid, by_replica = await replicated_job(api, 7820)
    lead = by_replica[0]
    if pushed:
        api.app[STATE_KEY].jobs.get(jid).latest_shard_pushes["0"] = ShardReceipt(
            stage=0, fellow_id=lead["fellow_id"], step=STEPS)
    for r in (1, 2):
        await _complete(api, jid, by_replica[r], r)
    assert (await report(api, jid, lead, "FAILED", step=STEPS, stage=0, replica=0,
                         message="killed")).status == 200
    job = await _ended(api, jid)
    if pushed:
        assert job["state"] == "COMPLETED", job["reason"]
        return
    assert job["state"] == "FAILED"
    assert job["reason"].startswith(
        f"replica 0 was lost after the others finished, before its final shard of stage 0 "
        f"(step {STEPS}, the job's export) reached the leader: fellow {lead['fellow_id']}"), \
        job["reason"]
    assert "killed" in job["reason"]


async def test_a_finished_stage_group_needs_no_regroup_order(quick):
    """Two stages, two replicas. Stage 0's group finished (both cells COMPLETED) when
    replica 1's stage-1 cell fails in stage 1's last synchronisation; replica 0's stage-1
    cell asks for a regroup. The finished cells are neither waited for nor taken as lost:
    replica 1 leaves, stage 1's survivor gets its order at once, and its COMPLETED ends the
    job (it used to fail: the finished stage-0 cells never asked)."""
    api = quick
    jid, _job, cell = await grid_job(api, 7830)
    for r in (0, 1):
        await _complete(api, jid, cell[(0, r)], r, stage=0)
    assert (await report(api, jid, cell[(1, 1)], "FAILED", step=STEPS - 1, stage=1, replica=1,
                         message="killed")).status == 200
    reg = cell[(1, 0)]
    body = {"fellow_id": reg["fellow_id"], "stage": 1, "replica": 0, "op_step": STEPS - 1,
            "synced_step": STEPS - 2}
    answer = await expect_ok(await api.post(f"{A}/jobs/{jid}/regroup", json=body,
                                            params={"wait": "3"}, headers=reg["headers"]))
    assert answer["order"] is not None and answer["order"]["members"] == [0]
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING" and job["members"] == [0]
    [change] = job["membership"]
    assert change["left"] == [1] and "killed" in change["reason"]
    await _complete(api, jid, reg, 0, stage=1)
    job = await get_job(api, jid)
    assert job["state"] == "COMPLETED", job["reason"]
    assert "(1 replica(s) left)" in job["reason"]


async def test_a_fellow_lost_with_two_cells_of_the_exporting_replica_ends_the_job_once(
        quick, monkeypatch):
    """Two stages, two replicas, two slots a fellow: replica 0's chain is one fellow, which
    stops heartbeating after replica 1 finished, its export not pushed. Its first cell ends
    the job; its second, lost in the same check, must not begin a round on the ended job
    and end it again (its STOPs, its run files, its event, twice)."""
    api = quick
    fellows = [await register(api, f"f{i}", devices=["cpu", "cpu"],
                              data_addrs=[f"127.0.0.1:{7840 + i}", f"127.0.0.1:{7850 + i}"],
                              data_addr=f"127.0.0.1:{7840 + i}") for i in range(2)]
    body = {"name": "r", "kind": "train",
            "model": {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8},
            "training": {"steps": STEPS, "batch_size": 4, "micro_batches": 1},
            "topology": {"stages": 2, "replicas": 2, "slots_per_fellow": 2}}
    jid = (await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201))["job_id"]
    cells = {(c["stage"], c["replica"]): c["fellow_id"]
             for c in (await get_job(api, jid))["placement"]["stages"]}
    lead = next(f for f in fellows if f["fellow_id"] == cells[(0, 0)])
    other = next(f for f in fellows if f is not lead)
    assert cells[(1, 0)] == lead["fellow_id"] and cells[(1, 1)] == other["fellow_id"]
    jobs = api.app[STATE_KEY].jobs
    ends: list[str] = []
    finish = jobs.finish

    def counted(job: Any, state: Any, reason: str) -> None:
        ends.append(reason)
        finish(job, state, reason)

    monkeypatch.setattr(jobs, "finish", counted)
    for s in (0, 1):
        await _complete(api, jid, other, 1, stage=s)
    async with beating(api, [other], STEPS):
        job = await _ended(api, jid)
        await asyncio.sleep(0.3)  # (ticks go by)
    assert job["state"] == "FAILED" and "final shard of stage 0" in job["reason"]
    assert ends == [job["reason"]]
