"""The leader learns a peer's move from the cells' step reports (placement-cells steps 5-6):
every cell makes a move in band, so whichever report of the new layout reaches the leader
first (a stayer's or the moved peer's new cell's) tells it; a late report of the old layout
is read against the placement it ran under; a move that does not fit is refused in one line
and changes nothing. And ``topology.moves`` / ``rebalance_every`` and their refusals."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from swarm_core.contract.job import JobSubmit
from swarm_core.contract.rebalance import PeerMove, moves_error
from swarm_core.schema import SchemaError, structure
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
MOVE = {"at": 3, "source": 0, "cell": 1, "target": 1, "new_id": 2}
BEFORE, AFTER = [[0, 1], [0, 1]], [[0], [0, 1, 2]]


def _job(**topology: Any) -> dict[str, Any]:
    return {"kind": "train", "model": MODEL,
            "training": {"steps": 8, "batch_size": 4, "micro_batches": 2},
            "topology": {"stages": 2, "replicas": 2, "wiring": "swarm", **topology}}


async def _placed(api: TestClient, port: int, body: dict[str, Any]
                  ) -> tuple[str, dict[str, Any], dict[tuple[int, int], Any]]:
    """Four fellows, the job ``body`` placed on them: its id, its view, its cells' fellows."""
    fellows = [await register(api, f"f{i}", data_addr=f"127.0.0.1:{port + i}")
               for i in range(4)]
    jid = (await expect_ok(await api.post(f"{A}/jobs", json=body, headers=AUTH), 201))["job_id"]
    job = await get_job(api, jid)
    assert job["state"] == "RUNNING", job["reason"]
    by_id = {f["fellow_id"]: f for f in fellows}
    return jid, job, {(c["stage"], c["replica"]): by_id[c["fellow_id"]]
                      for c in job["placement"]["stages"]}


async def _moving_job(api: TestClient, port: int, **training: Any
                      ) -> tuple[str, dict[tuple[int, int], Any]]:
    """S=2 x R=2 whose stage-0 cell 1 moves to stage 1 as its cell 2 before step 3."""
    body = _job(moves=[{k: v for k, v in MOVE.items() if k != "new_id"}])
    body["training"].update(training)
    jid, _job_view, cells = await _placed(api, port, body)
    return jid, cells


async def _step(api: TestClient, jid: str, reg: Any, stage: int, cell: int, n: int,
                epoch: int, moved: dict[str, int] | None = None, loss: float | None = None,
                micro: int = 1):
    body: dict[str, Any] = {"stage": stage, "replica": cell, "epoch": epoch,
                            "metrics": {"wire_tx_bytes": 10, "micro_batches": micro}}
    if moved is not None:
        body["moved"] = moved
    if loss is not None:
        body["loss"] = loss
    return await report(api, jid, reg, "RUNNING", step=n, **body)


async def _before(api: TestClient, jid: str, cells: dict[tuple[int, int], Any]) -> None:
    for n in (1, 2, 3):
        for (k, r), reg in cells.items():
            resp = await _step(api, jid, reg, k, r, n, 0, loss=2.0 if k else None, micro=2)
            assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("first", ["stayer", "mover"])
async def test_the_first_report_of_a_new_layout_tells_the_leader_the_move(api, first):
    jid, cells = await _moving_job(api, 8100)
    mover = cells[(0, 1)]
    await _before(api, jid, cells)
    new = {(0, 0): cells[(0, 0)], (1, 0): cells[(1, 0)], (1, 1): cells[(1, 1)], (1, 2): mover}
    order = [(1, 2), (0, 0), (1, 0), (1, 1)] if first == "mover" else \
        [(1, 0), (0, 0), (1, 1), (1, 2)]
    for i, (k, r) in enumerate(order):
        resp = await _step(api, jid, new[(k, r)], k, r, 4, 1, MOVE, loss=float(r) if k else None)
        assert resp.status == 200, await resp.text()
        if i == 0:  # (the first that tells it: the placement has moved already)
            job = await get_job(api, jid)
            assert job["placement"]["layout"] == AFTER
    job = await get_job(api, jid)
    [change] = job["membership"]  # (told four times, made once)
    assert change["moved"] == MOVE and change["epoch"] == 1 and change["step"] == 4
    assert change["reason"] == "rebalance" and change["left"] == change["joined"] == []
    moved = next(c for c in job["placement"]["stages"] if (c["stage"], c["replica"]) == (1, 2))
    assert moved["fellow_id"] == mover["fellow_id"]
    rows = (await expect_ok(await api.get(f"{A}/jobs/{jid}/progress", headers=AUTH)))["records"]
    rec = next(r for r in rows if r["step"] == 4)
    assert len(rec["stages_reported"]) == 4  # (the new layout's four cells)
    assert rec["replica_losses"] == {"0": 0.0, "1": 1.0, "2": 2.0}
    assert rec["membership"][0]["moved"] == MOVE
    # A late report of the old layout (the mover's old cell, its step 3 again) is read
    # against the placement it ran under; one of the new cell under the old layout is not.
    late = await _step(api, jid, mover, 0, 1, 3, 0)
    assert late.status == 200, await late.text()
    await expect_error(await _step(api, jid, mover, 1, 2, 3, 0), 409, "not_in_job")


