"""The console driven by a Pilot against a real leader on a loopback port, with fellow daemons
running in this process (the daemon's own code over real HTTP; only its torch warm-up is
skipped). Jobs are smoke jobs, except the launched sweep, which trains a tiny model for real."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest
from textual.command import CommandList, CommandPalette
from textual.widgets import Button, Input, Label, Select

from swarm_core.client import SwarmClient
from swarm_core.contract import JobMetrics, JobSubmit, SmokeTraining, Topology
from swarm_tui.app.app import SwarmApp
from swarm_tui.app.model import Change
from swarm_tui.app.screens.dialogs import (
    ConfirmDialog,
    ExportDialog,
    HelpScreen,
    SetSpeedDialog,
)
from swarm_tui.app.screens.fellows import FellowDetailScreen, FellowsScreen
from swarm_tui.app.screens.jobs import JobsScreen, JobWatchScreen
from swarm_tui.app.screens.launch import LaunchScreen
from swarm_tui.app.widgets.live_table import LiveTable
from tests.tui_support import (  # noqa: F401  (no_engine is a fixture)
    live_cluster,
    no_engine,
    screen_text,
    snapshot_configs,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("no_engine")
SIZE = (100, 30)


def all_ready(app: SwarmApp, n: int = 3) -> bool:
    fellows = app.model.fellows.values()
    return len(fellows) == n and all(f.status == "ready" for f in fellows)


async def fellows_listed(pilot: object, app: SwarmApp) -> None:
    """The three fellows are ready and the home table shows them."""
    await wait_for(pilot, lambda: all_ready(app), "three ready fellows")
    await wait_for(pilot, lambda: fellows_table(app).row_count == 3, "rows")


async def launch_confirmed(pilot: Any, app: SwarmApp) -> None:
    """``ctrl+s`` in the launcher, then ``y`` to the question it asks first (issue 36)."""
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "the launch question")
    await pilot.press("y")


def fellows_table(app: SwarmApp) -> LiveTable:
    return app.screen.query_one("#fellows-table", LiveTable)


def names_shown(app: SwarmApp) -> list[str]:
    table = fellows_table(app)
    return [app.model.fellows[int(k)].name for k in table.shown_keys]


async def test_table_fills_and_updates_in_place(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: all_ready(app), "three ready fellows")
            table = fellows_table(app)
            await wait_for(pilot, lambda: table.row_count == 3, "three rows")
            assert names_shown(app) == ["sim-0", "sim-1", "sim-2"]
            await pilot.press("down")
            assert table.cursor_key == "1"
            rows_before = {k: id(table.rows[k]) for k in table.rows}  # the Row objects
            seen, updates = app.model.events_seen, table.updates
            # Heartbeats (4 a second per fellow) and snapshots keep arriving...
            await wait_for(pilot, lambda: app.model.events_seen >= seen + 12, "heartbeats")
            await wait_for(pilot, lambda: app.snapshots >= 2, "a second snapshot")
            # ...and change cells in place: same rows, cursor where it was.
            assert table.updates > updates
            assert {k: id(table.rows[k]) for k in table.rows} == rows_before
            assert table.cursor_key == "1" and table.cursor_row == 1
            text = screen_text(app)
            assert "● live" in text and "sim-2" in text


async def test_set_speed_dialog_validates_then_reaches_the_fellow(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0)
        async with app.run_test(size=SIZE) as pilot:
            await fellows_listed(pilot, app)
            await pilot.press("down", "s")
            dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                    and app.screen, "the set-speed dialog")
            assert dialog.targets == [(1, "sim-1")]
            # Bad input: an inline error, the dialog stays, nothing is sent.
            dialog.query_one("#tx", Input).value = "fast"
            await pilot.press("enter")
            error = dialog.query_one("#error", Label)
            assert "tx Mbit/s: 'fast' is not a number" in str(error.render())
            assert app.screen is dialog
            dialog.query_one("#tx", Input).value = "-5"
            await pilot.press("enter")
            assert "tx Mbit/s: '-5' is out of range (0.001 to 1e+06;" in str(error.render())
            assert app.screen is dialog
            async with leader.client() as c:
                assert (await c.fellow(1)).link.tx_mbps is None
            # Good input: the dialog closes and the fellow's shaper takes the new limits.
            dialog.query_one("#tx", Input).value = "80"
            dialog.query_one("#rx", Input).value = "40"
            dialog.query_one("#latency", Input).value = "5"
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, FellowsScreen), "dialog closed")
            daemon = fellows.daemons[1]
            await wait_for(pilot, lambda: daemon.shaper.limits().tx_mbps == 80, "fellow shaped")
            limits = daemon.shaper.limits()
            assert (limits.tx_mbps, limits.rx_mbps, limits.latency_ms) == (80, 40, 5)
            # The fellow reports it back in its heartbeat; the table shows it.
            await wait_for(pilot, lambda: app.model.fellows[1].tx_limit == 80, "reported back")
            table = fellows_table(app)
            # (at 100 columns the limits give way to the rates: the chooser shows them)
            table.choose(("sel", "id", "name", "status", "tx_lim", "rx_lim", "lat"))
            await wait_for(pilot, lambda: table.get_cell("1", "tx_lim").plain == "80", "cell")
            assert table.get_cell("1", "rx_lim").plain == "40"
            assert table.get_cell("1", "lat").plain == "5"
            assert fellows.daemons[0].shaper.limits().tx_mbps is None


async def test_set_speed_on_marked_fellows_says_which_took_it(tmp_path: Path) -> None:
    """One of three marked fellows leaves while the dialog is open: the other two take the
    limits and the notices say which did; once it shows as released, the set is refused
    whole, before anything is sent."""
    async with live_cluster(tmp_path) as (leader, fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0)
        async with app.run_test(size=SIZE) as pilot:
            await fellows_listed(pilot, app)
            await pilot.press("space", "space", "space")
            assert app.screen.selected_ids() == [0, 1, 2]
            await pilot.press("s")
            dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                    and app.screen, "the set-speed dialog")
            async with leader.client() as c:
                assert await c.release([1]) == [1]
                # (The leader refuses it once its heartbeat says it is on its way out.)
                for _ in range(100):
                    if (await c.fellow(1)).status in ("released", "leaving"):
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("fellow 1 never reported its release")
            dialog.query_one("#tx", Input).value = "50"
            await pilot.press("enter")

            def notices() -> list[str]:
                return [n.message for n in app._notifications]

            await wait_for(pilot, lambda: any("refused" in m for m in notices()), "the notices")
            assert "set-speed tx 50 Mbit/s, rx unlimited sent to fellows 0, 2" in notices()
            assert any(m.startswith("set-speed tx 50 Mbit/s, rx unlimited: leader refused "
                                    "fellow 1 ") for m in notices()), notices()
            # (A fellow's link is what it reports back: its next heartbeat.)
            await wait_for(pilot, lambda: [app.model.fellows[i].tx_limit for i in (0, 2)]
                           == [50.0, 50.0], "fellows 0 and 2 shaped")
            assert fellows.daemons[1].shaper.limits().tx_mbps is None
            await wait_for(pilot, lambda: app.model.fellows[1].status == "released",
                           "shown released")
            await pilot.press("s")
            await pilot.pause(0.1)
            assert isinstance(app.screen, FellowsScreen)
            assert "set-speed: fellow 1 has left the cluster; nothing sent" in notices()


async def test_release_needs_confirmation(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0)
        async with app.run_test(size=SIZE) as pilot:
            await fellows_listed(pilot, app)
            # Mark sim-0 and sim-2 (space marks and moves down).
            await pilot.press("space", "down", "space")
            screen = app.screen
            assert isinstance(screen, FellowsScreen)
            assert screen.selected_ids() == [0, 2]
            assert fellows_table(app).get_cell("0", "sel").plain == "●"
            # Declined: nothing happens.
            await pilot.press("r")
            dialog = await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog)
                                    and app.screen, "the confirmation")
            assert "0 sim-0, 2 sim-2" in str(dialog.query_one(".dialog-body").render())
            await pilot.press("n")
            await wait_for(pilot, lambda: isinstance(app.screen, FellowsScreen), "declined")
            await pilot.pause(0.5)
            assert all(not t.done() for t in fellows.tasks)
            # Confirmed: those two are released and leave; the third stays.
            await pilot.press("r")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "confirmation")
            await pilot.press("y")
            await wait_for(pilot, lambda: fellows.tasks[0].done() and fellows.tasks[2].done(),
                           "released fellows to exit")
            await wait_for(pilot, lambda: app.model.fellows[0].status == "released"
                           and app.model.fellows[2].status == "released", "shown released")
            assert not fellows.tasks[1].done()
            assert app.model.fellows[1].status == "ready"
            # R releases everyone, also after a confirmation.
            await pilot.press("R")
            dialog = await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog)
                                    and app.screen, "confirmation")
            # (the two released already have left: one fellow to release)
            assert "Release ALL 1 fellow?" in str(dialog.query_one(".dialog-title").render())
            await pilot.press("y")
            await wait_for(pilot, lambda: fellows.tasks[1].done(), "the last fellow to exit")


async def test_filter_and_sort(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: all_ready(app), "three ready fellows")
            table = fellows_table(app)
            await wait_for(pilot, lambda: table.row_count == 3, "rows")
            await pilot.press("down", "down")
            assert table.cursor_key == "2"
            # `/` filters live by regex; the cursor stays on its fellow.
            await pilot.press("slash")
            await pilot.press(*"sim-[12]")
            await wait_for(pilot, lambda: names_shown(app) == ["sim-1", "sim-2"], "filtered")
            assert table.cursor_key == "2"
            # A bad regex says so and changes nothing.
            await pilot.press("(")
            bar_error = app.screen.query_one("#filter-error", Label)
            assert "not a regular expression" in str(bar_error.render())
            assert names_shown(app) == ["sim-1", "sim-2"]
            # So does one the engine cannot hold (it raised OverflowError through the app);
            # the filter stays the last that was one (without "}", a literal "{…").
            await pilot.press("backspace", *"|x{4294967296}")
            assert "not a regular expression" in str(bar_error.render())
            assert table.filter_text == "sim-[12]|x{4294967296"
            assert names_shown(app) == ["sim-1", "sim-2"]
            await pilot.press(*["backspace"] * len("|x{4294967296}"), "enter")
            assert table.has_focus
            # Rows that update while filtered stay filtered.
            seen = app.model.events_seen
            await wait_for(pilot, lambda: app.model.events_seen >= seen + 6, "heartbeats")
            assert names_shown(app) == ["sim-1", "sim-2"]
            await pilot.press("escape")
            await wait_for(pilot, lambda: table.row_count == 3, "filter cleared")
            assert table.cursor_key == "2"
            # `o` moves the sort to the next column (name), `O` reverses it.
            await pilot.press("o")
            assert table.sort_column == "name"
            await pilot.press("O")
            assert names_shown(app) == ["sim-2", "sim-1", "sim-0"]
            assert table.cursor_key == "2"
            # Clicking a header sorts by that column; clicking it again reverses.
            x = next(iter(table.columns.values())).get_render_width(table) + 1  # in "id"
            await pilot.click(LiveTable, offset=(x, 0))
            await wait_for(pilot, lambda: table.sort_column == "id", "sorted by id")
            assert names_shown(app) == ["sim-0", "sim-1", "sim-2"]
            await pilot.click(LiveTable, offset=(x, 0))
            await wait_for(pilot, lambda: table.sort_reverse, "reversed")
            assert names_shown(app) == ["sim-2", "sim-1", "sim-0"]


async def test_read_only_refuses_every_action(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, fellows):
        async with leader.client() as c:
            job = await c.submit(JobSubmit(name="queued", kind="smoke",
                                           training=SmokeTraining(steps=3), topology=Topology(9)))
        app = SwarmApp(leader.client(), refresh_s=1.0, read_only=True,
                       configs_dir=snapshot_configs(tmp_path))
        # Every notice as it came: the console's own expire after seconds, which a loaded
        # machine can spend between the first refusal and the check.
        told: list[str] = []
        notify = app.notify

        def noted(message: str, *args: Any, **kwargs: Any) -> None:
            told.append(message)
            notify(message, *args, **kwargs)

        app.notify = noted  # type: ignore[method-assign]
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: all_ready(app), "three ready fellows")
            await wait_for(pilot, lambda: "READ-ONLY" in screen_text(app), "the read-only badge")
            for key in ("s", "r", "R"):
                await pilot.press(key)
                await pilot.pause(0.1)
                assert isinstance(app.screen, FellowsScreen), key
            await pilot.press("2")
            await wait_for(pilot, lambda: isinstance(app.screen, JobsScreen)
                           and app.screen.table.row_count == 1, "the queue")
            await pilot.press("c")
            await pilot.pause(0.1)
            assert isinstance(app.screen, JobsScreen)
            await pilot.press("3")
            await wait_for(pilot, lambda: isinstance(app.screen, LaunchScreen), "launcher")
            assert app.screen.query_one("#launch-button", Button).disabled
            await pilot.press("ctrl+s")
            await pilot.pause(0.2)
            for what in ("set-speed", "release", "release all", "cancel", "launch"):
                assert f"read-only console: {what} is disabled" in told
            # The palette's entries are refused too.
            await pilot.press("1")
            await wait_for(pilot, lambda: isinstance(app.screen, FellowsScreen), "fellows")
            app.screen.action_set_speed()
            await pilot.pause(0.1)
            assert isinstance(app.screen, FellowsScreen)
        async with leader.client() as c:
            assert (await c.job(job.job_id)).state == "PENDING"
            assert [f.link.tx_mbps for f in await c.fellows()] == [None, None, None]
        assert all(not t.done() for t in fellows.tasks)


async def test_lost_leader_is_shown_retried_and_recovered(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=0.5)
        async with app.run_test(size=SIZE) as pilot:
            # (on screen, not only in the model: a redraw follows a change by flush_s)
            await fellows_listed(pilot, app)
            await wait_for(pilot, lambda: app.connection == "live", "live")
            await leader.stop()
            await wait_for(pilot, lambda: app.connection == "lost", "leader lost")
            await wait_for(pilot, lambda: "leader lost, retrying"
                           in screen_text(app).splitlines()[0], "the lost banner")
            assert fellows_table(app).row_count == 3  # the last known state stays on screen
            await leader.start()  # same port, same state directory
            await wait_for(pilot, lambda: app.connection == "live", "back to live")
            snapshots = app.snapshots
            await wait_for(pilot, lambda: app.snapshots > snapshots and all_ready(app),
                           "fresh data")
            await wait_for(pilot, lambda: "● live" in screen_text(app), "the live badge")


async def test_jobs_watch_launch_and_cancel(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0, configs_dir=snapshot_configs(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: all_ready(app), "three ready fellows")
            async with leader.client() as c:
                smoke = await c.submit(JobSubmit(
                    name="smoke", kind="smoke", training=SmokeTraining(steps=12, step_seconds=0.1),
                    topology=Topology(2)))
            await pilot.press("2")
            await wait_for(pilot, lambda: isinstance(app.screen, JobsScreen)
                           and smoke.job_id in app.screen.table.shown_keys, "the job listed")
            await pilot.press("enter")
            watch = await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                                   and app.screen, "the watch view")
            assert watch.job_id == smoke.job_id
            table = watch.query_one(LiveTable)
            await wait_for(pilot, lambda: table.row_count == 2, "its two fellows")
            await wait_for(pilot, lambda: app.model.jobs[smoke.job_id].info.state == "COMPLETED",
                           "the smoke job to finish", timeout=30)
            await wait_for(pilot, lambda: {table.get_cell(k, "step").plain
                                           for k in table.shown_keys} == {"12"}, "final steps")
            # The model updates before the next repaint; the terminal must catch up.
            await wait_for(pilot, lambda: "COMPLETED" in screen_text(app), "COMPLETED on screen")
            await pilot.press("escape")
            # Launch: a bad field is refused by the leader and shown; a good one is queued.
            await pilot.press("3")
            launch = await wait_for(pilot, lambda: isinstance(app.screen, LaunchScreen)
                                    and app.screen, "launcher")
            launch.query_one("#source", Select).value = "profiles"
            await wait_for(pilot, lambda: launch.query_one("#row-stages").display,
                           "the profile form")
            launch.query_one("#stages", Input).value = "x"
            await pilot.pause(0.1)
            assert "not a whole number" in str(launch.query_one("#preview").render())
            launch.query_one("#stages", Input).value = "9"  # more stages than 4 layers allow
            await launch_confirmed(pilot, app)
            await wait_for(pilot, lambda: "$.topology" in str(
                launch.query_one("#launch-error").render()), "the leader's 400 shown")
            assert isinstance(app.screen, LaunchScreen)
            launch.query_one("#stages", Input).value = "5"  # valid, but only 3 fellows here
            launch.query_one("#name", Input).value = "queued-train"
            # A second ctrl+s while the first launch is on its way queues nothing twice. The
            # leader's answer is held at a gate the test opens, so "in between" is not a race.
            submit = app.client.submit
            gate = asyncio.Event()

            async def held_submit(req: JobSubmit) -> Any:
                await gate.wait()
                return await submit(req)

            app.client.submit = held_submit  # type: ignore[method-assign]
            # Who leaves the launcher before the answer is not pulled back to the queue.
            launch.query_one("#name", Input).value = "left-behind"
            await launch_confirmed(pilot, app)
            await pilot.press("1")
            assert isinstance(app.screen, FellowsScreen)
            gate.set()
            await wait_for(pilot, lambda: any("submitted" in n.message
                                              for n in app._notifications), "the notice")
            assert isinstance(app.screen, FellowsScreen)
            gate.clear()
            await pilot.press("3")
            await wait_for(pilot, lambda: app.screen is launch, "the launcher again")
            launch.query_one("#name", Input).value = "queued-train"
            # A swarm of 2 x 2 under DiLoCo, over the profile's sync.
            launch.query_one("#stages", Input).value = "2"
            launch.query_one("#replicas", Input).value = "2"
            launch.query_one("#sync", Select).value = "diloco"
            launch.query_one("#inner_steps", Input).value = "3"
            await pilot.pause(0.1)
            assert launch.plan.ok and launch.plan.bodies[0]["training"]["sync"]["mode"] \
                == "diloco"
            await launch_confirmed(pilot, app)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: any("a launch is under way" in n.message
                                              for n in app._notifications), "the refusal")
            gate.set()
            await wait_for(pilot, lambda: isinstance(app.screen, JobsScreen), "the queue view")
            async with leader.client() as c:
                names = [j.name for j in await c.jobs()]
                assert names.count("queued-train") == 1 and names.count("left-behind") == 1
            jobs = app.screen
            queued = next(v for v in app.model.jobs.values() if v.info.name == "queued-train")
            assert queued.info.state == "PENDING" and queued.info.kind == "train"
            assert (queued.info.topology.stages, queued.info.topology.replicas) == (2, 2)
            sync = queued.info.training.sync
            assert (sync.mode, sync.inner_steps) == ("diloco", 3)
            await wait_for(pilot, lambda: jobs.selected_job == queued.job_id, "cursor on it")
            # c cancels it after a confirmation.
            await pilot.press("c")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "confirmation")
            await pilot.press("y")
            await wait_for(pilot, lambda: app.model.jobs[queued.job_id].info.state
                           == "CANCELLED", "cancelled")
        async with leader.client() as c:
            assert (await c.job(queued.job_id)).state == "CANCELLED"


async def test_the_queue_view_holds_a_window_of_a_long_history(tmp_path: Path, monkeypatch
                                                                 ) -> None:
    """A leader holding thousands of jobs: the console lists the next pending ones in line
    and the latest to finish (a window), counts the rest, and keeps a watched job that falls
    out of the window."""
    import swarm_tui.app.app as app_module

    monkeypatch.setattr(app_module, "JOB_WINDOW", 2)
    async with live_cluster(tmp_path, n=0) as (leader, _fellows):
        async with leader.client() as c:
            jobs = [(await c.submit(JobSubmit(name=f"s{i}", kind="smoke",
                                              topology=Topology(1)))).job_id for i in range(8)]
            for jid in (jobs[5], jobs[0], jobs[6], jobs[1], jobs[7]):
                await c.cancel(jid)
        app = SwarmApp(leader.client(), refresh_s=None)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.snapshots >= 1, "a snapshot")
            # pending in line: 2, 3 (4 left out); finished last: 7, 1 (6, 0, 5 left out)
            assert set(app.model.jobs) == {jobs[2], jobs[3], jobs[7], jobs[1]}
            assert app.model.job_counts()["PENDING"] == 3
            await pilot.press("2")
            await wait_for(pilot, lambda: "+4 not shown" in screen_text(app), "the count")
            assert "0 running · 3 queued" in screen_text(app)
            app.watch_job(jobs[1])
            await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen), "the watch")
            async with leader.client() as c:
                await c.cancel(jobs[2])
                await c.cancel(jobs[3])  # jobs[1] is no longer among the latest two finished
            n = app.snapshots
            app.refresh_now()
            await wait_for(pilot, lambda: app.snapshots > n, "a refresh")
            assert set(app.model.jobs) == {jobs[4], jobs[3], jobs[2], jobs[1]}
            await pilot.pause()
            assert f"{jobs[1]}: not known" not in screen_text(app)


async def test_fellow_detail_and_palette(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0)
        async with app.run_test(size=SIZE) as pilot:
            await fellows_listed(pilot, app)
            await pilot.press("down", "enter")
            detail = await wait_for(pilot, lambda: isinstance(app.screen, FellowDetailScreen)
                                    and app.screen, "the detail view")
            assert detail.fellow_id == 1
            await wait_for(pilot, lambda: "sim-1" in screen_text(app), "its name")
            # The detail view follows events: ages and samples move on.
            tps = len(app.model.fellows[1].tps_hist)
            await wait_for(pilot, lambda: len(app.model.fellows[1].tps_hist) > tps + 2, "samples")
            await wait_for(pilot, lambda: "registered" in screen_text(app)
                           or "recent events" in screen_text(app), "the events pane")
            await pilot.press("escape")
            await wait_for(pilot, lambda: isinstance(app.screen, FellowsScreen), "back")
            # "view: fellows" (key 1) from the detail view goes back to the fellows view too;
            # the palette opens over the help screen (which says it does).
            for key, screen, what in [("enter", FellowDetailScreen, "detail"),
                                      ("1", FellowsScreen, "back by 1"),
                                      ("question_mark", HelpScreen, "the help"),
                                      ("ctrl+p", CommandPalette, "palette over the help"),
                                      ("escape", HelpScreen, "help again"),
                                      ("escape", FellowsScreen, "fellows")]:
                await pilot.press(key)
                await wait_for(pilot, lambda s=screen: isinstance(app.screen, s), what)
            # The command palette runs "group: action" entries.
            await pilot.press("ctrl+p")
            palette = await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette)
                                     and app.screen, "the command palette")
            palette.query_one(Input).value = "fellows: sort by name"
            await wait_for(pilot, lambda: palette.query_one(CommandList).option_count, "hits")
            await pilot.press("down", "enter")
            table = fellows_table(app)
            await wait_for(pilot, lambda: table.sort_column == "name", "sorted by name")
            app.publish(Change(fellows={0, 1, 2}))
            assert table.sort_column == "name"


async def test_the_log_view_tails_a_remote_fellows_own_log(tmp_path: Path) -> None:
    """A fellow not of the local cluster: its own log lines come through the leader, and
    new ones follow while the view is open."""
    import logging

    from swarm_tui.app.screens.record import FellowLogScreen

    logging.getLogger("swarm.fellow").setLevel(logging.INFO)  # (the daemon's CLI sets it)
    try:
        async with live_cluster(tmp_path, n=2) as (leader, fellows):
            app = SwarmApp(leader.client(), refresh_s=1.0)
            async with app.run_test(size=SIZE) as pilot:
                await wait_for(pilot, lambda: all_ready(app, 2), "two ready fellows")
                await wait_for(pilot, lambda: fellows_table(app).row_count == 2, "rows")
                await pilot.press("down", "l")
                await wait_for(pilot, lambda: isinstance(app.screen, FellowLogScreen),
                               "the log view")
                await wait_for(pilot, lambda: "registered as fellow 1 (sim-1)" in
                               screen_text(app), "sim-1's own log line, through the leader")
                text = app.screen.text
                assert "its own log, through the leader (last " in text
                assert "(sim-0)" not in text.split("its own log")[1]  # (sim-1's ring only)
                # Tailed live: a line sim-1 logs now shows up within a refresh or two.
                daemon = fellows.daemons[1]
                daemon.log_ring.add("a fresh line from sim-1")
                await wait_for(pilot, lambda: "a fresh line from sim-1" in screen_text(app),
                               "the new line")
    finally:
        logging.getLogger("swarm.fellow").setLevel(logging.NOTSET)


async def test_a_refusing_leader_is_shown(tmp_path: Path) -> None:
    async with live_cluster(tmp_path, n=1) as (leader, _fellows):
        app = SwarmApp(SwarmClient(leader.url, "not-the-token"), refresh_s=0.5)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.connection == "refused", "refused")
            line = screen_text(app).splitlines()[0]
            assert "leader refused: missing or wrong bearer token" in line
            assert not app.model.fellows


async def test_launch_an_experiment_sweep(tmp_path: Path) -> None:
    """The launcher's default source: an experiment config, previewed as the runs it expands
    to, launched as `swarm sweep` would (queued up front, artifacts written as runs end)."""
    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0, configs_dir=snapshot_configs(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: all_ready(app), "three ready fellows")
            await pilot.press("3")
            launch = await wait_for(pilot, lambda: isinstance(app.screen, LaunchScreen)
                                    and app.screen, "launcher")
            assert launch.query_one("#source", Select).value == "experiment"
            assert launch.query_one("#config", Select).value == "exp_tiny_sweep_v1.json"
            assert not launch.query_one("#row-stages").display  # the config says it all
            await wait_for(pilot, lambda: "preview: 2 runs" in screen_text(app), "the preview")
            assert [r.model.compression for r in launch.plan.runs] == ["none", "fixed_int8"]
            await launch_confirmed(pilot, app)
            await wait_for(pilot, lambda: isinstance(app.screen, JobsScreen), "the queue view")
            sweep = await wait_for(pilot, lambda: len(runs := [
                v for v in app.model.jobs.values() if "exp_tiny_sweep_v1" in v.info.name]) == 2
                and runs, "both runs queued")
            assert all(v.info.kind == "train" for v in sweep)
            await wait_for(pilot, lambda: all(app.model.jobs[v.job_id].info.state == "COMPLETED"
                                              for v in sweep), "both runs to finish", timeout=90)
            # The console kept the runs' artifacts, as the sweep command does.
            runs_dir = tmp_path / "runs"
            await wait_for(pilot, lambda: len(list(runs_dir.glob("*/metrics_summary.json"))) == 2,
                           "the run artifacts", timeout=20)
            for summary_path in runs_dir.glob("*/metrics_summary.json"):
                summary = json.loads(summary_path.read_text())
                assert summary["status"] == "COMPLETED" and summary["steps_recorded"] == 3
                manifest = json.loads((summary_path.parent / "manifest.json").read_text())
                assert manifest["experiment"] == "exp_tiny_sweep_v1"
                assert (summary_path.parent / "train_progress.ndjson").read_text().count("\n") == 3
            await wait_for(pilot, lambda: any("finished: 2/2 completed" in n.message
                                              for n in app._notifications), "the end notice")


async def test_export_the_view_as_shown(tmp_path: Path) -> None:
    """`e` writes the table's rows as shown (filtered, sorted) with values, not display text."""
    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0, read_only=True)  # not a cluster change
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: all_ready(app), "three ready fellows")
            table = fellows_table(app)
            await wait_for(pilot, lambda: table.row_count == 3, "rows")
            await pilot.press("slash", *"sim-[12]", "enter")
            await wait_for(pilot, lambda: names_shown(app) == ["sim-1", "sim-2"], "filtered")
            await pilot.press("O")  # reverse the sort: sim-2 first
            await wait_for(pilot, lambda: names_shown(app) == ["sim-2", "sim-1"], "reversed")
            await pilot.press("e")
            dialog = await wait_for(pilot, lambda: isinstance(app.screen, ExportDialog)
                                    and app.screen, "the export dialog")
            path_input = dialog.query_one("#path", Input)
            assert path_input.value.startswith("swarm-fellows-") and \
                path_input.value.endswith(".csv")
            # A name without a known extension is refused there, and nothing is written.
            path_input.value = str(tmp_path / "fellows.txt")
            await pilot.press("enter")
            error = dialog.query_one("#error", Label)
            await wait_for(pilot, lambda: "must end in .csv or .json" in str(error.render()),
                           "the error")
            assert not (tmp_path / "fellows.txt").exists()
            path_input.value = str(tmp_path / "fellows.json")
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, FellowsScreen), "closed")
            rows = json.loads((tmp_path / "fellows.json").read_text())
            assert [r["name"] for r in rows] == ["sim-2", "sim-1"]
            assert [r["id"] for r in rows] == [2, 1]  # values, not text
            assert all(r["status"] == "ready" and "sel" not in r for r in rows)
            assert any("exported 2 rows" in n.message for n in app._notifications)
            # The jobs view exports the same way, as CSV.
            async with leader.client() as c:
                job = await c.submit(JobSubmit(name="queued", kind="smoke",
                                               training=SmokeTraining(steps=3),
                                               topology=Topology(9)))
            await pilot.press("2")
            await wait_for(pilot, lambda: isinstance(app.screen, JobsScreen)
                           and app.screen.table.row_count == 1, "the queue")
            await pilot.press("e")
            dialog = await wait_for(pilot, lambda: isinstance(app.screen, ExportDialog)
                                    and app.screen, "the export dialog")
            dialog.query_one("#path", Input).value = str(tmp_path / "jobs.csv")
            await pilot.press("enter")
            await wait_for(pilot, lambda: (tmp_path / "jobs.csv").exists(), "the CSV")
            lines = (tmp_path / "jobs.csv").read_text().splitlines()
            header = lines[0].split(",")
            assert "id" in header and "state" in header and len(lines) == 2
            assert job.job_id in lines[1] and "PENDING" in lines[1]


