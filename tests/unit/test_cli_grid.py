"""``swarm job`` and ``swarm watch`` show a job's stages x replicas grid, against a real leader
app on a loopback port (in process: fellows are registrations that report by HTTP)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from swarm_core.contract import CodecErrors
from swarm_core.protocol import SESSION_HEADER
from swarm_tui.cli import run
from swarm_tui.commands.jobs import _describe
from swarm_tui.fmt import fmt_bytes, fmt_codec_error
from tests.support import TOKEN

A = "/api/v1"
MODEL = {"d_model": 16, "n_layers": 4, "n_heads": 2, "seq_len": 8}


async def _register(api: Any, auth: dict[str, str], i: int) -> dict[str, Any]:
    body = {"name": f"f{i}", "instance_id": f"i{i}", "devices": ["cpu"],
            "data_addrs": [f"127.0.0.1:{9100 + i}"]}
    resp = await api.post(f"{A}/fellows/register", json=body, headers=auth)
    assert resp.status == 201, await resp.text()
    reg = await resp.json()
    return {**reg, "headers": {**auth, SESSION_HEADER: reg["session"]}}


async def _job(api: Any, auth: dict[str, str], stages: int, replicas: int,
               **topology: Any) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    regs = {r["fellow_id"]: r for r in
            [await _register(api, auth, i) for i in range(stages * replicas)]}
    resp = await api.post(f"{A}/jobs", headers=auth, json={
        "name": "grid", "kind": "train", "model": MODEL,
        "topology": {"stages": stages, "replicas": replicas, **topology},
        "training": {"steps": 5, "batch_size": 8, "micro_batches": 2}})
    assert resp.status == 201, await resp.text()
    job = await resp.json()
    assert job["state"] == "RUNNING"
    return job, regs


async def _report(api: Any, job: dict[str, Any], regs: dict[int, dict[str, Any]],
                  cell: dict[str, Any], step: int, state: str = "RUNNING",
                  extra: dict[str, Any] | None = None) -> None:
    k, r = cell["stage"], cell["replica"]
    metrics: dict[str, Any] = {"wire_tx_bytes": 1000, "step_seconds": 0.5,
                               "wait_seconds": 0.05 * (k + 1), **(extra or {})}
    if job["topology"]["replicas"] > 1:
        metrics |= {"sync_tx_bytes": 2048 * (r + 1), "sync_seconds": 0.1}
    if state == "COMPLETED":
        metrics = {"steps": step, "wall_s": 2.0, "tokens_per_s": 100.0 + r,
                   "wire_tx_bytes_per_step": 1000.0, "wait_fraction": 0.25,
                   "sync_tx_bytes_per_step": 4096.0, "sync_fraction": 0.5}
    reg = regs[cell["fellow_id"]]
    resp = await api.post(f"{A}/jobs/{job['job_id']}/status", headers=reg["headers"], json={
        "fellow_id": reg["fellow_id"], "state": state, "step": step, "stage": k, "replica": r,
        "loss": 3.0 if k == job["topology"]["stages"] - 1 else None,
        # (a fellow's COMPLETED report says the run's tokens/s in both places)
        "tokens_per_s": metrics.get("tokens_per_s", 800.0 + 10 * k + r), "metrics": metrics})
    assert resp.status == 200, await resp.text()


def _cols(line: str) -> list[str]:
    """A table row's cells (the CLI's tables rule their columns)."""
    return [c.strip() for c in re.split("[│┃]", line)]


def _cli(api: Any, *argv: str) -> int:
    return run(["--leader-url", str(api.make_url("")).rstrip("/"), "--token", TOKEN, *argv])


async def test_swarm_job_shows_each_cell_of_the_grid(api, auth, capsys):
    job, regs = await _job(api, auth, 2, 2)
    cells = job["placement"]["stages"]
    for cell in cells:
        await _report(api, job, regs, cell, step=3 if cell["replica"] == 0 else 2)
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"]) == 0
    out = capsys.readouterr().out
    assert "grid: 2 stage(s) x 2 replicas" in out
    header = next(line for line in out.splitlines() if line.startswith("cell"))
    assert _cols(header) == ["cell", "fellow", "layers", "step", "tok/s", "link wait",
                             "sync/step", "sync wait"]
    rows = {_cols(line)[0]: _cols(line) for line in out.splitlines()
            if re.match(r"s\d+/r\d+ ", line)}
    assert sorted(rows) == ["s0/r0", "s0/r1", "s1/r0", "s1/r1"]
    for cell in cells:
        k, r = cell["stage"], cell["replica"]
        row = rows[f"s{k}/r{r}"]
        # fellow (name), layers, step, tok/s, link wait, sync/step, sync wait
        assert row[1:] == [f"{cell['fellow_id']} (f{cell['fellow_id']})",
                           f"{k * 2}-{k * 2 + 2}", "3" if r == 0 else "2",
                           str(800 + 10 * k + r), f"{10 * (k + 1)}%",
                           f"{2 * (r + 1)}.0 KiB", "20%"]
    # The job's own lines, then the grid: no stage row above it repeats a cell.
    head = out.split("grid:")[0]
    whats = [_cols(line)[0] for line in head.splitlines() if "│" in line]
    assert {"job", "name", "state", "step", "loss", "fellows", "note"} <= set(whats)
    assert not [w for w in whats if w.startswith("stage")]
    for figure in ("layers", "link wait", "/step", "act mem", "(f0)"):
        assert figure not in head

    # --format json: the same figures, typed, by the cell's label.
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"], "--format", "json") == 0
    data = json.loads(capsys.readouterr().out)
    figures = data["metrics"]["stages"]["1.1"]
    assert (figures["step"], figures["sync_tx_bytes"], figures["sync_seconds"]) == \
        (2, 4096, 0.1)


async def test_a_swarm_wired_grid_shows_each_cells_share_of_the_route(api, auth, capsys):
    """Issue 34: under swarm wiring each cell's share of the step's R x M micro-batches (what
    its route dealt it) is a column of the grid, and the title says the wiring."""
    job, regs = await _job(api, auth, 2, 2, wiring="swarm", route_weights=[[1, 1], [3, 1]])
    for cell in job["placement"]["stages"]:
        k, r = cell["stage"], cell["replica"]
        await _report(api, job, regs, cell, step=2,
                      extra={"micro_batches": 2 if k == 0 else (3 if r == 0 else 1)})
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"]) == 0
    out = capsys.readouterr().out
    assert "grid: 2 stage(s) x 2 replicas, swarm wiring" in out
    header = _cols(next(line for line in out.splitlines() if line.startswith("cell")))
    assert header[-1] == "mb share"
    rows = {_cols(line)[0]: _cols(line)[-1] for line in out.splitlines()
            if re.match(r"s\d+/r\d+ ", line)}
    assert rows == {"s0/r0": "50%", "s0/r1": "50%", "s1/r0": "75%", "s1/r1": "25%"}


async def test_a_layout_jobs_grid_lists_its_cells_by_stage_and_id(api, auth, capsys):
    """Placement-cells step 7: a swarm layout's stages of their own cells, [[0], [0, 1, 2]]
    for 2 shares: a row per cell by (stage, id), each with its share of the R x M
    micro-batches, and the title counts each stage's cells."""
    regs = {r["fellow_id"]: r for r in [await _register(api, auth, i) for i in range(4)]}
    resp = await api.post(f"{A}/jobs", headers=auth, json={
        "name": "grid", "kind": "train", "model": MODEL,
        "topology": {"stages": 2, "replicas": 2, "wiring": "swarm",
                     "layout": [[0], [0, 1, 2]]},
        "training": {"steps": 5, "batch_size": 8, "micro_batches": 2}})
    assert resp.status == 201, await resp.text()
    job = await resp.json()
    assert job["state"] == "RUNNING"
    dealt = {(0, 0): 4, (1, 0): 2, (1, 1): 1, (1, 2): 1}
    for cell in job["placement"]["stages"]:
        await _report(api, job, regs, cell, step=2,
                      extra={"micro_batches": dealt[(cell["stage"], cell["replica"])]})
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"]) == 0
    out = capsys.readouterr().out
    assert "grid: 2 stages, cells 1+3, swarm wiring" in out
    rows = {_cols(line)[0]: _cols(line) for line in out.splitlines()
            if re.match(r"s\d+/r\d+ ", line)}
    assert list(rows) == ["s0/r0", "s1/r0", "s1/r1", "s1/r2"]
    assert [row[-1] for row in rows.values()] == ["100%", "50%", "25%", "25%"]
    assert [row[1] for row in rows.values()] == [
        f"{c['fellow_id']} (f{c['fellow_id']})" for c in sorted(
            job["placement"]["stages"], key=lambda c: (c["stage"], c["replica"]))]
    assert [row[3] for row in rows.values()] == ["2"] * 4


