"""The console shows a job's stages x replicas grid: the watch view has one row per cell with
its stage and replica and its group's sync, the fellows table names each fellow's cell; both
at 80 columns. Against the fixed-data client with a 2 x 2 job (in process, cheap)."""

from __future__ import annotations

from swarm_tui.app.app import SwarmApp
from swarm_tui.app.screens.jobs import JobWatchScreen
from swarm_tui.app.widgets.live_table import LiveTable
from tests.tui_support import (
    GRID_JOB,
    T0,
    GridFakeClient,
    frozen_clock,
    grid_metric,
    screen_text,
    wait_for,
)

SIZE = (80, 24)


def _app(client: GridFakeClient) -> SwarmApp:
    return SwarmApp(client, clock=frozen_clock, refresh_s=None, tick_s=None, flush_s=0)


async def _loaded(pilot: object, app: SwarmApp, client: GridFakeClient) -> None:
    await wait_for(pilot, lambda: app.snapshots >= 1
                   and app.model.events_seen >= client.expected_events, "the fixed data")


async def _watch_table(pilot: object, app: SwarmApp) -> LiveTable:
    await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                   and app.screen.query(LiveTable), "the watch")
    return app.screen.query_one(LiveTable)


async def _grid_watch(pilot: object, app: SwarmApp, client: GridFakeClient) -> LiveTable:
    """The grid job's watch, its four cells listed."""
    await _loaded(pilot, app, client)
    app.watch_job(GRID_JOB)
    table = await _watch_table(pilot, app)
    await wait_for(pilot, lambda: table.row_count == 4, "a row per cell")
    return table


def _row(text: str, start: str) -> list[str]:
    return next(line.split() for line in text.splitlines() if line.lstrip().startswith(start))


async def test_the_watch_view_has_a_row_per_cell_with_its_sync_at_80_columns() -> None:
    client = GridFakeClient()
    app = _app(client)
    async with app.run_test(size=SIZE) as pilot:
        table = await _grid_watch(pilot, app, client)
        await pilot.pause()
        # By stage, then replica; what it ran and how it waits fit 80 columns (the status
        # and the loss, the last stage's, give way; so does the heartbeat age, since the
        # step column is wide enough to say "left @123" of a replica that left).
        assert table.shown_keys == ["0", "2", "1", "3"]
        assert table.visible == ["id", "name", "stage", "replica", "step", "tps", "wait",
                                 "sync", "sync_wait"]
        text = screen_text(app)
        assert all(len(line.rstrip()) <= 80 for line in text.splitlines())
        assert _row(text, "fellow") == ["fellow", "name", "stage▲", "rep", "step", "tok/s",
                                        "wait", "sync", "swait"]
        # The leader's figures of each cell (what a console opened mid-run has)...
        assert _row(text, "6 ") == ["6", "dp-0", "0", "0", "40", "900", "10%", "293.0K",
                                    "20%"]
        assert _row(text, "8 ") == ["8", "dp-2", "0", "1", "40", "920", "10%", "293.0K",
                                    "30%"]
        assert _row(text, "9 ")[4:9] == ["40", "930", "20%", "585.9K", "30%"]
        # ... then replica 1 of stage 1's newest report.
        app.apply_event(grid_metric((app.model.last_seq or 0) + 1))
        await wait_for(pilot, lambda: _row(screen_text(app), "9 ")[4] == "41", "the report")
        assert _row(screen_text(app), "9 ") == ["9", "dp-3", "1", "1", "41", "950", "25%",
                                                "2.4M", "50%"]
        # An export has every column, the replica and the sync figures among them.
        columns, rows = table.export_rows()
        assert {"replica", "sync_bytes", "sync_fraction", "wait_fraction"} <= set(columns)
        assert rows[-1]["replica"] == 1 and rows[-1]["sync_bytes"] == 2_500_000


async def test_a_chains_watch_keeps_its_columns() -> None:
    client = GridFakeClient()
    app = _app(client)
    async with app.run_test(size=SIZE) as pilot:
        await _loaded(pilot, app, client)
        app.watch_job("job-000002")
        table = await _watch_table(pilot, app)
        await wait_for(pilot, lambda: table.row_count == 2, "a row per stage")
        assert "replica" not in table.visible and "sync" not in table.visible
        assert [c.key for c in table.spec][:4] == ["id", "name", "stage", "status"]