async def test_keymap_remaps_keys(tmp_path: Path) -> None:
    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=1.0, keymap={"fellows.release": "x"})
        async with app.run_test(size=SIZE) as pilot:
            await fellows_listed(pilot, app)
            await pilot.press("r")  # no longer bound
            await pilot.pause(0.2)
            assert isinstance(app.screen, FellowsScreen)
            await pilot.press("x")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "the confirmation")
            await pilot.press("n")
            await wait_for(pilot, lambda: isinstance(app.screen, FellowsScreen), "declined")
            await pilot.press("question_mark")
            await wait_for(pilot, lambda: "fellows.release" in screen_text(app), "help")
            line = next(ln for ln in screen_text(app).splitlines() if "fellows.release " in ln)
            assert re.search(r"\sx\s+Release\s+fellows\.release\s", line), line


async def test_the_watch_view_says_when_a_running_jobs_link_was_set(tmp_path: Path) -> None:
    """A set-speed during a run reaches the job's record at the leader, and the job's watch
    view says so under its summary: at which step, which fellow, what link."""
    from textual.widgets import Static

    async with live_cluster(tmp_path) as (leader, _fellows):
        app = SwarmApp(leader.client(), refresh_s=0.5, configs_dir=snapshot_configs(tmp_path))
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: all_ready(app), "three ready fellows")
            async with leader.client() as c:
                job = await c.submit(JobSubmit(
                    name="slow", kind="smoke", training=SmokeTraining(steps=200, step_seconds=0.1),
                    topology=Topology(2)))
                await wait_for(pilot, lambda: app.model.jobs.get(job.job_id) is not None
                               and app.model.jobs[job.job_id].info.last_step >= 2, "steps")
                fid = job.fellows[1]
                from swarm_core.protocol import SetSpeedRequest

                answer = await c.set_speed(fid, SetSpeedRequest(tx_mbps=8.0, latency_ms=40))
                assert answer["job_id"] == job.job_id
            app.watch_job(job.job_id)
            await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                           and app.screen.query("#job-summary"), "the watch view")

            def summary() -> str:
                return str(app.screen.query_one("#job-summary", Static).render())

            await wait_for(pilot, lambda: "link set mid-run: @" in summary(),
                           "the change in the summary", timeout=10)
            text = summary()
            assert f"fellow {fid} tx 8 Mbit/s, rx unlimited, +40 ms" in text
            async with leader.client() as c:
                await c.cancel(job.job_id)


