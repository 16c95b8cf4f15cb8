"""The leader places a swarm layout job (stages of unequal cells; placement-cells step 4):
``Topology.layout`` and its one-line refusals, the dispatch of one START per cell of the
layout, progress records complete on the layout's cells, and the job's figures from its last
stage's cells."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from swarm_core.artifacts.manifests import ReplicaStateManifest
from swarm_core.contract import StageStart
from swarm_core.contract.job import JobSubmit, Topology
from swarm_core.contract.placement import layout_cells
from swarm_core.leader.errors import ApiError
from swarm_core.leader.keys import STATE_KEY
from swarm_core.leader.routes import _manifest_replica
from swarm_core.schema import SchemaError, structure, unstructure
from tests.api_support import (
    A,
    expect_error,
    expect_ok,
    get_job,
    heartbeat,
    poll,
    register,
    report,
    wait_for,
)
from tests.support import AUTH

MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8}


def _topology(**kw: Any) -> Topology:
    return structure({"wiring": "swarm", **kw}, Topology)


# --- Topology.layout --------------------------------------------------------------------------


def test_a_layout_topology_counts_its_cells_and_keeps_its_layout():
    one = _topology(layout=[[0], [1, 0]])  # (S=2, R=1: stage 1 has two cells)
    assert (one.num_stages, one.replicas, one.cells, one.num_fellows, one.width) == (2, 1, 3, 3, 2)
    assert one.layout == [[0], [0, 1]]
    two = _topology(replicas=2, layout=[[0, 1], [0, 1, 2]], route_weights=[[1, 1, 1], [1, 2, 3]])
    assert (two.num_stages, two.cells, two.num_fellows, two.width) == (2, 5, 5, 3)
    assert _topology(stages=2, fellows=3, layout=[[0], [0, 1]]).num_fellows == 3
    slots = _topology(replicas=2, slots_per_fellow=5, layout=[[0, 1], [0, 1, 2]])
    assert slots.num_fellows == 1
    d = unstructure(one)
    assert d["layout"] == [[0], [0, 1]] and structure(d, Topology) == one


def test_a_uniform_layout_is_the_grid_and_its_json_unchanged():
    grid = _topology(stages=2, replicas=2)
    same = _topology(stages=2, replicas=2, layout=[[1, 0], [0, 1]])
    assert same.layout is None and same == grid
    assert unstructure(same) == unstructure(grid) and "layout" not in unstructure(grid)
    assert unstructure(structure({}, Topology)) == {
        "fellows": 1, "slots_per_fellow": 1, "stages": 1, "replicas": 1, "wiring": "chain",
        "route_weights": None, "routing": "given"}
    # (a chain-wired grid may spell its uniform layout out too)
    assert structure({"stages": 2, "layout": [[0], [0]]}, Topology).layout is None


@pytest.mark.parametrize(("body", "field", "why"), [
    ({"layout": [[1], [0, 1]]}, "$.layout", "stage 0 has no cell 0"),
    ({"layout": [[0], [0, 0]]}, "$.layout", r"stage 1's ids \[0, 0\] repeat"),
    ({"layout": [[0], [0], []]}, "$.layout", "stage 2 has no cells"),
    ({"layout": [[0], [-1, 0]]}, "$.layout", "ids must be 0 to 255"),
    ({"layout": []}, "$.layout", "must list 1 to 1024 stages' ids"),
    ({"stages": 3, "layout": [[0], [0, 1]]}, "$.layout", "2 stages listed for a 3-stage job"),
    ({"layout": [[0], [0, 1]], "wiring": "chain"}, "$.layout",
     "stages of unequal cells need wiring swarm"),
    ({"layout": [[0], [0, 1]], "route_weights": [[1], [1]]}, "$.route_weights",
     r"must be 2 lists \(stages\) of 2 weights \(by cell id\)"),
    ({"replicas": 2, "layout": [[0, 1], [0, 1, 2]], "route_weights": [[1, 1], [1, 1]]},
     "$.route_weights", r"of 3 weights \(by cell id\)"),
    ({"fellows": 2, "layout": [[0], [0, 1]]}, "$.fellows",
     r"2 fellow\(s\) x 1 slot\(s\) is not 2 stage\(s\) of cells 1\+2$"),
    ({"slots_per_fellow": 2, "layout": [[0], [0, 1]]}, "$.slots_per_fellow",
     r"2 stage\(s\) of cells 1\+2 do not fill fellows of 2 slot\(s\)"),
])
def test_a_bad_layout_is_refused_in_one_line(body, field, why):
    with pytest.raises(SchemaError, match=why) as err:
        structure({"wiring": "swarm", **body}, Topology)
    assert err.value.field == field and "\n" not in str(err.value)


def test_a_layout_job_needs_sync_mode_dp():
    body = {"kind": "train", "topology": {"wiring": "swarm", "layout": [[0], [0, 1]]},
            "training": {"sync": {"mode": "diloco"}}}
    with pytest.raises(SchemaError, match="need sync mode dp, not diloco") as err:
        structure(body, JobSubmit)
    assert err.value.field == "$.topology" and "\n" not in str(err.value)
    body["training"] = {}
    assert structure(body, JobSubmit).topology.layout == [[0], [0, 1]]


# --- the leader places it ---------------------------------------------------------------------


async def _layout_job(api: TestClient, port: int, layout: list[list[int]], replicas: int,
                      **training: Any) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    cells = sum(len(ids) for ids in layout)
    fellows = [await register(api, f"f{i}", data_addr=f"127.0.0.1:{port + i}")
               for i in range(cells)]
    body = {"name": "lay", "kind": "train", "model": MODEL,
            "training": {"steps": 50, "batch_size": 4, "micro_batches": 2, **training},
            "topology": {"replicas": replicas, "wiring": "swarm", "layout": layout}}
    jid = (await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201))["job_id"]
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING", job["reason"]
    return jid, job, fellows


@pytest.mark.parametrize(("layout", "replicas"), [([[0], [0, 1]], 1),
                                                   ([[0, 1], [0, 1, 2]], 2)])
async def test_the_leader_sends_one_start_per_cell_of_the_layout(api, layout, replicas):
    jid, job, fellows = await _layout_job(api, 7900, layout, replicas)
    assert job["topology"]["layout"] == layout
    placement = job["placement"]
    assert placement["layout"] == layout and placement["replicas"] == replicas
    order = layout_cells(tuple(tuple(ids) for ids in layout))
    assert [(c["stage"], c["replica"]) for c in placement["stages"]] == order
    starts = []
    for reg in fellows:
        [sig] = [s for s in await poll(api, reg) if s["kind"] == "START"]
        starts.append(structure(sig["payload"], StageStart))
    by_fellow = {s.mine.fellow_id: s for s in starts}
    # (one fellow a cell, in the placement's order: cell i on the i-th fellow registered)
    assert [(by_fellow[f["fellow_id"]].stage, by_fellow[f["fellow_id"]].replica)
            for f in fellows] == order
    for s in starts:
        assert s.placement.layout == tuple(tuple(ids) for ids in layout)
        assert s.wiring == "swarm" and s.replicas == replicas and s.num_stages == 2
        assert s.job_id == jid and s.key == starts[0].key


async def test_a_layout_jobs_steps_and_figures_come_from_its_cells(api):
    """S=2, R=1, [[0], [0, 1]]: a step's record is whole once its three cells reported; the
    loss is the last stage's cells' (weighted by the micro-batches each ran), the job's
    tokens/s their sum; the job completes once every cell has."""
    jid, _job, fellows = await _layout_job(api, 7950, [[0], [0, 1]], 1)
    cell = {(0, 0): fellows[0], (1, 0): fellows[1], (1, 1): fellows[2]}

    async def step(stage: int, rid: int, n: int, state: str = "RUNNING", **kw: Any) -> None:
        resp = await report(api, jid, cell[(stage, rid)], state, step=n, stage=stage,
                            replica=rid, **kw)
        assert resp.status == 200, await resp.text()

    async def record(n: int) -> dict[str, Any]:
        rows = (await expect_ok(await api.get(f"{A}/jobs/{jid}/progress", headers=AUTH)))
        return next(r for r in rows["records"] if r["step"] == n)

    await step(0, 0, 1, metrics={"wire_tx_bytes": 100, "step_seconds": 0.1,
                                 "micro_batches": 2})
    await step(1, 0, 1, loss=3.0, tokens_per_s=10.0,
               metrics={"wire_tx_bytes": 10, "step_seconds": 0.1, "micro_batches": 1})
    rec = await record(1)
    assert sorted(rec["stages_reported"]) == [0, 1]  # (cell 1.1 still to come)
    assert rec["loss"] == 3.0
    await step(1, 1, 1, loss=6.0, tokens_per_s=30.0,
               metrics={"wire_tx_bytes": 20, "step_seconds": 0.1, "micro_batches": 3})
    rec = await record(1)
    assert sorted(rec["stages_reported"]) == [0, 1, 2]
    assert rec["wire_bytes"] == 130
    assert rec["loss"] == pytest.approx((3.0 * 1 + 6.0 * 3) / 4)
    assert rec["replica_losses"] == {"0": 3.0, "1": 6.0}
    assert rec["tokens_per_s"] == 40.0
    assert set(rec["micro_batches"]) == {"0.0", "1.0", "1.1"}
    job = await get_job(api, jid)
    assert job["last_loss"] == pytest.approx(5.25)
    assert set(job["metrics"]["stages"]) == {"0.0", "1.0", "1.1"}
    assert job["metrics"]["tokens_per_s"] == 40.0  # (the last stage's two cells, summed)
    for (stage, rid), reg in cell.items():
        assert job["fellows"].count(reg["fellow_id"]) == 1
        await step(stage, rid, 50, "COMPLETED", loss=2.0 + rid if stage else None)
    job = await get_job(api, jid)
    assert job["state"] == "COMPLETED", job["reason"]
    assert job["reason"] == "all 2 stages, cells 1+2 finished at step 50"


async def test_a_layout_jobs_lost_cell_leaves_alone(api):
    """[[0, 1], [0, 1, 2]] on two shares: cell 1.2 fails (its id lives at stage 1 only).
    The survivors report the step they had not applied; once all four have, each is told
    to train step 3 again under the layout without it (here the grid: the job's cells are
    the grid's again), the cell's fellow is freed, the placement and the membership record
    say so, and a late report of the cell that left is refused."""
    jid, _job, fellows = await _layout_job(api, 7970, [[0, 1], [0, 1, 2]], 2)
    cells = {(0, 0): fellows[0], (1, 0): fellows[1], (0, 1): fellows[2], (1, 1): fellows[3]}
    resp = await report(api, jid, fellows[4], "FAILED", step=3, stage=1, replica=2,
                        blames_stage=0, message="LinkClosed: link to stage 0 closed")
    assert resp.status == 200, await resp.text()
    answers = []
    for (stage, rid), reg in cells.items():
        body = {"fellow_id": reg["fellow_id"], "stage": stage, "replica": rid,
                "op_step": 3 if stage else 4, "routed": True}
        answers.append(await expect_ok(await api.post(f"{A}/jobs/{jid}/regroup", json=body,
                                                      headers=reg["headers"])))
    assert [a["order"] for a in answers[:3]] == [None] * 3  # (until the last one asked)
    order = answers[3]["order"]
    assert (order["redo_step"], order["layout"], order["members"], order["epoch"]) == \
        (3, [[0, 1], [0, 1]], [0, 1], 1)
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING", job["reason"]
    [change] = job["membership"]
    assert (change["cells_left"], change["left"], change["step"]) == ([[1, 2]], [], 4)
    assert f"fellow {fellows[4]['fellow_id']}" in change["reason"]
    assert job["placement"].get("layout") is None and len(job["placement"]["stages"]) == 4
    assert job["fellows"] == [f["fellow_id"] for f in fellows[:4]]
    resp = await report(api, jid, fellows[4], "RUNNING", step=4, stage=1, replica=2)
    assert resp.status == 409


async def test_a_layout_jobs_lost_cell_0_fails_it_whole(api):
    """Cell 0 of a stage evaluates and checkpoints for it: lost under a layout (no grid to
    drop whole replicas from), the job fails as a chain's does (resume_policy fail) at
    once, the leader standing; a regroup asked for after is refused in one line."""
    jid, _job, fellows = await _layout_job(api, 7980, [[0, 1], [0, 1, 2]], 2)
    resp = await report(api, jid, fellows[1], "FAILED", step=3, stage=1, replica=0,
                        message="boom")
    assert resp.status == 200, await resp.text()
    job = await get_job(api, jid)
    assert job["state"] == "FAILED" and "no replica left" in job["reason"]
    body = {"fellow_id": fellows[0]["fellow_id"], "stage": 0, "replica": 0, "op_step": 3,
            "routed": True}
    err = await expect_error(await api.post(f"{A}/jobs/{jid}/regroup", json=body,
                                            headers=fellows[0]["headers"]), 409,
                             "job_not_running")
    assert "\n" not in err["message"]


async def test_a_layout_manifest_may_name_any_id_of_the_layout(api):
    """The push route's manifest check is by the layout's ids (its width), not the shares:
    cell 1.1 of [[0], [0, 1]] (one share) may push; id 2 is no id of the job."""
    jid, _job, fellows = await _layout_job(api, 7990, [[0], [0, 1]], 1)
    job = api.app[STATE_KEY].jobs.get(jid)
    assert job.spec.topology.width == 2 and job.placement.width == 2

    def manifest(replica: int) -> ReplicaStateManifest:
        return ReplicaStateManifest(job_id=jid, stage=1, fellow_id=fellows[2]["fellow_id"],
                                    replica=replica, step=5, optimizer_sha256="0" * 64)

    assert _manifest_replica(job, manifest(1)) == 1
    with pytest.raises(ApiError, match="from 0 to 1"):
        _manifest_replica(job, manifest(2))


async def test_a_layout_job_recovers_whole_on_its_layout(api):
    """Under resume_policy replace, a lost cell 0 of a layout job recovers the job as a
    chain's does: every cell STARTed again (attempt 1) on the same layout."""
    jid, _job, fellows = await _layout_job(api, 8010, [[0], [0, 1]], 1,
                                           resume_policy="replace")
    resp = await report(api, jid, fellows[1], "FAILED", step=3, stage=1, replica=0,
                        message="boom")
    assert resp.status == 200, await resp.text()
    assert (await get_job(api, jid))["reason"].startswith("recovering: ")
    for reg in fellows:  # (each says it stopped: the recovery need not wait them out)
        await heartbeat(api, reg, status="ready")

    async def resumed() -> dict[str, Any] | None:
        job = await get_job(api, jid)
        return job if job["attempt"] == 1 else None

    job = await wait_for(resumed, timeout=5.0)
    assert job["state"] == "RUNNING" and job["placement"]["layout"] == [[0], [0, 1]]
    starts = [structure(s["payload"], StageStart) for reg in fellows
              for s in await poll(api, reg) if s["kind"] == "START"]
    again = sorted((s.stage, s.replica) for s in starts if s.attempt == 1)
    assert again == [(0, 0), (1, 0), (1, 1)]


async def test_a_cell_beyond_the_shares_is_started_again_when_its_fellow_lacks_it(api):
    """The reconciler re-sends a START its fellow never took: also for cell 1.1 of a
    one-share layout, whose id is past the job's replicas (no replica 'left' the job)."""
    jid, _job, fellows = await _layout_job(api, 8030, [[0], [0, 1]], 1)
    reg = fellows[2]
    [first] = [s for s in await poll(api, reg) if s["kind"] == "START"]
    assert (first["payload"]["stage"], first["payload"]["replica"]) == (1, 1)
    await heartbeat(api, reg, status="busy", signal_seq=first["seq"], current_job=jid,
                    running=[])
    [again] = [s for s in await poll(api, reg, after=first["seq"]) if s["kind"] == "START"]
    assert (again["payload"]["stage"], again["payload"]["replica"]) == (1, 1)
    assert again["payload"]["key"] == first["payload"]["key"]


# --- a swarm grid's lost cells, one by one (the cell-wise rule beside whole replicas) -----------


async def _swarm_grid(api: TestClient, port: int) -> tuple[str, dict[tuple[int, int], Any]]:
    """A 2 x 3 swarm-wired job, one fellow a cell."""
    fellows = [await register(api, f"g{i}", data_addr=f"127.0.0.1:{port + i}")
               for i in range(6)]
    body = {"name": "grid", "kind": "train", "model": MODEL,
            "training": {"steps": 50, "batch_size": 6, "micro_batches": 2},
            "topology": {"stages": 2, "replicas": 3, "wiring": "swarm"}}
    jid = (await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201))["job_id"]
    job = await get_job(api, jid)
    by_id = {f["fellow_id"]: f for f in fellows}
    return jid, {(c["stage"], c["replica"]): by_id[c["fellow_id"]]
                 for c in job["placement"]["stages"]}