async def test_a_move_that_does_not_fit_is_refused_in_one_line_and_changes_nothing(api):
    jid, cells = await _moving_job(api, 8150)
    await _before(api, jid, cells)
    stayer = cells[(1, 0)]
    for moved, why in [
        ({**MOVE, "cell": 0}, "0.0 -> 1.2 before step 3 is not the job's next given move "
                              "(0.1 -> 1.? before step 3)"),
        ({**MOVE, "new_id": 1}, "is not the job's next given move"),
        ({**MOVE, "at": 5}, "must come after step -1 and at step 4 or before"),
        (None, "without the move it needs"),
    ]:
        err = await expect_error(await _step(api, jid, stayer, 1, 0, 4, 1, moved), 409,
                                 "bad_move")
        assert why in err["message"] and "\n" not in err["message"], err
    err = await expect_error(await _step(api, jid, stayer, 1, 0, 4, 2, MOVE), 409, "bad_move")
    assert "under move 2 of a job that has made 0" in err["message"]
    job = await get_job(api, jid)
    assert "layout" not in job["placement"]  # (the grid it was)
    assert job["membership"] == []
    # Made, the move is the one every later report must name.
    assert (await _step(api, jid, stayer, 1, 0, 4, 1, MOVE)).status == 200
    err = await expect_error(await _step(api, jid, cells[(1, 1)], 1, 1, 4, 1,
                                         {**MOVE, "new_id": 3}), 409, "bad_move")
    assert "is not the one the job made (0.1 -> 1.2 before step 3)" in err["message"]
    # Out of bounds at the door: a 400 naming the field, no search through a huge layout.
    err = await expect_error(await _step(api, jid, stayer, 1, 0, 5, 1,
                                         {**MOVE, "new_id": 3_000_000}), 400)
    assert "new_id" in err.get("field", "") + err["message"], err


async def test_a_rebalanced_jobs_move_must_fit_and_come_at_a_look(api):
    jid, _job_view, cells = await _placed(api, 8300,
                                          _job(routing="measured", rebalance_every=3))
    await _before(api, jid, cells)
    stayer = cells[(1, 0)]
    for moved, why in [({**MOVE, "cell": 0}, "stage 0 has no cell 0"),
                       ({**MOVE, "new_id": 1}, "stage 1 already has a cell 1"),
                       ({**MOVE, "at": 2}, "rebalancing looks every 3 steps")]:
        err = await expect_error(await _step(api, jid, stayer, 1, 0, 4, 1, moved), 409,
                                 "bad_move")
        assert why in err["message"] and "\n" not in err["message"], err
    assert (await _step(api, jid, stayer, 1, 0, 4, 1, MOVE)).status == 200
    assert (await get_job(api, jid))["placement"]["layout"] == AFTER