async def test_swarm_job_shows_a_peers_move_in_its_membership_and_grid(api, auth, capsys):
    """Placement-cells step 7: once the leader has learnt a move from the cells' reports,
    ``swarm job`` shows the moved placement's cells, counts the move in the grid's title,
    and prints it with the fellow that moved; ``--format json`` is the record."""
    regs = {r["fellow_id"]: r for r in [await _register(api, auth, i) for i in range(4)]}
    move = {"at": 3, "source": 0, "cell": 1, "target": 1, "new_id": 2}
    resp = await api.post(f"{A}/jobs", headers=auth, json={
        "name": "grid", "kind": "train", "model": MODEL,
        "topology": {"stages": 2, "replicas": 2, "wiring": "swarm",
                     "moves": [{k: v for k, v in move.items() if k != "new_id"}]},
        "training": {"steps": 8, "batch_size": 8, "micro_batches": 2}})
    assert resp.status == 201, await resp.text()
    job = await resp.json()
    cells = {(c["stage"], c["replica"]): c["fellow_id"] for c in job["placement"]["stages"]}
    mover = cells[(0, 1)]

    async def step(k: int, r: int, fid: int, n: int, epoch: int) -> None:
        reg = regs[fid]
        body: dict[str, Any] = {
            "fellow_id": fid, "state": "RUNNING", "step": n, "stage": k, "replica": r,
            "epoch": epoch, "metrics": {"wire_tx_bytes": 10, "micro_batches": 1}}
        if epoch:
            body["moved"] = move
        if k == 1:
            body["loss"] = 2.0
        resp = await api.post(f"{A}/jobs/{job['job_id']}/status", headers=reg["headers"],
                              json=body)
        assert resp.status == 200, await resp.text()

    for n in (1, 2, 3):
        for (k, r), fid in cells.items():
            await step(k, r, fid, n, 0)
    after = {(0, 0): cells[(0, 0)], (1, 0): cells[(1, 0)], (1, 1): cells[(1, 1)],
             (1, 2): mover}
    for (k, r), fid in after.items():
        await step(k, r, fid, 4, 1)
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"]) == 0
    out = capsys.readouterr().out
    assert "grid: 2 stages, cells 1+3 (1 move), swarm wiring" in out
    moved = next(_cols(line) for line in out.splitlines() if line.startswith("moved @"))
    assert moved[:2] == ["moved @4", f"f{mover} moved 0.1 -> 1.2 (rebalance)"]
    rows = {_cols(line)[0]: _cols(line) for line in out.splitlines()
            if re.match(r"s\d+/r\d+ ", line)}
    assert list(rows) == ["s0/r0", "s1/r0", "s1/r1", "s1/r2"]
    assert rows["s1/r2"][1] == f"{mover} (f{mover})" and rows["s1/r2"][3] == "4"
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"], "--format", "json") == 0
    [change] = json.loads(capsys.readouterr().out)["membership"]
    assert change["moved"] == move and change["step"] == 4