async def _ask(api: TestClient, jid: str, cell: dict[tuple[int, int], Any], stage: int,
               replica: int, op_step: int, epoch: int = 0, **extra: Any) -> dict[str, Any]:
    body = {"fellow_id": cell[(stage, replica)]["fellow_id"], "stage": stage,
            "replica": replica, "op_step": op_step, "routed": True, "epoch": epoch, **extra}
    return (await expect_ok(await api.post(f"{A}/jobs/{jid}/regroup", json=body,
                                           headers=cell[(stage, replica)]["headers"])))["order"]


async def test_after_a_lost_cell_0_took_its_replica_the_next_loss_drops_a_replica_too(api):
    """Cell 1.0 is lost: its replica leaves every stage (a stage's cell 0 evaluates and
    checkpoints). Then cell 1.2 is lost: the grid keeps replica 0's cells, done, so the rule
    of whole replicas decides again (replica 2 leaves) rather than failing the job."""
    jid, cell = await _swarm_grid(api, 8100)
    resp = await report(api, jid, cell[(1, 0)], "FAILED", step=3, stage=1, replica=0,
                        message="boom")
    assert resp.status == 200, await resp.text()
    orders = [await _ask(api, jid, cell, k, r, 3) for r in (1, 2) for k in (0, 1)]
    assert orders[-1] is not None and orders[-1]["members"] == [1, 2]
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING" and job["members"] == [1, 2]
    resp = await report(api, jid, cell[(1, 2)], "FAILED", step=5, stage=1, replica=2,
                        message="boom again")
    assert resp.status == 200, await resp.text()
    orders = [await _ask(api, jid, cell, k, 1, 5, epoch=1) for k in (0, 1)]
    assert orders[-1] is not None and orders[-1]["members"] == [1]
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING", job["reason"]
    assert [(c["left"], c.get("cells_left", [])) for c in job["membership"]] == \
        [([0], []), ([2], [])]