def test_given_moves_and_rebalancing_are_checked_in_one_line():
    ok = structure(_job(moves=[MOVE]), JobSubmit)
    assert ok.topology.moves == [PeerMove(**MOVE)]
    assert structure(_job(routing="measured", rebalance_every=4), JobSubmit) \
        .topology.rebalance_every == 4
    for topology, field, why in [
        ({"moves": [{**MOVE, "cell": 0}]}, "$.topology.moves", "stage 0 has no cell 0 to move"),
        ({"moves": [{**MOVE, "at": 8}]}, "$.topology.moves", "before 8"),
        ({"moves": [MOVE, MOVE]}, "$.topology.moves", "one a boundary"),
        ({"moves": [{**MOVE, "target": 0}]}, "$.topology.moves", "not two of the job's"),
        ({"rebalance_every": 3}, "$.topology.rebalance_every", "needs routing measured"),
        ({"moves": [MOVE], "route_weights": [[1, 1], [1, 1]]}, "$.topology.route_weights",
         "not taken with moving peers"),
        ({"moves": [MOVE], "wiring": "chain"}, "$.topology.moves", "wiring swarm only"),
    ]:
        with pytest.raises(SchemaError, match=why) as err:
            structure(_job(**topology), JobSubmit)
        assert err.value.field == field and "\n" not in str(err.value), err.value
    assert moves_error([PeerMove(**MOVE), PeerMove(5, 1, 2, 0)], BEFORE, 8) is None
    assert "stage 1 has no cell 3" in moves_error([PeerMove(**MOVE), PeerMove(5, 1, 3, 0)],
                                                  BEFORE, 8)


async def test_a_moved_job_resumes_on_the_cells_it_had_at_its_checkpoint(api):
    """A lost cell of a job whose peer moved: it recovers from its checkpoint on the
    placement in force there. A move made after it is undone (its cells make it again, and
    the new attempt counts its moves from 0); one made before it stays."""
    from swarm_core.leader import moves
    from swarm_core.leader.keys import STATE_KEY

    body = _job(moves=[MOVE])
    body["training"]["resume_policy"] = "replace"
    jid, job, cells = await _placed(api, 8200, body)
    await _before(api, jid, cells)
    resp = await _step(api, jid, cells[(1, 0)], 1, 0, 4, 1, MOVE, loss=1.0)
    assert resp.status == 200, await resp.text()
    record = api.server.app[STATE_KEY].jobs.get(jid)
    # (the move was made before step 3: a checkpoint of step 3 or later keeps it)
    assert moves.rewound(record, 3)[0].layout == ((0,), (0, 1, 2))
    kept, changes = moves.rewound(record, 2)
    assert kept.layout is None and changes == []
    assert kept == structure(job["placement"], type(kept))  # (the grid it was dispatched on)
    resp = await report(api, jid, cells[(1, 1)], "FAILED", step=4, stage=1, replica=1,
                        epoch=1, message="boom")
    assert resp.status == 200, await resp.text()
    for reg in cells.values():
        await heartbeat(api, reg, status="ready")

    async def resumed() -> dict[str, Any] | None:
        job = await get_job(api, jid)
        return job if job["attempt"] == 1 else None

    job = await wait_for(resumed, timeout=5.0)  # (no shard pushed: from step 0)
    assert job["state"] == "RUNNING" and "layout" not in job["placement"]
    assert job["membership"] == []
    # The new attempt's cells make the move again: epoch 1 of attempt 1.
    resp = await report(api, jid, cells[(1, 0)], "RUNNING", step=4, stage=1, replica=0,
                        epoch=1, moved=MOVE, attempt=1,
                        metrics={"wire_tx_bytes": 10, "micro_batches": 1})
    assert resp.status == 200, await resp.text()
    job = await get_job(api, jid)
    assert job["placement"]["layout"] == AFTER and len(job["membership"]) == 1


async def test_the_moved_peer_tells_the_move_as_it_leaves_before_its_heartbeat_names_it(api):
    """The moved peer's fellow reports its new cell at the move's step, with no figures,
    before it runs it: the leader makes the move then, so a heartbeat naming the new cell is
    one its placement gives that fellow (not one to stop), and no step's record changes."""
    jid, cells = await _moving_job(api, 8250)
    await _before(api, jid, cells)
    mover = cells[(0, 1)]
    progress = f"{A}/jobs/{jid}/progress"
    before = (await expect_ok(await api.get(progress, headers=AUTH)))["records"]
    told = await report(api, jid, mover, "RUNNING", step=3, stage=1, replica=2, epoch=1,
                        moved=MOVE)
    assert told.status == 200, await told.text()
    job = await get_job(api, jid)
    assert job["placement"]["layout"] == AFTER and len(job["membership"]) == 1
    after = (await expect_ok(await api.get(progress, headers=AUTH)))["records"]
    # (the move is noted from its first step, 4, which has no record yet: 1-3 unchanged)
    assert [r for r in after if r["step"] <= 3] == before
    def running(cell: tuple[int, int]) -> dict[str, Any]:
        return {"status": "busy", "current_job": jid,
                "running": [{"job_id": jid, "stage": cell[0], "replica": cell[1],
                             "attempt": 0}]}

    # (a cell the placement gives nobody is stopped: what the new cell's would have been)
    await heartbeat(api, mover, **running((1, 3)))
    [stop] = [s for s in await poll(api, mover) if s["kind"] == "STOP"]
    await heartbeat(api, mover, **running((1, 2)))
    assert not [s for s in await poll(api, mover, after=stop["seq"]) if s["kind"] == "STOP"]