def _cell_extras(k: int, r: int) -> dict[str, Any]:
    """Figures of a cell that only some cells report: s0/r1's activation peak, s1's codec."""
    extra: dict[str, Any] = {}
    if (k, r) == (0, 1):
        extra["activation_peak_bytes"] = 5 * 1024
    if k == 1:
        extra["codec_error"] = {"act": 0.01 * (r + 1), "grad": 0.02}
    return extra


async def test_the_grid_marks_the_cells_of_a_replica_that_left(api, auth, capsys):
    """Replica 1 of a 1 x 2 job failed and left: its row stays, with its last figures, its
    fellow marked as left; the other replica's is as it was; the change is a row above."""
    job, regs = await _job(api, auth, 1, 2)
    cells = {c["replica"]: c for c in job["placement"]["stages"]}
    for cell in cells.values():
        await _report(api, job, regs, cell, step=2)
    await _report(api, job, regs, cells[1], step=2, state="FAILED")
    reg = regs[cells[0]["fellow_id"]]
    resp = await api.post(f"{A}/jobs/{job['job_id']}/regroup", headers=reg["headers"],
                          params={"wait": "2"},
                          json={"fellow_id": reg["fellow_id"], "stage": 0, "replica": 0,
                                "op_step": 2, "synced_step": 1})
    assert (await resp.json())["order"]["members"] == [0], await resp.text()
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"]) == 0
    out = capsys.readouterr().out
    rows = {_cols(line)[0]: _cols(line) for line in out.splitlines()
            if re.match(r"s\d+/r\d+ ", line)}
    f0, f1 = cells[0]["fellow_id"], cells[1]["fellow_id"]
    assert rows["s0/r1"][1:4] == [f"{f1} (f{f1}) left", "0-4", "2"]
    assert rows["s0/r0"][1] == f"{f0} (f{f0})"
    assert "replicas @3" in out and "replica(s) 1 left; training: 0" in out


