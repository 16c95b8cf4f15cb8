"""What the leader keeps of a job, read back: a rule added since does not make it unreadable,
a row it cannot read does not stop it, and a recovery that cannot go on ends the job."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from swarm_core.contract import JobList
from swarm_core.leader import LeaderConfig, create_app
from swarm_core.leader.app import DB_FILE
from swarm_core.leader.routes import SESSION_HEADER
from swarm_core.leader.store import Store
from swarm_core.schema import structure
from tests.support import AUTH, TOKEN

A = "/api/v1"
MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}


async def _submit(api: Any, **training: Any) -> dict[str, Any]:
    resp = await api.post(f"{A}/jobs", headers=AUTH, json={
        "kind": "train", "model": MODEL, "topology": {"fellows": 2},
        "training": {"steps": 3, **training}})
    assert resp.status == 201, await resp.text()
    return await resp.json()


async def test_a_stored_job_that_a_newer_rule_refuses_still_loads_and_lists(aiohttp_client,
                                                                           tmp_path: Path):
    """A job stored when a limit was looser (here: 9999 threads, past today's 256) is still
    the leader's after a restart, and a client reads the list that holds it."""
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05)
    api = await aiohttp_client(create_app(cfg))
    job = await _submit(api)
    await api.close()
    store = Store(cfg.state_dir / DB_FILE)
    (row,) = store.load_jobs()
    row["training"]["threads"] = 9999  # as an older leader let it in
    store.save_job(row)
    store.close()

    api = await aiohttp_client(create_app(cfg))
    resp = await api.get(f"{A}/jobs", headers=AUTH)
    assert resp.status == 200
    listed = structure(await resp.json(), JobList, trust=True)  # as SwarmClient reads it
    assert [(j.job_id, j.train.threads) for j in listed.jobs] == [(job["job_id"], 9999)]


async def test_the_latest_finished_come_first_after_a_restart(aiohttp_client, tmp_path: Path):
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05)
    api = await aiohttp_client(create_app(cfg))
    jobs = [(await _submit(api))["job_id"] for _ in range(3)]
    for jid in (jobs[2], jobs[0]):  # the newest first, then the oldest
        assert (await api.post(f"{A}/jobs/{jid}/cancel", headers=AUTH)).status == 200
    await api.close()

    api = await aiohttp_client(create_app(cfg))
    resp = await api.get(f"{A}/jobs", params={"order": "finished"}, headers=AUTH)
    assert [j["job_id"] for j in (await resp.json())["jobs"]] == [jobs[0], jobs[2]]


async def test_a_stored_row_the_leader_cannot_read_is_left_out_not_fatal(aiohttp_client,
                                                                        tmp_path: Path, caplog):
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05)
    api = await aiohttp_client(create_app(cfg))
    kept = await _submit(api)
    spoiled = await _submit(api)
    await api.close()
    store = Store(cfg.state_dir / DB_FILE)
    row = next(r for r in store.load_jobs() if r["job_id"] == spoiled["job_id"])
    row["model"]["d_model"] = "wide"  # not even the type
    store.save_job(row)
    store.close()

    api = await aiohttp_client(create_app(cfg))
    jobs = (await (await api.get(f"{A}/jobs", headers=AUTH)).json())["jobs"]
    assert [j["job_id"] for j in jobs] == [kept["job_id"]]
    assert f"job {spoiled['job_id']} left out" in caplog.text


async def test_a_recovery_no_spare_can_serve_fails_the_job_instead_of_hanging(aiohttp_client,
                                                                             tmp_path: Path):
    """resume_policy replace, a stage's fellow stops heartbeating, and the only ready spare
    registered no data address: the recovery cannot start anyone, so the job fails, naming
    the stage, with the placement it ran on; it does not stay RUNNING with idle fellows."""
    cfg = LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, tick_s=0.05,
                       stale_after_s=0.6, heartbeat_interval_s=0.2)
    api = await aiohttp_client(create_app(cfg))
    regs = []
    for i, addr in enumerate(["127.0.0.1:9001", "127.0.0.1:9002", None]):
        body = {"name": f"f{i}", "instance_id": f"i{i}", **({"data_addr": addr} if addr else {})}
        reg = await (await api.post(f"{A}/fellows/register", json=body, headers=AUTH)).json()
        regs.append({**reg, "headers": {**AUTH, SESSION_HEADER: reg["session"]}})
    # (the spare registers before the job, so it is ready but not placed: the job takes two)
    job = await _submit(api, resume_policy="replace")
    ran_on = job["fellows"]
    assert set(ran_on) == {regs[0]["fellow_id"], regs[1]["fellow_id"]}
    alive = {regs[0]["fellow_id"], regs[2]["fellow_id"]}  # fellow 1 dies

    async def beat() -> None:
        while True:
            for reg in regs:
                if reg["fellow_id"] in alive:
                    # (ready: as a fellow is again once STOP has reached it)
                    await api.post(f"{A}/fellows/{reg['fellow_id']}/heartbeat",
                                   headers=reg["headers"], json={"status": "ready"})
            await asyncio.sleep(0.05)

    beating = asyncio.create_task(beat())
    try:
        deadline = time.monotonic() + 10
        while True:
            info = await (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
            if info["state"] != "RUNNING" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    finally:
        beating.cancel()
    assert info["state"] == "FAILED", info["reason"]
    assert f"fellow {regs[1]['fellow_id']} (f1)" in info["reason"]
    assert "no ready fellow can take stage" in info["reason"]
    assert info["fellows"] == ran_on and info["restarts"] == []