async def test_the_fellows_table_names_each_fellows_cell_at_80_columns() -> None:
    client = GridFakeClient()
    app = _app(client)
    async with app.run_test(size=SIZE) as pilot:
        await _loaded(pilot, app, client)
        await pilot.pause()
        text = screen_text(app)
        assert "job/cell" in _row(text, "id")
        for fid, cell in ((6, "s0/r0"), (7, "s1/r0"), (8, "s0/r1"), (9, "s1/r1")):
            assert _row(text, f"{fid} ")[3:5] == [GRID_JOB, cell], text
        assert all(len(line.rstrip()) <= 80 for line in text.splitlines())


async def test_a_fellows_detail_names_its_cell() -> None:
    from swarm_tui.app.screens.fellows import FellowDetailScreen

    client = GridFakeClient()
    app = _app(client)
    async with app.run_test(size=SIZE) as pilot:
        await _loaded(pilot, app, client)
        app.push_screen(FellowDetailScreen(8))
        await wait_for(pilot, lambda: f"{GRID_JOB} s0/r1  step" in screen_text(app),
                       "the detail's job line")


async def test_the_watch_marks_a_replica_that_left_and_says_when() -> None:
    """Replica 1 of the 2 x 2 job left at step 31 (its stage-1 fellow dropped out): its two
    rows say "left @31" where their step was (also at 80 columns, where the status gives
    way) and show none of their old figures; the summary names the change and the fellow
    that left; the loss plot marks the step (▼)."""
    import attrs

    from swarm_core.contract import MembershipChange
    from swarm_tui.app.widgets.plot import MetricPlot

    client = GridFakeClient()
    reason = "fellow 9 (dp-3, stage 1 replica 1) dropped out at step 31: its neighbour " \
             "fellow 8 (dp-2) lost the link to it"
    client._jobs[-1] = attrs.evolve(
        client._jobs[-1], members=[0],
        membership=[MembershipChange(step=31, epoch=1, members=[0], left=[1], reason=reason)])
    for i, f in enumerate(client._fellows):
        if f.fellow_id in (8, 9):  # (told to stop: free again)
            client._fellows[i] = attrs.evolve(f, status="ready", current_job=None,
                                              current_stage=None)
    app = _app(client)
    async with app.run_test(size=(120, 24)) as pilot:
        await _grid_watch(pilot, app, client)
        await pilot.pause()
        text = screen_text(app)
        assert "@31: replica(s) 1 left (fellow 9 (dp-3, stage 1 replica 1) dropped out" in \
            text.replace("\n", " ").replace("  ", " ")
        status = {row[0]: row[4:6] for row in (_row(text, f"{f} ") for f in (6, 7, 8, 9))}
        assert status == {"6": ["busy", "40"], "7": ["busy", "40"], "8": ["left", "@31"],
                          "9": ["left", "@31"]}
        assert app.screen.query_one("#curve", MetricPlot).spec.left == (31.0,)
        await pilot.resize_terminal(*SIZE)

        def narrow() -> bool:  # (laid out again at 80: the 120-column table said it first)
            now = screen_text(app)
            return "left @31" in now and all(len(ln.rstrip()) <= 80 for ln in now.splitlines())

        await wait_for(pilot, narrow, "80 columns")
        text = screen_text(app)
        assert all(len(line.rstrip()) <= 80 for line in text.splitlines())
        for fid in (8, 9):
            # fellow, name, stage, rep, step, tok/s, wait, sync, swait: none of the old ones
            assert _row(text, f"{fid} ")[4:9] == ["left", "@31", "-", "-", "-"], text
        assert _row(text, "6 ")[4] == "40"