async def test_the_grid_holds_the_figures_only_some_cells_report(api, auth, capsys):
    job, regs = await _job(api, auth, 2, 2)
    cells = job["placement"]["stages"]
    for cell in cells:
        await _report(api, job, regs, cell, step=3,
                      extra=_cell_extras(cell["stage"], cell["replica"]))
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"]) == 0
    out = capsys.readouterr().out
    head, grid = out.split("grid:")
    header = next(line for line in grid.splitlines() if line.startswith("cell"))
    assert _cols(header)[-2:] == ["act mem", "codec error"]
    rows = {_cols(line)[0]: _cols(line) for line in grid.splitlines()
            if re.match(r"s\d+/r\d+ ", line)}
    for cell in cells:
        k, r = cell["stage"], cell["replica"]
        extra = _cell_extras(k, r)
        peak = extra.get("activation_peak_bytes")
        codec = extra.get("codec_error")
        assert rows[f"s{k}/r{r}"][-2:] == [
            "-" if peak is None else fmt_bytes(peak),
            "-" if codec is None else fmt_codec_error(CodecErrors(**codec))]
    assert "act mem" not in head and "codec error" not in head


async def test_a_chain_shows_no_grid(api, auth, capsys):
    job, regs = await _job(api, auth, 2, 1)
    for cell in job["placement"]["stages"]:
        await _report(api, job, regs, cell, step=3, extra=_cell_extras(cell["stage"], 1))
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"]) == 0
    out = capsys.readouterr().out
    assert "grid:" not in out and "sync" not in out
    assert "stage 0 replica" not in out
    # A row per stage, as chains have always shown them: fellow, layers, then its figures.
    rows = {_cols(line)[0]: _cols(line)[1] for line in out.splitlines()
            if line.startswith("stage ")}
    for cell in job["placement"]["stages"]:
        k, fid = cell["stage"], cell["fellow_id"]
        figures = [f"fellow {fid} (f{fid}) layers {2 * k}-{2 * k + 2}",
                   f"link wait {10 * (k + 1)}%"]
        extra = _cell_extras(k, 1)
        if "activation_peak_bytes" in extra:
            figures.append(f"act mem {fmt_bytes(extra['activation_peak_bytes'])}")
        if "codec_error" in extra:
            err = extra["codec_error"]
            figures.append(f"codec error act {err['act']:.2%}, grad {err['grad']:.2%}")
        assert rows[f"stage {k}"] == " · ".join(figures)


async def test_swarm_watch_shows_the_grid_and_names_each_cell(api, auth, capsys):
    job, regs = await _job(api, auth, 1, 2)
    for cell in job["placement"]["stages"]:
        await _report(api, job, regs, cell, step=5, state="COMPLETED")
    assert await asyncio.to_thread(_cli, api, "watch", job["job_id"]) == 0
    out = capsys.readouterr().out
    assert "grid: 1 stage(s) x 2 replicas" in out
    rows = [_cols(line) for line in out.splitlines() if line.startswith("s0/r")]
    # The run's figures once completed: its tokens/s, wait share, sync bytes and share.
    assert [r[0] for r in rows] == ["s0/r0", "s0/r1"]
    assert rows[0][2:] == ["0-4", "5", "100", "25%", "4.0 KiB", "50%"]
    assert out.strip().splitlines()[-1].startswith(f"{job['job_id']} COMPLETED at step 5")


