"""The leader neither loses nor corrupts what it was told: a replica that left cannot write
over the survivors, a full disk refuses an update rather than half-applying it, and no number
a fellow sends can make a job unstorable (issue 36, points 1-3).

A real leader app on a loopback port (aiohttp's test server), restarted on the same state
directory where a case needs it; fake fellows over HTTP, or the real fellow daemon code in this
process where the case is the fellow's own retry."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest

from swarm_core.artifacts.shards import build_manifest, npz_bytes
from swarm_core.contract import JobSubmit
from swarm_core.leader import LeaderConfig, create_app
from swarm_core.leader.keys import STATE_KEY
from swarm_core.leader.store import Store, StoreWriteError
from swarm_core.schema import structure
from swarm_core.validators import MAX_STEPS
from tests.api_support import (
    beating,
    expect_error,
    expect_ok,
    get_job,
    heartbeat,
    register,
    report,
    submit,
)
from tests.support import AUTH, TOKEN
from tests.support import wait_async as _wait
from tests.tui_support import Fellows, LiveLeader, no_engine  # noqa: F401  (a fixture)

A = "/api/v1"
MODEL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 8}
STEPS = 50


def _config(tmp_path: Path, **kw: Any) -> LeaderConfig:
    return LeaderConfig(state_dir=tmp_path / "state", token=TOKEN, **{"tick_s": 0.05, **kw})


async def _replica_job(api: Any, port: int, replicas: int = 2
                       ) -> tuple[str, dict[int, dict[str, Any]]]:
    """A running train job of one stage and ``replicas`` replicas: its id and the fellow of
    each replica."""
    fellows = [await register(api, f"f{i}", data_addr=f"127.0.0.1:{port + i}")
               for i in range(replicas)]
    body = {"name": "r", "kind": "train", "model": MODEL,
            "training": {"steps": STEPS, "batch_size": 6, "micro_batches": 1},
            "topology": {"stages": 1, "replicas": replicas}}
    job = await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201)
    assert job["state"] == "RUNNING", job
    return job["job_id"], {c["replica"]: next(f for f in fellows
                                              if f["fellow_id"] == c["fellow_id"])
                           for c in job["placement"]["stages"]}


def _shard(job_id: str, fellow_id: int, replica: int, step: int,
           value: float) -> aiohttp.MultipartWriter:
    """A push of stage 0's shard (weights of ``value``) as the fellow of ``replica`` makes it."""
    arrays = {"w": np.full(4, value, dtype=np.float32)}
    weights = npz_bytes(arrays)
    manifest = build_manifest(job_id=job_id, stage=0, num_stages=1, fellow_id=fellow_id,
                              fellow_name=f"f{fellow_id}", layers=(0, 1), step=step,
                              model=MODEL, seed=0, vocab_size=32, tokenizer={"name": "byte"},
                              arrays=arrays, weights=weights, replica=replica)
    form = aiohttp.MultipartWriter("form-data")
    for name, data in (("manifest", orjson.dumps(manifest)), ("weights", weights)):
        form.append(data).set_content_disposition("form-data", name=name)
    return form


# --- 1. a replica that left ------------------------------------------------------------------