async def test_a_recovery_that_keeps_a_move_records_the_new_attempts_steps(api, monkeypatch):
    """A checkpoint at the move's step: the job resumes on the moved placement, its new attempt
    counts its moves from 0 (its reports' epoch 0 are the moved layout's) and every step it
    reports is recorded (a kept move never marks a report as superseded)."""
    from swarm_core.leader.liveness import Liveness

    jid, cells = await _moving_job(api, 8350, resume_policy="replace")
    await _before(api, jid, cells)
    mover = cells[(0, 1)]
    new = {(0, 0): cells[(0, 0)], (1, 0): cells[(1, 0)], (1, 1): cells[(1, 1)], (1, 2): mover}
    for (k, r), reg in new.items():
        assert (await _step(api, jid, reg, k, r, 4, 1, MOVE, loss=1.0 if k else None)
                ).status == 200
    monkeypatch.setattr(Liveness, "latest_checkpoint", lambda self, job: 3)
    assert (await report(api, jid, cells[(1, 1)], "FAILED", step=4, stage=1, replica=1,
                         epoch=1, message="boom")).status == 200
    for reg in cells.values():
        await heartbeat(api, reg, status="ready")

    async def resumed() -> dict[str, Any] | None:
        job = await get_job(api, jid)
        return job if job["attempt"] == 1 else None

    job = await wait_for(resumed, timeout=5.0)
    assert job["placement"]["layout"] == AFTER and len(job["membership"]) == 1
    for (k, r), reg in new.items():
        resp = await report(api, jid, reg, "RUNNING", step=4, stage=k, replica=r, epoch=0,
                            attempt=1, loss=2.0 if k else None,
                            metrics={"wire_tx_bytes": 10, "micro_batches": 1})
        assert resp.status == 200, await resp.text()
    rows = (await expect_ok(await api.get(f"{A}/jobs/{jid}/progress", headers=AUTH)))["records"]
    rec = next(r for r in rows if r["step"] == 4)
    assert len(rec["stages_reported"]) == 4 and rec["loss"] == 2.0
    # (the kept move, made at the checkpoint's step, keeps its mark on its first step,
    # whose record the resume cut and the new attempt trained again)
    assert rec["membership"][0]["moved"] == MOVE
    assert (await get_job(api, jid))["last_loss"] == 2.0


async def test_a_batch_of_reports_across_two_moves_is_taken_in_order(api):
    """Moves at adjacent steps (stage 0's cell 1 to stage 1, then back): one fellow's batch
    of the steps either side of both is taken report by report, each move made before the
    next report is checked; a refused report in a batch puts back what those before it
    made."""
    back = {"at": 4, "source": 1, "cell": 2, "target": 0, "new_id": 1}
    jid, _job_view, cells = await _placed(api, 8400, _job(moves=[MOVE, back]))
    await _before(api, jid, cells)
    stayer = cells[(1, 0)]

    def update(step: int, epoch: int, moved: dict[str, int]) -> dict[str, Any]:
        return {"fellow_id": stayer["fellow_id"], "state": "RUNNING", "step": step,
                "stage": 1, "replica": 0, "epoch": epoch, "moved": moved,
                "metrics": {"wire_tx_bytes": 10, "micro_batches": 1}}

    url = f"{A}/jobs/{jid}/statuses"
    bad = {"updates": [update(4, 1, MOVE), update(5, 2, {**back, "new_id": 2})]}
    await expect_error(await api.post(url, json=bad, headers=stayer["headers"]), 409,
                       "bad_move")
    job = await get_job(api, jid)
    assert job["membership"] == [] and "layout" not in job["placement"]  # (all put back)
    good = {"updates": [update(4, 1, MOVE), update(5, 2, back)]}
    await expect_ok(await api.post(url, json=good, headers=stayer["headers"]))
    job = await get_job(api, jid)
    assert [c["moved"] for c in job["membership"]] == [MOVE, back]
    assert "layout" not in job["placement"]  # (back to the grid)