async def test_a_cell_taken_over_by_a_joiner_is_blank_until_its_new_fellow_reports() -> None:
    """Spares 2 and 5 join as replica 1 (which left at step 31): their cells say "joining"
    and show nothing of the dead cells' step and tok/s, nor of their own heartbeats, until
    they report; then their own figures; once the group took them in, their status."""
    import attrs

    from swarm_core.contract import MembershipChange

    client = GridFakeClient()
    job = client._jobs[-1]
    assert job.placement is not None
    spares = {(0, 1): (2, "cpu-c"), (1, 1): (5, "cpu-f")}
    cells = [attrs.evolve(c, fellow_id=spares[(c.stage, c.replica)][0],
                          name=spares[(c.stage, c.replica)][1])
             if (c.stage, c.replica) in spares else c for c in job.placement.stages]
    client._jobs[-1] = attrs.evolve(
        job, members=[0], fellows=[6, 7, 2, 5],
        placement=attrs.evolve(job.placement, stages=cells),
        membership=[MembershipChange(step=31, epoch=1, members=[0], left=[1])])
    for i, f in enumerate(client._fellows):
        if f.fellow_id in (2, 5):  # (their heartbeats: busy with the job, a step of their own)
            client._fellows[i] = attrs.evolve(f, status="busy", current_job=GRID_JOB,
                                              current_step=3, tokens_per_s=55.0)
    app = _app(client)
    async with app.run_test(size=SIZE) as pilot:
        await _grid_watch(pilot, app, client)
        await pilot.pause()
        text = screen_text(app)
        for fid in (2, 5):
            assert _row(text, f"{fid} ")[4:7] == ["-", "-", "-"], text
        from swarm_tui.app.cells import watch_cells
        view = app.model.jobs[GRID_JOB]
        assert watch_cells(app.model, view, 2)["status"].plain == "joining"
        seq = app.model.last_seq or 0
        app.apply_event({"seq": seq + 1, "ts": T0, "type": "metric", "data": {
            "job_id": GRID_JOB, "fellow_id": 2, "stage": 0, "replica": 1, "step": 44,
            "tokens_per_s": 700.0, "state": "RUNNING",
            "metrics": {"wire_tx_bytes": 1000, "step_seconds": 0.4, "wait_seconds": 0.1}}})
        await wait_for(pilot, lambda: _row(screen_text(app), "2 ")[4:6] == ["44", "700"],
                       "the joiner's own report")
        assert watch_cells(app.model, view, 2)["status"].plain == "joining"
        app.apply_event({"seq": seq + 2, "ts": T0, "type": "job.membership", "data": {
            "job_id": GRID_JOB, "step": 44, "epoch": 2, "members": [0, 1], "joined": [1],
            "reason": "fellows 2, 5 joined"}})
        await wait_for(pilot, lambda: watch_cells(app.model, view, 2)["status"].plain
                       == "busy", "taken in")
        from swarm_tui.app.widgets.plot import MetricPlot
        spec = app.screen.query_one("#curve", MetricPlot).spec
        assert (spec.left, spec.joined) == ((31.0,), (44.0,))


async def test_the_watch_sets_the_speed_of_a_cell_its_stage_group_or_its_replica() -> None:
    """From the cell under the cursor (stage 1, replica 1: fellow 9), `s` shapes its
    fellow's link, `S` every replica of its stage, `P` every stage of its replica, as
    `swarm set-speed --stage/--replica` does; a replica that left is not shaped; on a job
    that is not running it refuses."""
    import attrs
    from textual.widgets import Input

    from swarm_tui.app.screens.dialogs import SetSpeedDialog

    client = GridFakeClient()
    app = _app(client)
    async with app.run_test(size=SIZE) as pilot:
        table = await _grid_watch(pilot, app, client)
        await pilot.press("G")
        await wait_for(pilot, lambda: table.cursor_key == "3", "the cursor on cell 1.1")
        for key, targets in (("S", [(7, "dp-1"), (9, "dp-3")]),
                             ("P", [(8, "dp-2"), (9, "dp-3")]), ("s", [(9, "dp-3")])):
            await pilot.press(key)
            dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                    and app.screen, f"the dialog of {key}")
            assert dialog.targets == targets, key
            if key != "s":
                await pilot.press("escape")
                await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen),
                               "the watch again")
        dialog.query_one("#tx", Input).value = "50"
        await pilot.press("enter")
        await wait_for(pilot, lambda: any(c[0] == "set_speed" for c in client.calls),
                       "the set-speed sent")
        [(fid, req)] = [args for name, args in client.calls if name == "set_speed"]
        assert (fid, req.tx_mbps) == (9, 50.0)
        # Replica 1 left: its cell is refused, its stage group is replica 0's fellow alone.
        view = app.model.jobs[GRID_JOB]
        view.info = attrs.evolve(view.info, members=[0])
        await pilot.press("s")
        await pilot.pause()
        assert isinstance(app.screen, JobWatchScreen)
        assert any("replica 1 has left" in n.message for n in app._notifications)
        await pilot.press("S")
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                and app.screen, "the stage group's dialog")
        assert dialog.targets == [(7, "dp-1")]
        await pilot.press("escape")
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen), "the watch")
        # A job that is over has no links to shape: refused with a notice.
        view.info = attrs.evolve(view.info, state="COMPLETED")
        await pilot.press("S")
        await pilot.pause()
        assert isinstance(app.screen, JobWatchScreen)
        assert any("is COMPLETED" in n.message for n in app._notifications)