async def test_a_replica_the_survivors_regrouped_without_can_no_longer_write(aiohttp_client,
                                                                            tmp_path):
    """Replica 1's fellow stops heartbeating; the leader drops it and replica 0 trains on
    alone, pushing its shard at step 6. The departed fellow's late shard (step 4) and its late
    RUNNING report are refused (409): the export stays the survivor's, and the job's step,
    loss and figures are as they were. (Both were taken: the export went back to the older
    weights and the survivor's newer shard was deleted.)"""
    cfg = _config(tmp_path, stale_after_s=0.6, heartbeat_interval_s=0.2,
                  max_upload_bytes=200_000)
    api = await aiohttp_client(create_app(cfg))
    jid, by_replica = await _replica_job(api, 7600)
    survivor, gone = by_replica[0], by_replica[1]
    alive = {survivor["fellow_id"], gone["fellow_id"]}
    async with beating(api, [survivor, gone], 3, alive, jid):
        alive.discard(gone["fellow_id"])  # (its fellow went quiet)

        async def ordered() -> Any:
            answer = await expect_ok(await api.post(
                f"{A}/jobs/{jid}/regroup", params={"wait": "0.5"}, headers=survivor["headers"],
                json={"fellow_id": survivor["fellow_id"], "stage": 0, "replica": 0,
                      "op_step": 3, "synced_step": 2}))
            return answer["order"]

        order = await _wait(ordered, "the survivor's regroup order", timeout=10)
        assert order["members"] == [0]
        assert (await get_job(api, jid))["members"] == [0]
        resp = await api.post(f"{A}/jobs/{jid}/shards/0", headers=survivor["headers"],
                              data=_shard(jid, survivor["fellow_id"], 0, 6, 1.0))
        assert resp.status == 201, await resp.text()
        assert (await expect_ok(await report(api, jid, survivor, "RUNNING", step=6, stage=0,
                                             replica=0, loss=2.5,
                                             metrics={"wire_tx_bytes": 10}))) \
            ["last_loss"] == 2.5
        before = await get_job(api, jid)
        shards = cfg.state_dir / "runs" / jid / "model_export" / "shards"
        held = sorted(p.name for p in shards.iterdir())
        kept = (shards / held[0] / "weights.npz").read_bytes()

        late = await api.post(f"{A}/jobs/{jid}/shards/0", headers=gone["headers"],
                              data=_shard(jid, gone["fellow_id"], 1, 4, 9.0))
        err = await expect_error(late, 409, "replica_left", "manifest.replica")
        assert "replica 1 has left" in err["message"]
        late = await report(api, jid, gone, "RUNNING", step=7, stage=0, replica=1, loss=99.0,
                            metrics={"wire_tx_bytes": 10})
        await expect_error(late, 409, "replica_left", "$.replica")

        after = await get_job(api, jid)
        assert held == [f"stage-0-fellow-{survivor['fellow_id']}"]
        assert sorted(p.name for p in shards.iterdir()) == held
        assert (shards / held[0] / "weights.npz").read_bytes() == kept
        assert after["latest_shard_pushes"] == before["latest_shard_pushes"]
        assert after["latest_shard_pushes"]["0"]["step"] == 6
        for key in ("last_step", "last_loss", "metrics", "state", "members"):
            assert after[key] == before[key], key
        records = (await expect_ok(await api.get(f"{A}/jobs/{jid}/progress",
                                                 headers=AUTH)))["records"]
        assert all(r["step"] != 7 for r in records)


async def test_a_spare_joining_across_a_leader_restart_is_not_taken_for_one_that_left(
        aiohttp_client, tmp_path):
    """Replica 1 left and a spare was placed as it; the leader restarts before the group
    takes it in (a join is leader-local: the new leader does not know of it). The spare's
    report is not refused as a departed replica's: its cells were never counted done."""
    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    jid, by_replica = await _replica_job(api, 8000, replicas=3)
    await expect_ok(await report(api, jid, by_replica[1], "FAILED", step=4, stage=0,
                                 replica=1, message="killed"))
    for r in (0, 2):
        await expect_ok(await api.post(
            f"{A}/jobs/{jid}/regroup", headers=by_replica[r]["headers"],
            json={"fellow_id": by_replica[r]["fellow_id"], "stage": 0, "replica": r,
                  "op_step": 4, "synced_step": 3}))
    assert (await get_job(api, jid))["members"] == [0, 2]
    spare = await register(api, "spare", data_addr="127.0.0.1:8100")

    async def placed() -> bool:
        cells = (await get_job(api, jid))["placement"]["stages"]
        return any(c["fellow_id"] == spare["fellow_id"] for c in cells)

    await _wait(placed, "the spare to be placed as replica 1")
    await api.close()
    api = await aiohttp_client(create_app(cfg))
    spare = await register(api, "spare", data_addr="127.0.0.1:8100")  # (the same process)
    resp = await report(api, jid, spare, "RUNNING", step=6, stage=0, replica=1, loss=2.0)
    assert resp.status == 200, await resp.text()
    gone = await register(api, "f1", data_addr="127.0.0.1:8001")
    await expect_error(await report(api, jid, gone, "RUNNING", step=6, stage=0, replica=1),
                       409, "not_in_job")  # (its cell is the spare's now)


