"""Per-step progress records of a train job, assembled from every stage's reports."""

from __future__ import annotations

import math
from typing import Any

import pytest

from swarm_core.contract import (
    JobInfo,
    LinkChange,
    ProgressRecord,
    Restart,
    Topology,
)
from swarm_core.protocol import SESSION_HEADER
from swarm_core.schema import structure
from tests.support import AUTH

A = "/api/v1"


def _job_info(state: str, **kw: Any) -> JobInfo:
    """A finished two-stage job as the client reads it."""
    return JobInfo(job_id="job-000001", name="r", kind="train", state=state, created_at=0.0,
                   started_at=None, finished_at=None, last_step=1, last_loss=3.0,
                   fellows=[0, 1], topology=Topology(2), reason="", **kw)
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
    assert records[1]["perplexity"] == pytest.approx(math.exp(3.6))
    assert "perplexity" not in records[0]
    after = await api.get(f"{A}/jobs/{job['job_id']}/progress", params={"after": "1"},
                          headers=AUTH)
    assert [r["step"] for r in (await after.json())["records"]] == [2]
    one = await (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert one["loss_history"] == [[1, 4.0], [2, 3.5]]
    assert one["eval_history"] == [[2, 3.6]]  # (the watch view marks it on the curve)
    listed = await (await api.get(f"{A}/jobs", headers=AUTH)).json()
    assert listed["jobs"][0]["loss_history"] == []  # the list stays small
    assert listed["jobs"][0]["eval_history"] == []


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


async def test_a_slowed_cells_steps_say_so_in_the_record(api, running):
    """A stage's step figures carry its emulated slowdown; the step's record keeps the factor
    by cell, for the slowed cell only."""
    job, stage = running
    await _report(api, job, stage[0], 1, metrics={"wire_tx_bytes": 100, "step_seconds": 0.4,
                                                  "slowdown": 4.0})
    await _report(api, job, stage[1], 1, loss=4.0,
                  metrics={"wire_tx_bytes": 50, "step_seconds": 0.1})
    resp = await api.get(f"{A}/jobs/{job['job_id']}/progress", headers=AUTH)
    [rec] = (await resp.json())["records"]
    assert rec["slowdown"] == {"0": 4.0}


async def test_progress_errors(api, running):
    job, _ = running
    assert (await api.get(f"{A}/jobs/job-424242/progress", headers=AUTH)).status == 404
    bad = await api.get(f"{A}/jobs/{job['job_id']}/progress", params={"after": "x"},
                        headers=AUTH)
    assert bad.status == 400 and (await bad.json())["error"]["field"] == "after"
    assert (await api.get(f"{A}/jobs/{job['job_id']}/progress")).status == 401


async def test_records_keep_each_stages_link_wait_and_codec_error(api, running):
    job, stage = running
    await _report(api, job, stage[0], 1, metrics={
        "wire_tx_bytes": 100, "step_seconds": 0.3, "wait_seconds": 0.1,
        "codec_error": {"act": 0.006}})
    # A figure that is not a number is refused by name (the contract's types), and the step's
    # record is as it was.
    for bad, field in (({"wait_seconds": "slow"}, "$.metrics.wait_seconds"),
                       ({"codec_error": {"grad": 0.005, "other": 1.0}}, "$.metrics.codec_error")):
        resp = await api.post(f"{A}/jobs/{job['job_id']}/status", headers=stage[1]["headers"],
                              json={"fellow_id": stage[1]["fellow_id"], "state": "RUNNING",
                                    "step": 1, "metrics": {"wire_tx_bytes": 50, **bad}})
        assert resp.status == 400 and (await resp.json())["error"]["field"] == field
    (rec,) = (await (await api.get(f"{A}/jobs/{job['job_id']}/progress",
                                   headers=AUTH)).json())["records"]
    assert rec["stages_reported"] == [0] and rec["wire_bytes"] == 100
    # A direction with no figure (null: a diverged step's NaN) is left out.
    await _report(api, job, stage[1], 1, loss=4.0, metrics={
        "wire_tx_bytes": 50, "step_seconds": 0.25,
        "codec_error": {"grad": 0.005, "act": None}})
    resp = await api.get(f"{A}/jobs/{job['job_id']}/progress", headers=AUTH)
    (rec,) = (await resp.json())["records"]
    # Each stage's own step time beside its wait; what is not a number is left out.
    assert rec["wait_seconds"] == {"0": 0.1}
    assert rec["stage_seconds"] == {"0": 0.3, "1": 0.25} and rec["step_seconds"] == 0.25
    assert rec["codec_error"] == {"0": {"act": 0.006}, "1": {"grad": 0.005}}


def test_the_runs_link_wait_leaves_out_steps_that_follow_a_pause():
    """Steps after the start, a resume, an eval or a shard push also wait for the neighbours'
    own pause: the share is taken over the other steps, each stage by its own step time."""
    from swarm_core.config.schemas import TrainingConfig
    from swarm_core.experiments.runner import wait_by_stage

    tc = TrainingConfig(steps=9, eval_every=3, shard_push_interval_steps=4)
    # The start; evals after 3 and 6; pushes after 4 and 8; a resume from 6.
    paused = {1, 4, 5, 7, 9}
    assert {s for s in range(1, 10) if tc.follows_a_pause(s) or tc.follows_a_pause(s, 6)} \
        == paused
    records = [ProgressRecord(step=s, step_seconds=1.0, stage_seconds={"0": 1.0, "1": 2.0},
                              wait_seconds={"0": 0.9 if s in paused else 0.1,
                                            "1": 1.8 if s in paused else 0.5})
               for s in range(1, 10)]
    resumed = [Restart(at_step=8, resume_step=6, reason="")]  # the job's restarts
    assert wait_by_stage(records, 3, tc, resumed) == [pytest.approx(0.1), pytest.approx(0.25),
                                                      None]
    # Without the training config only the start and the resume are known.
    known = [2, 3, 4, 5, 6, 8, 9]
    assert wait_by_stage(records, 2, None, resumed)[0] == pytest.approx(
        sum(0.9 if s in paused else 0.1 for s in known) / len(known))
    assert wait_by_stage([], 2) is None


def test_under_diloco_the_pause_of_a_push_follows_the_outer_step_it_waited_for():
    """With replicas under DiLoCo a shard push waits for the next outer step (H = 3, every 4
    steps: pushes after 6 and 9 of 12, not after 4 and 8), and so does the pause after it."""
    from swarm_core.config.schemas import TrainingConfig
    from swarm_core.schema import structure

    tc = structure({"steps": 12, "shard_push_interval_steps": 4,
                    "sync": {"mode": "diloco", "inner_steps": 3}}, TrainingConfig)
    assert [s for s in range(1, 13) if tc.checkpoint_after(s, outer_steps=True)] == [6, 9]
    assert [s for s in range(1, 13) if tc.checkpoint_after(s)] == [4, 8]
    assert {s for s in range(1, 13) if tc.follows_a_pause(s, outer_steps=True)} == {1, 7, 10}
    assert {s for s in range(1, 13) if tc.follows_a_pause(s)} == {1, 5, 9}


@pytest.mark.parametrize("state, limit, met", [
    ("COMPLETED", 5.0, True), ("COMPLETED", 1.0, False), ("FAILED", 5.0, False),
    ("FAILED", None, None), ("COMPLETED", None, None),
])
def test_thresholds_are_met_only_by_a_completed_run_that_set_them(state, limit, met):
    from types import SimpleNamespace

    from swarm_core.experiments.runner import summarize

    training = {"steps": 2, **({"max_final_loss": limit} if limit else {})}
    st = SimpleNamespace(run_id="r", spec=SimpleNamespace(
        model=MODEL, training=training, fellows=2, compression="none", network={},
        stages=2, replicas=1, sync_mode="none", seed=0, repeat=0, wiring={}, variant=None))
    job = _job_info(state)
    records = [ProgressRecord(step=1, loss=3.0, wire_bytes=10)]
    assert summarize(st, job, records)["thresholds_met"] is met


def test_a_run_whose_link_was_set_mid_run_says_so_in_its_summary_and_report(tmp_path):
    """A set-speed during a run is in its metrics_summary.json (link_changes, from the job's
    record) and in the report's "link set" column, so a run that left its network profile
    part-way is not compared as if it had not."""
    from types import SimpleNamespace

    from swarm_core.experiments.report import HEADERS, RunData, summary_rows
    from swarm_core.experiments.runner import summarize

    st = SimpleNamespace(run_id="r", spec=SimpleNamespace(
        model=MODEL, training={"steps": 2}, fellows=2, compression="none", network={},
        stages=2, replicas=1, sync_mode="none", seed=0, repeat=0, wiring={}, variant=None))
    changes = [{"at_step": s, "fellow_id": 1, "link": {"tx_mbps": 8.0, "rx_mbps": None,
                                                      "latency_ms": 0.0}, "at": 0.0}
               for s in (12, 30, 31, 40)]
    records = [ProgressRecord(step=1, loss=3.0, wire_bytes=10)]
    rows = []
    # (The last: a record that kept 4 of 250 set-speeds; the "+N" counts them all.)
    for link_changes, total in (([], 0), (changes[:2], 2), (changes, 4), (changes, 250)):
        job = _job_info("COMPLETED", link_changes=structure(link_changes, list[LinkChange]),
                        link_changes_total=total)
        summary = summarize(st, job, records)
        assert summary["link_changes"] == link_changes
        assert summary["link_changes_total"] == total
        rows.append(summary_rows([RunData(tmp_path, "r", summary, [], [], [], [])])[0])
    column = HEADERS.index("link set")
    assert [r[column] for r in rows] == ["-", "@12 @30", "@12 … @40 (4 in all)",
                                         "@12 … @40 (250 in all)"]


async def test_an_integer_beyond_int64_is_a_400_that_changes_nothing(api, running):
    """orjson reads integers up to 2**64-1; SQLite holds 2**63-1. A step between the two was
    applied to the job in memory and then failed to store, as a 500."""
    job, stage = running
    await _report(api, job, stage[1], 1, loss=4.0, metrics={"wire_tx_bytes": 50})
    resp = await api.post(f"{A}/jobs/{job['job_id']}/status", headers=stage[1]["headers"],
                          json={"fellow_id": stage[1]["fellow_id"], "state": "RUNNING",
                                "step": 2**63, "loss": 1.0})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["field"] == "$.step" and "2**63-1" in error["message"]
    after = await (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
    assert after["last_step"] == 1 and after["last_loss"] == 4.0


def _step(fellow, step: int, **kw: Any) -> dict[str, Any]:
    return {"fellow_id": fellow["fellow_id"], "state": "RUNNING", "step": step, **kw}


async def _batch(api, job, fellow, updates: list[dict[str, Any]]):
    return await api.post(f"{A}/jobs/{job['job_id']}/statuses", json={"updates": updates},
                          headers=fellow["headers"])


async def _records(api, job) -> list[dict[str, Any]]:
    resp = await api.get(f"{A}/jobs/{job['job_id']}/progress", headers=AUTH)
    return (await resp.json())["records"]


async def test_a_batch_of_step_reports_is_taken_as_each_would_be_alone(api, running):
    """A fellow sends what queued while its last report was in flight as one batch: every
    step is recorded as its report alone would be, in order, an evaluation in it too, and
    the answer is the job as after the last."""
    job, stage = running
    wire = {"wire_tx_bytes": 100, "step_seconds": 0.1}
    resp = await _batch(api, job, stage[0], [_step(stage[0], s, metrics=wire)
                                             for s in (1, 2, 3)])
    assert resp.status == 200, await resp.text()
    last = [_step(stage[1], s, loss=4.0 - s, tokens_per_s=900.0 + s,
                  metrics={"wire_tx_bytes": 50, "step_seconds": 0.2}) for s in (1, 2)]
    resp = await _batch(api, job, stage[1], [*last, _step(stage[1], 2,
                                                          metrics={"eval_loss": 2.5})])
    info = await resp.json()
    assert resp.status == 200 and info["last_step"] == 3 and info["last_loss"] == 2.0
    assert [(r["step"], r.get("loss"), r["wire_bytes"], r.get("tokens_per_s"))
            for r in await _records(api, job)] == [(1, 3.0, 150, 901.0), (2, 2.0, 150, 902.0),
                                                   (3, None, 100, None)]
    assert (await _records(api, job))[1]["eval_loss"] == 2.5


@pytest.mark.parametrize("make, field", [
    (lambda f, g: [], "updates"),
    (lambda f, g: [_step(f, 1), {**_step(f, 2), "state": "COMPLETED"}], "updates[1].state"),
    (lambda f, g: [_step(f, 1), _step(g, 2)], "updates[1].fellow_id"),
    (lambda f, g: [_step(f, s) for s in range(1, 258)], "updates"),
], ids=["empty", "an-end-in-it", "two-fellows", "too-many"])
async def test_a_batch_that_is_not_one_fellows_step_reports_is_refused_whole(api, running,
                                                                             make, field):
    job, stage = running
    updates = [{**u, "metrics": {"wire_tx_bytes": 10}} for u in make(stage[0], stage[1])]
    resp = await _batch(api, job, stage[0], updates)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["field"] == f"$.{field}" and "\n" not in err["message"]
    assert await _records(api, job) == []
    assert (await (await api.get(f"{A}/jobs/{job['job_id']}", headers=AUTH)).json()
            )["last_step"] == 0


async def test_a_batch_with_one_report_the_job_refuses_changes_nothing(api, running):
    """A report of a cell the fellow does not hold, third in a batch: 409, and the two
    before it are not kept either (one change, all or nothing)."""
    job, stage = running
    ok = [_step(stage[0], s, stage=0, metrics={"wire_tx_bytes": 10}) for s in (1, 2)]
    resp = await _batch(api, job, stage[0], [*ok, _step(stage[0], 3, stage=1)])
    assert resp.status == 409
    assert (await resp.json())["error"]["code"] == "not_in_job"
    assert await _records(api, job) == []