async def test_a_replica_jobs_summary_and_curve_are_the_jobs_loss_as_swarm_job_shows_it(
        api, auth, capsys) -> None:
    """A real leader (in process), a 2 x 2 job whose replicas report different losses: the
    watch's summary and curve show the job's loss (the mean of its replicas' at a step, what
    `swarm job` shows), not the newest replica's; each replica's stays in its row; the
    curve is the same when the watch is opened again (the leader's records)."""
    import asyncio
    import re

    from swarm_core.client import SwarmClient
    from swarm_tui.app.screens.jobs import curve_caption
    from tests.support import TOKEN
    from tests.unit.test_cli_grid import _cli, _job

    job, regs = await _job(api, auth, 2, 2)
    jid = job["job_id"]
    cells = job["placement"]["stages"]

    async def step(n: int) -> None:
        """Every cell reports step n: the last stage's replica 0 a loss of 3.0, replica 1
        of 2.0 - 0.1 n."""
        for cell in cells:
            k, r = cell["stage"], cell["replica"]
            reg = regs[cell["fellow_id"]]
            resp = await api.post(f"/api/v1/jobs/{jid}/status", headers=reg["headers"], json={
                "fellow_id": reg["fellow_id"], "state": "RUNNING", "step": n, "stage": k,
                "replica": r, "loss": None if k == 0 else 3.0 if r == 0 else 2.0 - 0.1 * n,
                "tokens_per_s": 800.0, "metrics": {"wire_tx_bytes": 1000, "step_seconds": 0.5}})
            assert resp.status == 200, await resp.text()

    await step(1)
    url = str(api.make_url("")).rstrip("/")
    app = SwarmApp(SwarmClient(url, TOKEN), refresh_s=None, tick_s=None, flush_s=0)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_for(pilot, lambda: app.snapshots >= 1, "a snapshot")
        app.watch_job(jid)
        await _watch_table(pilot, app)
        await wait_for(pilot, lambda: app.model.jobs[jid].history_loaded, "the history")
        await step(2)  # (live: the stream's metric events)
        await wait_for(pilot, lambda: app.model.jobs[jid].info.last_step == 2
                       and "loss 2.4000" in screen_text(app), "step 2's mean in the summary")
        view = app.model.jobs[jid]
        assert [p[1] for p in view.info.loss_history] == [2.45, 2.4]
        assert curve_caption(view).endswith("last 2.4000")
        # Each replica's own loss stays in its row (stage 1: replica 0 says 3.0, 1 says 1.8).
        from swarm_tui.app.cells import watch_cells

        assert {watch_cells(app.model, view, i)["loss"].plain for i in (1, 3)} == \
            {"3.0000", "1.8000"}
        # Opened again: the leader's records, the same curve.
        await pilot.press("escape")
        # (forgotten before the watch opens, whose mount fetches it: set after, it could
        # land after that fetch, and nothing would fetch it again)
        app.model.jobs[jid].history_loaded = False
        app.watch_job(jid)
        await _watch_table(pilot, app)
        await wait_for(pilot, lambda: app.model.jobs[jid].history_loaded, "the history again")
        assert [p[1] for p in app.model.jobs[jid].info.loss_history] == [2.45, 2.4]
    # `swarm job` says the same (run once the console is closed: it holds stdout).
    capsys.readouterr()
    assert await asyncio.to_thread(_cli, api, "job", jid) == 0
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    shown = re.search(r"^loss\s*│\s*(\S+)", out, re.M)
    assert shown is not None and shown.group(1) == "2.4000", out