# --- 2. a full disk ----------------------------------------------------------------------------


class _FullOnce:
    """The store's SQLite connection, whose first write matching ``sql`` (and, if given, with
    ``param`` among its parameters) fails as a full disk does."""

    def __init__(self, db: sqlite3.Connection, sql: str, param: Any = None) -> None:
        self.db, self.sql, self.param = db, sql, param
        self.failed = 0

    def execute(self, sql: str, params: Any = ()) -> Any:
        if not self.failed and sql.startswith(self.sql) and \
                (self.param is None or self.param in params):
            self.failed += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.db.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


def _disk_full_once(monkeypatch: pytest.MonkeyPatch, store: Store, sql: str,
                    param: Any = None) -> _FullOnce:
    full = _FullOnce(store._db, sql, param)
    monkeypatch.setattr(store, "_db", full)
    return full


async def get_fellow_job(api: Any, reg: dict[str, Any]) -> str | None:
    fellow = await expect_ok(await api.get(f"{A}/fellows/{reg['fellow_id']}", headers=AUTH))
    return fellow["current_job"]


async def test_a_completion_the_disk_has_no_room_for_is_refused_and_taken_on_retry(
        aiohttp_client, tmp_path, monkeypatch):
    """The state dir is out of space when the last fellow reports COMPLETED: the report is
    answered 503 naming the full disk and nothing changes (the job is RUNNING, in memory as
    in the store); the fellow's retry, once there is room, completes the job, and a restarted
    leader finds it COMPLETED. (It turned COMPLETED in memory only: a 500, then 409 to the
    retry, and after a restart RUNNING, then FAILED.)"""
    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    a, b = await register(api, "a"), await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    await expect_ok(await report(api, jid, a, "COMPLETED", step=5))
    before = await get_job(api, jid)
    full = _disk_full_once(monkeypatch, api.app[STATE_KEY].store, "UPDATE jobs")

    resp = await report(api, jid, b, "COMPLETED", step=5, message="done")
    err = await expect_error(resp, 503, "not_stored")
    assert full.failed == 1
    assert "the disk is full" in err["message"] and "changed nothing" in err["message"]
    assert "\n" not in err["message"]
    assert await get_job(api, jid) == before
    assert await get_fellow_job(api, b) == jid  # (still the job's: it has not ended)

    done = await expect_ok(await report(api, jid, b, "COMPLETED", step=5, message="done"))
    assert done["state"] == "COMPLETED" and done["reason"] == "done"
    await api.close()
    api = await aiohttp_client(create_app(cfg))
    again = await get_job(api, jid)
    assert again["state"] == "COMPLETED" and again["reason"] == "done"


async def test_a_refused_completion_leaves_the_store_as_the_leader_says(aiohttp_client,
                                                                       tmp_path, monkeypatch):
    """The disk fills at the last COMPLETED and the leader restarts before the fellow
    retries: it finds the job RUNNING, as it answered; the fellow's report to the new leader
    completes it."""
    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    a, b = await register(api, "a"), await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    await expect_ok(await report(api, jid, a, "COMPLETED", step=5))
    _disk_full_once(monkeypatch, api.app[STATE_KEY].store, "UPDATE jobs")
    await expect_error(await report(api, jid, b, "COMPLETED", step=5), 503, "not_stored")
    await api.close()

    api = await aiohttp_client(create_app(cfg))
    assert (await get_job(api, jid))["state"] == "RUNNING"
    b = await register(api, "b")  # (the same process: sessions are per leader)
    done = await expect_ok(await report(api, jid, b, "COMPLETED", step=5))
    assert done["state"] == "COMPLETED"