@pytest.mark.parametrize("data, line", [
    ({"stage": 1, "replica": 0, "loss": 2.5, "tokens_per_s": 900.0,
      "metrics": {"sync_tx_bytes": 2048, "sync_seconds": 0.1, "step_seconds": 0.5}},
     "step 7  s1/r0  fellow 3  loss 2.5000  900 tok/s  sync 2.0 KiB  sync wait 20%"),
    ({"stage": 1, "loss": 2.5, "tokens_per_s": 900.0, "metrics": {}},  # a chain: as before
     "step 7  fellow 3  loss 2.5000  900 tok/s"),
])
def test_watch_lines_name_the_cell_of_a_grid(data, line):
    assert _describe({"type": "metric", "data": {
        "state": "RUNNING", "step": 7, "fellow_id": 3, **data}}) == line


async def test_submit_asks_for_a_swarm_and_its_sync_by_flags(api, auth, tmp_path, capsys):
    """``swarm submit --stages 1 --replicas 2 --sync diloco --inner-steps 4 --overlap-steps 2
    --sync-compression int8``: the job's training.sync is those flags over the profile's; a
    bad combination is one usage line naming the field, and nothing is submitted."""
    for i in range(2):
        await _register(api, auth, i)
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"name": "m", **MODEL}))
    base = ["submit", "--model", str(model), "--stages", "1", "--replicas", "2",
            "--steps", "8", "--sync", "diloco", "--inner-steps", "4"]
    assert await asyncio.to_thread(_cli, api, *base, "--overlap-steps", "4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$.training.sync.overlap_steps: must be below inner_steps (4)" \
        in err[0]
    assert (await (await api.get(f"{A}/jobs", headers=auth)).json())["jobs"] == []
    assert await asyncio.to_thread(_cli, api, *base, "--overlap-steps", "2",
                                   "--sync-compression", "int8", "--format", "json") == 0
    job = json.loads(capsys.readouterr().out)
    sync = job["training"]["sync"]
    assert (sync["mode"], sync["inner_steps"], sync["overlap_steps"], sync["compression"]) == \
        ("diloco", 4, 2, "int8")
    assert job["topology"]["replicas"] == 2 and job["training"]["steps"] == 8
    assert await asyncio.to_thread(_cli, api, "submit", "--sync", "dp") == 2
    assert "the sync flags are for train jobs" in capsys.readouterr().err


async def test_submit_asks_for_sparseloco_and_its_fields_by_flags(api, auth, tmp_path, capsys):
    """``swarm submit --sync sparseloco --density 0.05 …``: the leader takes the job with those
    fields in its training.sync; a bad value is one usage line naming the field."""
    for i in range(2):
        await _register(api, auth, i)
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"name": "m", **MODEL}))
    base = ["submit", "--model", str(model), "--stages", "1", "--replicas", "2",
            "--steps", "8", "--sync", "sparseloco", "--inner-steps", "4"]
    assert await asyncio.to_thread(_cli, api, *base, "--value-bits", "3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--value-bits 3: $.training.sync.value_bits: must be one of " \
        "1, 2, 4, 8, 32, got 3" in err[0]
    assert (await (await api.get(f"{A}/jobs", headers=auth)).json())["jobs"] == []
    assert await asyncio.to_thread(_cli, api, *base, "--density", "0.05", "--chunk", "1024",
                                   "--value-bits", "4", "--error-decay", "0.9",
                                   "--format", "json") == 0
    sync = json.loads(capsys.readouterr().out)["training"]["sync"]
    assert {k: sync[k] for k in ("mode", "inner_steps", "density", "chunk", "value_bits",
                                 "error_decay", "outer_lr", "outer_momentum")} == {
        "mode": "sparseloco", "inner_steps": 4, "density": 0.05, "chunk": 1024,
        "value_bits": 4, "error_decay": 0.9, "outer_lr": None, "outer_momentum": None}


async def test_submit_asks_for_demo_and_for_muon_by_flags(api, auth, tmp_path, capsys):
    """``swarm submit --sync demo --topk 16 --no-sign-values``, and ``--optimizer muon`` under
    DiLoCo: the leader takes each job with those fields; muon under demo (whose replicas step
    SGD) is one usage line naming the field, and no job."""
    for i in range(2):
        await _register(api, auth, i)
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"name": "m", **MODEL}))
    base = ["submit", "--model", str(model), "--stages", "1", "--replicas", "2", "--steps", "8"]
    assert await asyncio.to_thread(_cli, api, *base, "--sync", "demo", "--optimizer",
                                   "muon") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer: must be adamw under sync.mode demo" in err[0]
    assert (await (await api.get(f"{A}/jobs", headers=auth)).json())["jobs"] == []
    assert await asyncio.to_thread(_cli, api, *base, "--sync", "demo", "--topk", "16",
                                   "--no-sign-values", "--format", "json") == 0
    sync = json.loads(capsys.readouterr().out)["training"]["sync"]
    assert (sync["mode"], sync["topk"], sync["sign_values"]) == ("demo", 16, False)
    assert await asyncio.to_thread(_cli, api, *base, "--sync", "diloco", "--optimizer", "muon",
                                   "--format", "json") == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert (training["sync"]["mode"], training["optimizer"]) == ("diloco", "muon")