async def test_the_watch_view_shows_a_finished_runs_evaluation(tmp_path: Path) -> None:
    """A completed train job's validation loss and perplexity sit beside its loss."""
    import attrs
    from textual.widgets import Static

    from tests.tui_support import FakeClient, frozen_clock

    client = FakeClient()
    client._jobs[1] = attrs.evolve(client._jobs[1], metrics=JobMetrics(eval_loss=2.0))
    app = SwarmApp(client, clock=frozen_clock, refresh_s=None, tick_s=None, flush_s=0,
                   configs_dir=snapshot_configs(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshots >= 1, "the fixed data")
        app.watch_job("job-000002")
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                       and app.screen.query("#job-summary"), "the watch view")
        assert app.screen.query_one("#watch-table", LiveTable).row_count == 2

        def summary() -> str:
            return str(app.screen.query_one("#job-summary", Static).render())

        await wait_for(pilot, lambda: "eval 2.0000 (perplexity 7.39)" in summary(),
                       "the evaluation in the summary")


async def test_the_launcher_opens_with_nothing_to_pick(tmp_path: Path) -> None:
    """A configs folder with no profiles leaves the pick lists empty (a crash before: an
    empty Select was given Select.BLANK); launching says there is nothing to launch."""
    from tests.tui_support import FakeClient, frozen_clock

    client = FakeClient()
    app = SwarmApp(client, clock=frozen_clock, refresh_s=None, tick_s=None, flush_s=0,
                   configs_dir=tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.snapshots >= 1, "the fixed data")
        await pilot.press("3")
        await wait_for(pilot, lambda: isinstance(app.screen, LaunchScreen), "the launcher")
        assert app.screen.query_one("#model", Select).value is Select.NULL
        await pilot.press("ctrl+s")
        await pilot.pause(0.1)
        assert isinstance(app.screen, LaunchScreen)
        from textual.widgets import Static

        assert "nothing to launch" in str(app.screen.query_one("#launch-error", Static).render())
        assert client.calls == []