async def test_a_batch_of_step_reports_the_disk_has_no_room_for_changes_nothing(
        aiohttp_client, tmp_path, monkeypatch):
    """A batch of three step reports whose second record finds the disk full: 503, and
    neither the first step's record nor the job's progress stays (one transaction); the
    fellow's retry is taken whole, and a restarted leader has every step."""
    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    jid, by_replica = await _replica_job(api, 7600)
    reg = by_replica[0]
    batch = {"updates": [{"fellow_id": reg["fellow_id"], "state": "RUNNING", "step": s,
                          "loss": 3.0, "metrics": {"wire_tx_bytes": 10}} for s in (1, 2, 3)]}
    before = await get_job(api, jid)
    full = _disk_full_once(monkeypatch, api.app[STATE_KEY].store, "INSERT INTO progress", 2)
    url = f"{A}/jobs/{jid}/statuses"
    await expect_error(await api.post(url, json=batch, headers=reg["headers"]), 503,
                       "not_stored")
    assert full.failed == 1
    assert await get_job(api, jid) == before
    progress = f"{A}/jobs/{jid}/progress"
    assert (await expect_ok(await api.get(progress, headers=AUTH)))["records"] == []
    await expect_ok(await api.post(url, json=batch, headers=reg["headers"]))
    await api.close()
    api = await aiohttp_client(create_app(cfg))
    records = (await expect_ok(await api.get(progress, headers=AUTH)))["records"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert (await get_job(api, jid))["last_step"] == 3


async def test_a_final_report_a_heartbeat_carries_is_refused_whole_on_a_full_disk(
        aiohttp_client, tmp_path, monkeypatch):
    """A fellow that gave its COMPLETED up sends it with its heartbeats. With the disk full
    the heartbeat is answered 503 (so the fellow keeps the report for the next one) and the
    job is unchanged; the next heartbeat completes it."""
    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    a, b = await register(api, "a"), await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    await expect_ok(await report(api, jid, a, "COMPLETED", step=5))
    before = await get_job(api, jid)
    _disk_full_once(monkeypatch, api.app[STATE_KEY].store, "UPDATE jobs")
    beat = {"status": "ready", "unreported": [{"job_id": jid, "report": {
        "fellow_id": b["fellow_id"], "state": "COMPLETED", "step": 5}}]}
    url = f"{A}/fellows/{b['fellow_id']}/heartbeat"
    await expect_error(await api.post(url, json=beat, headers=b["headers"]), 503, "not_stored")
    assert await get_job(api, jid) == before
    await expect_ok(await api.post(url, json=beat, headers=b["headers"]))
    assert (await get_job(api, jid))["state"] == "COMPLETED"


async def test_a_fellow_retries_a_final_report_the_leader_could_not_store(
        tmp_path, monkeypatch, caplog, no_engine):  # noqa: F811
    """Real fellow daemons run a smoke job; the leader's disk is full for the write that
    would end it. The fellow whose COMPLETED was refused (503) tries again and the job
    completes, in the store as in memory, without its stage being run again. (The fellow
    took the 500 as final; the job was COMPLETED in memory only, and RUNNING after a
    restart. A fellow that took a 503 as final had its stage STARTed again by the
    leader, which saw it run nothing: a train stage would train again from scratch.)"""
    leader = LiveLeader(tmp_path / "state", stale_after_s=5.0)
    await leader.start()
    assert leader.server is not None
    full = _disk_full_once(monkeypatch, leader.server.app[STATE_KEY].store, "UPDATE jobs",
                           "COMPLETED")
    fellows = Fellows(leader.url, ["f0", "f1"])
    await fellows.start()
    try:
        async with leader.client() as c:
            await _wait(lambda: _ready(c, 2), "two ready fellows")
            job = await c.submit(structure({
                "kind": "smoke", "topology": {"fellows": 2},
                "training": {"steps": 3, "step_seconds": 0.02}}, JobSubmit))

            async def ended() -> Any:
                info = await c.job(job.job_id)
                return info if info.state in ("COMPLETED", "FAILED", "CANCELLED") else None

            done = await _wait(ended, "the job to end", timeout=30)
        assert full.failed == 1
        assert done.state == "COMPLETED", done.reason
        assert "sending it again" not in caplog.text
        await leader.stop()
        await leader.start()  # (what it answered is what it stored)
        async with leader.client() as c:
            assert (await c.job(job.job_id)).state == "COMPLETED"
    finally:
        await fellows.stop()
        await leader.stop()


async def _ready(c: Any, n: int) -> bool:
    return sum(f.status == "ready" for f in await c.fellows()) >= n


async def test_a_regroup_the_disk_has_no_room_for_changes_nothing(aiohttp_client, tmp_path,
                                                                  monkeypatch):
    """A replica fails and the survivors' regroup is decided while the disk is full: the
    deciding report is answered 503 and the job's membership, round and events are as before;
    asked again with room, the same report decides the same round."""
    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    jid, by_replica = await _replica_job(api, 7700, replicas=3)
    await expect_ok(await report(api, jid, by_replica[2], "FAILED", step=4, stage=0,
                                 replica=2, message="boom"))

    async def ask(replica: int, wait: float = 0.0):
        return await api.post(f"{A}/jobs/{jid}/regroup", params={"wait": str(wait)},
                              headers=by_replica[replica]["headers"],
                              json={"fellow_id": by_replica[replica]["fellow_id"], "stage": 0,
                                    "replica": replica, "op_step": 5, "synced_step": 3})

    assert (await expect_ok(await ask(0)))["order"] is None
    before = await get_job(api, jid)
    events = await expect_ok(await api.get(f"{A}/events", headers=AUTH))
    _disk_full_once(monkeypatch, api.app[STATE_KEY].store, "UPDATE jobs")
    await expect_error(await ask(1), 503, "not_stored")
    assert await get_job(api, jid) == before
    assert (await expect_ok(await api.get(f"{A}/events", headers=AUTH,
                                          params={"after": str(events["seq"])})))["events"] \
        == []
    answer = await expect_ok(await ask(1, wait=2.0))
    assert answer["order"]["members"] == [0, 1]
    assert (await expect_ok(await ask(0)))["order"] == answer["order"]
    job = await get_job(api, jid)
    assert job["members"] == [0, 1] and [c["left"] for c in job["membership"]] == [[2]]


async def test_a_tick_that_cannot_store_a_lost_fellow_tries_again(aiohttp_client, tmp_path,
                                                                 monkeypatch):
    """A fellow goes stale while the disk is full: the tick's failing of the job is not
    stored, so it is undone and tried again at the next tick; the job ends FAILED in the
    store as in memory. (It was FAILED in memory only, RUNNING after a restart.)"""
    cfg = _config(tmp_path, stale_after_s=0.3, heartbeat_interval_s=0.1)
    api = await aiohttp_client(create_app(cfg))
    a, _b = await register(api, "a"), await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    full = _disk_full_once(monkeypatch, api.app[STATE_KEY].store, "UPDATE jobs", "FAILED")

    async def failed() -> Any:
        await heartbeat(api, a, status="busy")  # (b goes quiet)
        return (await get_job(api, jid))["state"] == "FAILED"

    await _wait(failed, "the job to fail", timeout=10)
    assert full.failed == 1
    await api.close()
    api = await aiohttp_client(create_app(cfg))
    assert (await get_job(api, jid))["state"] == "FAILED"


async def test_a_cancel_the_disk_has_no_room_for_sends_no_stop(aiohttp_client, tmp_path,
                                                               monkeypatch):
    """Cancelling while the disk is full: 503, the job runs on and its fellows get no STOP;
    the cancel asked again goes through."""
    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    a = await register(api, "a")
    jid = (await submit(api, fellows=1))["job_id"]
    signals = await expect_ok(await api.get(f"{A}/fellows/{a['fellow_id']}/signals",
                                            headers=a["headers"]))
    seen = signals["signals"][-1]["seq"]
    _disk_full_once(monkeypatch, api.app[STATE_KEY].store, "UPDATE jobs")
    await expect_error(await api.post(f"{A}/jobs/{jid}/cancel", headers=AUTH), 503,
                       "not_stored")
    assert (await get_job(api, jid))["state"] == "RUNNING"
    pending = await expect_ok(await api.get(f"{A}/fellows/{a['fellow_id']}/signals",
                                            params={"after": str(seen)}, headers=a["headers"]))
    assert pending["signals"] == []
    cancelled = await expect_ok(await api.post(f"{A}/jobs/{jid}/cancel", headers=AUTH))
    assert cancelled["state"] == "CANCELLED"


# --- 3. numbers a job cannot store ---------------------------------------------------------


async def test_a_regroup_step_past_the_job_is_refused_and_the_job_survives(aiohttp_client,
                                                                          tmp_path):
    """A regroup report whose op_step is 2**63-1 (or any step past the job's) is a 400
    naming the field, and opens no round; the job is still listed after a restart. (It was
    taken: the change's step overflowed SQLite, and after a restart the job was gone.)"""
    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    jid, by_replica = await _replica_job(api, 7800, replicas=3)
    await expect_ok(await report(api, jid, by_replica[2], "FAILED", step=4, stage=0,
                                 replica=2, message="boom"))
    before = await get_job(api, jid)
    for replica, change, field, needle in (
            (0, {"op_step": 2**63 - 1}, "$.op_step", "must be between 0 and 10000000"),
            (1, {"op_step": 2**63 - 1}, "$.op_step", "must be between 0 and 10000000"),
            (0, {"op_step": STEPS}, "$.op_step", f"a step of the job (0 to {STEPS - 1})"),
            (1, {"synced_step": STEPS}, "$.synced_step", "a step of the job (-1 to"),
            (0, {"synced_step": -2}, "$.synced_step", "must be between -1 and")):
        reg = by_replica[replica]
        body = {"fellow_id": reg["fellow_id"], "stage": 0, "replica": replica, "op_step": 5,
                "synced_step": 3, **change}
        resp = await api.post(f"{A}/jobs/{jid}/regroup", json=body, headers=reg["headers"])
        err = await expect_error(resp, 400, field=field)
        assert needle in err["message"] and "\n" not in err["message"], err
    assert await get_job(api, jid) == before
    assert api.app[STATE_KEY].jobs.membership.rounds.get(jid) is None or \
        not api.app[STATE_KEY].jobs.membership.rounds[jid].reports
    await api.close()
    api = await aiohttp_client(create_app(cfg))
    listed = await expect_ok(await api.get(f"{A}/jobs", headers=AUTH))
    assert [j["job_id"] for j in listed["jobs"]] == [jid]


@pytest.mark.parametrize("step, needle", [
    (2**63 - 1, f"must be at most {MAX_STEPS}"),
    (STEPS + 1, f"manifest step {STEPS + 1} is past the job's last ({STEPS})"),
])
async def test_a_shard_step_past_the_job_is_refused_and_the_job_survives(aiohttp_client,
                                                                        tmp_path, step,
                                                                        needle):
    """A shard manifest whose step is past the job's steps (2**63-1 among them) is a 400
    naming manifest.step; nothing is written, and the job is listed after a restart."""
    cfg = _config(tmp_path, max_upload_bytes=200_000)
    api = await aiohttp_client(create_app(cfg))
    jid, by_replica = await _replica_job(api, 7900)
    lead = by_replica[0]
    resp = await api.post(f"{A}/jobs/{jid}/shards/0", headers=lead["headers"],
                          data=_shard(jid, lead["fellow_id"], 0, step, 1.0))
    err = await expect_error(resp, 400, field="manifest.step")
    assert needle in err["message"], err
    runs = cfg.state_dir / "runs" / jid
    assert not list(runs.rglob("*.npz")) and not list(runs.rglob("shard_manifest.json"))
    assert (await get_job(api, jid))["latest_shard_pushes"] == {}
    await api.close()
    api = await aiohttp_client(create_app(cfg))
    assert [j["job_id"] for j in (await expect_ok(await api.get(f"{A}/jobs", headers=AUTH)))
            ["jobs"]] == [jid]


@pytest.mark.parametrize("route, body, field", [
    ("status", {"state": "RUNNING", "step": 2**63 - 1}, "$.step"),
    ("status", {"state": "RUNNING", "step": 3, "metrics": {"steps": 2**63 - 1}},
     "$.metrics.steps"),
    ("status", {"state": "RUNNING", "step": 3, "metrics": {"step": MAX_STEPS + 1}},
     "$.metrics.step"),
    ("heartbeat", {"status": "busy", "current_step": 2**63 - 1}, "$.current_step"),
])
async def test_a_step_no_job_has_is_refused_where_it_is_structured(api, route, body, field):
    a, _b = await register(api, "a"), await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    before = await get_job(api, jid)
    url = f"{A}/jobs/{jid}/status" if route == "status" else \
        f"{A}/fellows/{a['fellow_id']}/heartbeat"
    if route == "status":
        body = {"fellow_id": a["fellow_id"], **body}
    resp = await api.post(url, json=body, headers=a["headers"])
    err = await expect_error(resp, 400, field=field)
    assert f"must be between 0 and {MAX_STEPS}" in err["message"]
    assert await get_job(api, jid) == before


async def test_a_record_the_store_cannot_hold_is_refused_and_memory_kept(aiohttp_client,
                                                                        tmp_path,
                                                                        monkeypatch):
    """The last line: should a value past int64 ever reach a job in memory (a bug; every
    input is bounded), the write is refused before it reaches SQLite, the change is undone,
    and the job stays readable after a restart (it vanished from GET /jobs)."""
    from swarm_core.leader.progress import ProgressBook

    cfg = _config(tmp_path)
    api = await aiohttp_client(create_app(cfg))
    a, _b = await register(api, "a"), await register(api, "b")
    jid = (await submit(api, fellows=2))["job_id"]
    await expect_ok(await report(api, jid, a, "RUNNING", step=2))
    before = await get_job(api, jid)
    real = ProgressBook.merge

    def buggy(self: ProgressBook, job: Any, *args: Any) -> None:
        real(self, job, *args)
        job.last_step = 2**63

    monkeypatch.setattr(ProgressBook, "merge", buggy)
    err = await expect_error(await report(api, jid, a, "RUNNING", step=3), 500, "not_stored")
    assert "$.last_step is an integer outside int64" in err["message"]
    assert await get_job(api, jid) == before
    await api.close()
    api = await aiohttp_client(create_app(cfg))
    assert (await get_job(api, jid))["last_step"] == 2


async def test_a_batch_that_fails_midway_for_any_reason_leaves_no_report_of_it(aiohttp_client,
                                                                            tmp_path,
                                                                            monkeypatch):
    """A batch's writes are one transaction, rolled back whatever ends it: should taking its
    second report fail other than by the store (a bug), the first report's change is put
    back in memory too, not left ahead of a store that never took it."""
    from swarm_core.leader.progress import ProgressBook

    api = await aiohttp_client(create_app(_config(tmp_path)))
    jid, by_replica = await _replica_job(api, 7700)
    reg = by_replica[0]
    before = await get_job(api, jid)
    real = ProgressBook.record

    def buggy(self: ProgressBook, job: Any, stage: int, replica: int, upd: Any) -> None:
        if upd.step == 2:
            raise RuntimeError("a bug taking step 2")
        real(self, job, stage, replica, upd)

    monkeypatch.setattr(ProgressBook, "record", buggy)
    batch = {"updates": [{"fellow_id": reg["fellow_id"], "state": "RUNNING", "step": s,
                          "loss": 3.0, "metrics": {"wire_tx_bytes": 10}} for s in (1, 2)]}
    resp = await api.post(f"{A}/jobs/{jid}/statuses", json=batch, headers=reg["headers"])
    assert resp.status == 500
    assert await get_job(api, jid) == before
    progress = await expect_ok(await api.get(f"{A}/jobs/{jid}/progress", headers=AUTH))
    assert progress["records"] == []


def test_the_store_refuses_an_integer_past_int64_and_writes_nothing(tmp_path):
    store = Store(tmp_path / "s.sqlite3")
    try:
        row = {"job_id": "job-1", "state": "RUNNING", "n": [1, {"deep": 2**63}]}
        with pytest.raises(StoreWriteError, match=r"\$\.n\[1\]\.deep is an integer outside"):
            store.insert_job(1, row)
        assert store.load_jobs() == []
        with pytest.raises(StoreWriteError, match="step is outside int64"):
            store.put_progress("job-1", 2**63, {"step": 1})
        store.insert_job(1, {**row, "n": [1, {"deep": 2**63 - 1}]})
        assert store.load_jobs()[0]["n"][1]["deep"] == 2**63 - 1
    finally:
        store.close()


def test_max_steps_is_the_training_configs_bound():
    from swarm_core.config.schemas import TrainingConfig
    from swarm_core.schema import SchemaError

    assert structure({"steps": MAX_STEPS}, TrainingConfig).steps == MAX_STEPS
    with pytest.raises(SchemaError, match="steps"):
        structure({"steps": MAX_STEPS + 1}, TrainingConfig)