async def test_submit_asks_for_the_torch_transport_by_flag(api, auth, tmp_path, capsys):
    """``swarm submit --transport torch``: the leader takes the job with that transport; with
    a training profile whose link limits would shape it, one usage line naming the field, and
    no job."""
    for i in range(2):
        await _register(api, auth, i)
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"name": "m", **MODEL}))
    shaped = tmp_path / "t.json"
    shaped.write_text(json.dumps({"steps": 4, "network_profile": {"name": "slow",
                                                                  "tx_mbps": 10}}))
    base = ["submit", "--model", str(model), "--stages", "1", "--replicas", "2",
            "--transport", "torch"]
    assert await asyncio.to_thread(_cli, api, *base, "--training", str(shaped)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "transport: must be 'shaped' where" in err[0]
    assert (await (await api.get(f"{A}/jobs", headers=auth)).json())["jobs"] == []
    assert await asyncio.to_thread(_cli, api, *base, "--format", "json") == 0
    assert json.loads(capsys.readouterr().out)["training"]["transport"] == "torch"


async def test_submit_asks_for_measured_routes_by_flag(api, auth, tmp_path, capsys):
    """``swarm submit --wiring swarm --routing measured``: the leader takes the job with SWARM's
    measured routes and ``swarm job``'s grid says so; measured routes on a chain are one usage
    line naming the field, and no job."""
    for i in range(4):
        await _register(api, auth, i)
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"name": "m", **MODEL}))
    base = ["submit", "--model", str(model), "--stages", "2", "--replicas", "2",
            "--routing", "measured"]
    assert await asyncio.to_thread(_cli, api, *base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$.topology.routing: measured routing is for wiring swarm" \
        in err[0]
    assert (await (await api.get(f"{A}/jobs", headers=auth)).json())["jobs"] == []
    assert await asyncio.to_thread(_cli, api, *base, "--wiring", "swarm",
                                   "--format", "json") == 0
    job = json.loads(capsys.readouterr().out)
    assert (job["topology"]["wiring"], job["topology"]["routing"]) == ("swarm", "measured")
    assert await asyncio.to_thread(_cli, api, "job", job["job_id"]) == 0
    assert "grid: 2 stage(s) x 2 replicas, swarm wiring (measured routes)" in \
        capsys.readouterr().out


async def test_submit_asks_for_a_layout_and_rebalancing_by_flag(api, auth, tmp_path, capsys):
    """``swarm submit --layout 0;0,1,2 --wiring swarm --replicas 2``: the leader places the
    layout's four cells; ``--rebalance-every`` without measured routes is one usage line
    naming the field, and no job; a layout that is not one is refused by the flag."""
    for i in range(4):
        await _register(api, auth, i)
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"name": "m", **MODEL}))
    base = ["submit", "--model", str(model), "--replicas", "2", "--wiring", "swarm"]
    assert await asyncio.to_thread(_cli, api, *base, "--rebalance-every", "4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$.topology.rebalance_every: rebalancing reads measured " \
        "throughput: it needs routing measured" in err[0], err
    with pytest.raises(SystemExit) as bad:
        await asyncio.to_thread(_cli, api, *base, "--layout", "0;x")
    assert bad.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "expected stages of cell ids like '0;0,1,2'" in err[-1], err
    assert (await (await api.get(f"{A}/jobs", headers=auth)).json())["jobs"] == []
    assert await asyncio.to_thread(_cli, api, *base, "--layout", "0;2,0,1", "--routing",
                                   "measured", "--rebalance-every", "4",
                                   "--format", "json") == 0
    job = json.loads(capsys.readouterr().out)
    topo = job["topology"]
    assert (topo["layout"], topo["stages"], topo["fellows"], topo["rebalance_every"]) == \
        ([[0], [0, 1, 2]], 2, 4, 4)
    assert job["placement"]["layout"] == [[0], [0, 1, 2]]
