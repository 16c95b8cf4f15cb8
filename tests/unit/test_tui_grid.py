"""The console shows a job's stages x replicas grid: the watch view has one row per cell with
its stage and replica and its group's sync, the fellows table names each fellow's cell; both
at 80 columns. Against the fixed-data client with a 2 x 2 job (in process, cheap)."""

from __future__ import annotations

from swarm_tui.app.app import SwarmApp
from swarm_tui.app.screens.jobs import JobWatchScreen
from swarm_tui.app.widgets.live_table import LiveTable
from tests.tui_support import (
    GRID_JOB,
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
        # and the loss, the last stage's, give way).
        assert table.shown_keys == ["0", "2", "1", "3"]
        assert table.visible == ["id", "name", "stage", "replica", "step", "tps", "wait",
                                 "sync", "sync_wait", "hb"]
        text = screen_text(app)
        assert all(len(line.rstrip()) <= 80 for line in text.splitlines())
        assert _row(text, "fellow") == ["fellow", "name", "stage▲", "rep", "step", "tok/s",
                                        "wait", "sync", "swait", "hb"]
        # The leader's figures of each cell (what a console opened mid-run has)...
        assert _row(text, "6 ") == ["6", "dp-0", "0", "0", "40", "900", "10%", "293.0K",
                                    "20%", "0s"]
        assert _row(text, "8 ") == ["8", "dp-2", "0", "1", "40", "920", "10%", "293.0K",
                                    "30%", "0s"]
        assert _row(text, "9 ")[4:9] == ["40", "930", "20%", "585.9K", "30%"]
        # ... then replica 1 of stage 1's newest report.
        app.apply_event(grid_metric((app.model.last_seq or 0) + 1))
        await wait_for(pilot, lambda: _row(screen_text(app), "9 ")[4] == "41", "the report")
        assert _row(screen_text(app), "9 ") == ["9", "dp-3", "1", "1", "41", "950", "25%",
                                                "2.4M", "50%", "0s"]
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
    """Replica 1 of the 2 x 2 job left at step 31: at 120 columns its two rows say "left"
    where the others say their fellow's status, and the job's summary names the change."""
    import attrs

    from swarm_core.contract import MembershipChange

    client = GridFakeClient()
    client._jobs[-1] = attrs.evolve(
        client._jobs[-1], members=[0],
        membership=[MembershipChange(step=31, epoch=1, members=[0], left=[1])])
    app = _app(client)
    async with app.run_test(size=(120, 24)) as pilot:
        await _grid_watch(pilot, app, client)
        await pilot.pause()
        text = screen_text(app)
        assert "@31: replica(s) 1 left" in text
        status = {row[0]: row[4] for row in (_row(text, f"{f} ") for f in (6, 7, 8, 9))}
        assert status == {"6": "busy", "7": "busy", "8": "left", "9": "left"}


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