async def test_a_silent_cell_of_the_lost_ones_id_whose_fellow_beats_is_waited_for(api):
    """Cell 1.2 fails; four survivors report its id as having closed their links. Cell 0.2,
    alive, is slow to report: a heartbeat later its fellow has beaten and runs it, so it is
    waited for, not taken for the dead one (a report names an id, not a stage); once it
    reports, only cell 1.2 leaves."""
    jid, cell = await _swarm_grid(api, 8120)
    state = api.app[STATE_KEY]
    resp = await report(api, jid, cell[(1, 2)], "FAILED", step=3, stage=1, replica=2,
                        message="boom")
    assert resp.status == 200, await resp.text()
    job = await get_job(api, jid)
    await heartbeat(api, cell[(0, 2)], status="busy", running=[
        {"job_id": jid, "stage": 0, "replica": 2, "attempt": job["attempt"]}])
    for k, r in ((0, 0), (1, 0), (0, 1), (1, 1)):
        assert await _ask(api, jid, cell, k, r, 3, closed_by=2) is None
    record = state.jobs.get(jid)
    state.jobs.membership.rounds[jid].since -= state.registry.heartbeat_interval_s + 0.1
    state.jobs.membership.check(record)
    assert (await get_job(api, jid))["membership"] == []  # (0.2 still awaited)
    order = await _ask(api, jid, cell, 0, 2, 4)
    assert order is not None and order["layout"] == [[0, 1, 2], [0, 1]]
    [change] = (await get_job(api, jid))["membership"]
    assert change["cells_left"] == [[1, 2]]
    # (its fellow was freed and told to stop what it may still run)
    signals = await poll(api, cell[(1, 2)])
    assert any(s["kind"] == "STOP" and s["payload"].get("reason") == "its cell left the job"
               for s in signals), signals