async def test_a_swarm_wired_watch_shows_each_cells_share_of_the_route() -> None:
    """Issue 34: under swarm wiring each cell's share of the step's micro-batches (what its
    route dealt it) stands beside its throughput, from the leader's figures, then from each
    cell's newest report."""
    import attrs

    from swarm_core.contract import Topology

    client = GridFakeClient()
    job = client._jobs[-1]
    stages = {label: attrs.evolve(m, micro_batches=6.0 if label == "1.0" else
                                  2.0 if label == "1.1" else 4.0)
              for label, m in job.metrics.stages.items()}
    client._jobs[-1] = attrs.evolve(
        job, topology=Topology(stages=2, replicas=2, wiring="swarm"),
        metrics=attrs.evolve(job.metrics, stages=stages))
    app = _app(client)
    async with app.run_test(size=(100, 24)) as pilot:
        table = await _grid_watch(pilot, app, client)
        await pilot.pause()
        assert "share" in table.visible
        text = screen_text(app)
        header = _row(text, "fellow")
        at = header.index("share")
        # (micro_batches 4 a replica: 8 a step; stage 1 dealt 6 : 2)
        assert [_row(text, f"{f} ")[at] for f in (6, 7, 8, 9)] == ["50%", "75%", "50%", "25%"]
        metric = grid_metric((app.model.last_seq or 0) + 1)
        metric["data"]["metrics"]["micro_batches"] = 3
        app.apply_event(metric)
        await wait_for(pilot, lambda: _row(screen_text(app), "9 ")[at] == "38%", "the report")


class MovedGridClient(GridFakeClient):
    """The grid job, swarm-wired, after fellow 8's cell 0.1 moved to stage 1 as its cell 2
    from step 6 (placement-cells step 7): placed [[0], [0, 1, 2]]."""

    def __init__(self) -> None:
        import attrs

        from swarm_core.contract.membership import MembershipChange
        from swarm_core.contract.rebalance import PeerMove

        super().__init__()
        job = self._jobs[-1]
        assert job.job_id == GRID_JOB and job.placement is not None
        p = job.placement.moved(0, 1, 1, 2)
        change = MembershipChange(step=6, epoch=1, members=[0, 1, 2], reason="rebalance",
                                  moved=PeerMove(at=5, source=0, cell=1, target=1, new_id=2))
        self._jobs[-1] = attrs.evolve(
            job, placement=p, fellows=p.fellows, membership=[change],
            topology=attrs.evolve(job.topology, wiring="swarm"))


async def test_after_a_move_the_watch_and_the_fellows_table_show_the_cells_now() -> None:
    client = MovedGridClient()
    app = _app(client)
    async with app.run_test(size=SIZE) as pilot:
        await _loaded(pilot, app, client)
        await pilot.pause()
        text = screen_text(app)
        for fid, cell in ((6, "s0/r0"), (7, "s1/r0"), (8, "s1/r2"), (9, "s1/r1")):
            assert _row(text, f"{fid} ")[3:5] == [GRID_JOB, cell], text
        app.watch_job(GRID_JOB)
        table = await _watch_table(pilot, app)
        await wait_for(pilot, lambda: table.row_count == 4, "a row per cell")
        await pilot.pause()
        text = screen_text(app)
        # By stage then id; the mover's row is its new cell's, 1.2 (the old 0.1 is gone).
        assert sorted(table.shown_keys) == ["0", "1", "2", "3"]
        assert _row(text, "8 ")[:4] == ["8", "dp-2", "1", "2"]
        assert _row(text, "9 ")[:4] == ["9", "dp-3", "1", "1"]
        assert "@6: f8 moved 0.1 -> 1.2 (rebalance)" in text
        assert all(len(line.rstrip()) <= 80 for line in text.splitlines())
