"""Per-step progress records of a train job, assembled from every stage's reports."""

from __future__ import annotations

from typing import Any

import pytest

from swarm_core.leader.routes import SESSION_HEADER
from tests.conftest import AUTH

A = "/api/v1"
MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}


@pytest.fixture
async def running(api):
    fellows = []
    for i in range(2):
        body = {"name": f"f{i}", "instance_id": f"i{i}", "data_addr": f"127.0.0.1:{9000 + i}"}
        reg = await (await api.post(f"{A}/fellows/register", json=body, headers=AUTH)).json()
        fellows.append({**reg, "headers": {**AUTH, SESSION_HEADER: reg["session"]}})
    job = await (await api.post(f"{A}/jobs", json={
        "kind": "train", "model": MODEL, "training": {"steps": 3},
        "topology": {"fellows": 2}}, headers=AUTH)).json()
    by_stage = {s["stage"]: next(f for f in fellows if f["fellow_id"] == s["fellow_id"])
                for s in job["placement"]["stages"]}
    return job, by_stage


async def _report(api, job, fellow, step, **kw: Any) -> None:
    body = {"fellow_id": fellow["fellow_id"], "state": "RUNNING", "step": step, **kw}
    resp = await api.post(f"{A}/jobs/{job['job_id']}/status", json=body,
                          headers=fellow["headers"])
    assert resp.status == 200, await resp.text()


async def test_records_join_stages_even_out_of_order(api, running):
    job, stage = running
    await _report(api, job, stage[0], 1, metrics={"wire_tx_bytes": 100, "step_seconds": 0.1})
    await _report(api, job, stage[0], 2, metrics={"wire_tx_bytes": 100, "step_seconds": 0.1})
    # The last stage's report for step 1 arrives after stage 0 moved on: still joined.
    await _report(api, job, stage[1], 1, loss=4.0, tokens_per_s=900.0,
                  metrics={"wire_tx_bytes": 50, "step_seconds": 0.2, "lr": 0.001})
    await _report(api, job, stage[1], 2, loss=3.5, tokens_per_s=950.0,
                  metrics={"wire_tx_bytes": 50, "step_seconds": 0.2, "lr": 0.002})
    await _report(api, job, stage[1], 2, metrics={"eval_loss": 3.6})
    # A repeated report from the same stage does not double the bytes.
    await _report(api, job, stage[0], 2, metrics={"wire_tx_bytes": 100})
    resp = await api.get(f"{A}/jobs/{job['job_id']}/progress", headers=AUTH)
    records = (await resp.json())["records"]
    assert [(r["step"], r["loss"], r["wire_bytes"], r["tokens_per_s"]) for r in records] == \
        [(1, 4.0, 150, 900.0), (2, 3.5, 150, 950.0)]
    assert records[1]["eval_loss"] == 3.6 and records[1]["lr"] == 0.002
    after = await api.get(f"{A}/jobs/{job['job_id']}/progress", params={"after": "1"},
                          headers=AUTH)
    assert [r["step"] for r in (await after.json())["records"]] == [2]
    one = await (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert one["loss_history"] == [[1, 4.0], [2, 3.5]]
    listed = await (await api.get(f"{A}/jobs", headers=AUTH)).json()
    assert listed["jobs"][0]["loss_history"] == []  # the list stays small


async def test_a_stage_catching_up_joins_the_stored_records(api, running):
    """After a leader restart both stages flush the reports they held; one may run far ahead
    of the other (beyond the steps the leader keeps in memory). The late stage's reports must
    join each step's record, not replace it (losing the loss)."""
    job, stage = running
    steps = range(1, 21)
    for s in steps:
        await _report(api, job, stage[1], s, loss=5.0 - s / 10, tokens_per_s=900.0,
                      metrics={"wire_tx_bytes": 50})
    for s in steps:
        await _report(api, job, stage[0], s, metrics={"wire_tx_bytes": 100})
    resp = await api.get(f"{A}/jobs/{job['job_id']}/progress", headers=AUTH)
    records = (await resp.json())["records"]
    assert [(r["step"], r.get("loss"), r["wire_bytes"]) for r in records] == \
        [(s, 5.0 - s / 10, 150) for s in steps]


async def test_progress_errors(api, running):
    job, _ = running
    assert (await api.get(f"{A}/jobs/job-424242/progress", headers=AUTH)).status == 404
    bad = await api.get(f"{A}/jobs/{job['job_id']}/progress", params={"after": "x"},
                        headers=AUTH)
    assert bad.status == 400 and (await bad.json())["error"]["field"] == "after"
    assert (await api.get(f"{A}/jobs/{job['job_id']}/progress")).status == 401