async def test_a_late_report_from_before_a_cell_left_is_indexed_as_its_step_was(api):
    """Step 3 is reported by four cells; cell 1.1 is lost and leaves (the cells after it in
    the placement move up one); then cell 1.2's late report of step 3 comes, trained under
    the placement it had: it joins step 3's record as the sixth cell (not as the fifth, which
    0.2 reported), its loss in the step's."""
    jid, cell = await _swarm_grid(api, 8140)
    metrics = {"wire_tx_bytes": 10, "step_seconds": 0.1, "micro_batches": 2}

    async def step3(k: int, r: int, **kw: Any) -> None:
        resp = await report(api, jid, cell[(k, r)], "RUNNING", step=3, stage=k, replica=r,
                            epoch=0, metrics=metrics, **kw)
        assert resp.status == 200, await resp.text()

    for k, r in ((0, 0), (0, 1), (0, 2)):
        await step3(k, r)
    await step3(1, 0, loss=2.0)
    resp = await report(api, jid, cell[(1, 1)], "FAILED", step=3, stage=1, replica=1,
                        message="boom")
    assert resp.status == 200, await resp.text()
    for k, r in ((0, 0), (1, 0), (0, 1), (0, 2), (1, 2)):
        await _ask(api, jid, cell, k, r, 3)
    assert (await get_job(api, jid))["membership"][0]["cells_left"] == [[1, 1]]
    await step3(1, 2, loss=4.0)
    rows = await expect_ok(await api.get(f"{A}/jobs/{jid}/progress", headers=AUTH))
    rec = next(r for r in rows["records"] if r["step"] == 3)
    assert sorted(rec["stages_reported"]) == [0, 1, 2, 4, 5]
    assert rec["replica_losses"] == {"0": 2.0, "2": 4.0}
    assert rec["loss"] == pytest.approx(3.0)