async def test_a_heartbeat_naming_the_old_cell_after_a_stayer_told_the_move_stops_nothing(api):
    """The leader learned the move from a stayer; the moved peer's fellow still names its old
    cell (its heartbeat left before it moved): neither stopped (the STOP would end the new
    cell too: the same task) nor sent a START for its new cell."""
    jid, cells = await _moving_job(api, 8450)
    await _before(api, jid, cells)
    assert (await _step(api, jid, cells[(1, 0)], 1, 0, 4, 1, MOVE)).status == 200
    mover = cells[(0, 1)]
    seen = await poll(api, mover)
    last = max(s["seq"] for s in seen)
    await heartbeat(api, mover, status="busy", current_job=jid,
                    running=[{"job_id": jid, "stage": 0, "replica": 1, "attempt": 0}])
    assert [s["kind"] for s in await poll(api, mover, after=last)] == []
    # (a cell it never ran and no move explains is still stopped)
    await heartbeat(api, mover, status="busy", current_job=jid,
                    running=[{"job_id": jid, "stage": 1, "replica": 1, "attempt": 0}])
    assert "STOP" in [s["kind"] for s in await poll(api, mover, after=last)]


async def _moved_twice(api: TestClient, port: int, back: dict[str, int]
                       ) -> tuple[str, dict[tuple[int, int], Any], dict[str, Any], int]:
    """S=2 x R=2 whose peers make MOVE before step 3 and ``back`` before step 5, both told
    to the leader by a stayer's reports: the job, its cells' first fellows, its view then and
    the mover's last signal's seq (the first move's peer, at cell 0.1 at the start)."""
    body = _job(moves=[{k: v for k, v in MOVE.items() if k != "new_id"}, back])
    jid, _view, cells = await _placed(api, port, body)
    await _before(api, jid, cells)
    stayer = cells[(1, 0)]
    assert (await _step(api, jid, stayer, 1, 0, 4, 1, MOVE)).status == 200
    assert (await _step(api, jid, stayer, 1, 0, 5, 1, MOVE)).status == 200
    assert (await _step(api, jid, stayer, 1, 0, 6, 2, {**back, "new_id": 1})).status == 200
    last = max(s["seq"] for s in await poll(api, cells[(0, 1)]))
    return jid, cells, await get_job(api, jid), last


async def _named(api: TestClient, jid: str, reg: Any, cell: tuple[int, int],
                 after: int) -> list[str]:
    """The signals a fellow gets once its heartbeat names ``cell`` of the job."""
    await heartbeat(api, reg, status="busy", current_job=jid,
                    running=[{"job_id": jid, "stage": cell[0], "replica": cell[1],
                              "attempt": 0}])
    return [s["kind"] for s in await poll(api, reg, after=after)]


async def test_a_heartbeat_naming_the_old_cell_after_a_later_move_by_another_peer_stops_nothing(
        api):
    """Two moves, the leader told both by a stayer before the first mover's fellow named its
    new cell: its heartbeat still names the cell it left, which the second move gave another
    fellow. Its task runs its new cell: nothing is stopped, nothing started again."""
    jid, cells, job, last = await _moved_twice(api, 8470,
                                               {"at": 5, "source": 1, "cell": 1, "target": 0})
    assert job["placement"]["layout"] == [[0, 1], [0, 2]]
    assert next(c["fellow_id"] for c in job["placement"]["stages"]
                if (c["stage"], c["replica"]) == (0, 1)) == cells[(1, 1)]["fellow_id"]
    assert await _named(api, jid, cells[(0, 1)], (0, 1), last) == []


async def test_a_peer_that_moved_twice_may_be_named_by_either_old_cell(api):
    """The same peer moves there and back (0.1 -> 1.2, then 1.2 -> 0.1), the leader told by a
    stayer: a late heartbeat naming the cell it held between is forgiven; one naming a cell
    it never held is not."""
    jid, cells, job, last = await _moved_twice(api, 8490,
                                               {"at": 5, "source": 1, "cell": 2, "target": 0})
    assert "layout" not in job["placement"]  # (back to the grid, the peer at 0.1 again)
    mover = cells[(0, 1)]
    assert await _named(api, jid, mover, (1, 2), last) == []
    assert "STOP" in await _named(api, jid, mover, (1, 1), last)