async def test_a_cell_wise_order_outlives_a_leader_restart(aiohttp_client, leader_config):
    """The leader decides a cell-wise round as the last survivor reports, and restarts
    before the other three fetch their orders (they asked first and were told to wait):
    asking again under the membership before, each is answered from the job's record, the
    order the last one got (before, a 409 "membership 0 is over", and the survivor's
    failure started another round)."""
    from swarm_core.leader import create_app

    api = await aiohttp_client(create_app(leader_config))
    jid, _job, fellows = await _layout_job(api, 7990, [[0, 1], [0, 1, 2]], 2)
    cells = {(0, 0): fellows[0], (1, 0): fellows[1], (0, 1): fellows[2], (1, 1): fellows[3]}
    await expect_ok(await report(api, jid, fellows[4], "FAILED", step=3, stage=1, replica=2,
                                 message="LinkClosed: link to stage 0 closed"))

    def ask(stage: int, rid: int, reg: dict[str, Any]) -> dict[str, Any]:
        return {"fellow_id": reg["fellow_id"], "stage": stage, "replica": rid,
                "op_step": 3 if stage else 4, "routed": True}

    got = [await expect_ok(await api.post(f"{A}/jobs/{jid}/regroup", json=ask(*c, reg),
                                          headers=reg["headers"]))
           for c, reg in cells.items()]
    assert [g["order"] for g in got[:3]] == [None] * 3
    order = got[3]["order"]
    assert order is not None and order["epoch"] == 1
    await api.close()
    api = await aiohttp_client(create_app(leader_config))
    for (stage, rid), reg in list(cells.items())[:3]:
        again = await register(api, **reg["body"])
        assert again["fellow_id"] == reg["fellow_id"]
        answer = await expect_ok(await api.post(f"{A}/jobs/{jid}/regroup",
                                                json=ask(stage, rid, again),
                                                headers=again["headers"]))
        assert answer["order"] == order, (stage, rid)
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING" and len(job["membership"]) == 1


def test_a_recorded_cell_wise_order_is_only_the_current_memberships():
    """The order rebuilt from the record answers an ask under the membership just before the
    job's latest change, and only while that change is the job's current membership: after
    a recovery (the job's epochs start again at 0, the old change kept on record) a fresh
    round's ask under epoch 0 is not answered with the old attempt's order; nor is a cell
    the placement no longer holds, nor a job that is not running."""
    from types import SimpleNamespace

    from swarm_core.contract.membership import MembershipChange, RegroupReport
    from swarm_core.contract.placement import FellowSlots, plan
    from swarm_core.leader.membership import _recorded_cellwise
    from swarm_core.leader.records import JobState

    placed = plan([FellowSlots(i, f"f{i}", ["cpu"], f"127.0.0.1:{9000 + i}") for i in range(5)],
                  2, 2, replicas=2, layout=[[0, 1], [0, 1, 2]]).without([(1, 2)])
    change = MembershipChange(step=41, epoch=1, members=[0, 1], cells_left=[[1, 2]])
    job = SimpleNamespace(state=JobState.RUNNING, recovering=None, membership=[change],
                          placement=placed, epoch=1)
    ask = RegroupReport(fellow_id=0, stage=0, replica=1, epoch=0, op_step=40)
    order = _recorded_cellwise(job, ask)  # type: ignore[arg-type]
    assert order is not None and (order.epoch, order.members, order.redo_step, order.layout) \
        == (1, [0, 1], 40, [[0, 1], [0, 1]])
    job.epoch = 0  # (recovered: a new attempt's epochs)
    assert _recorded_cellwise(job, ask) is None  # type: ignore[arg-type]
    job.epoch = 1
    gone = RegroupReport(fellow_id=4, stage=1, replica=2, epoch=0, op_step=40)
    assert _recorded_cellwise(job, gone) is None  # type: ignore[arg-type]
    job.state = JobState.FAILED
    assert _recorded_cellwise(job, ask) is None  # type: ignore[arg-type]
