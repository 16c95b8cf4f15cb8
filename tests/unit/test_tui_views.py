"""The console's views against a fake leader, in process (cheap): what they show and what the
keys do, for the points of the console's second round (issue 24)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
from textual import events
from textual.widgets import Input

from swarm_core.client import ApiError
from swarm_core.protocol import SetSpeedRequest
from swarm_tui.app.app import SwarmApp
from swarm_tui.app.screens.dialogs import SetSpeedDialog
from swarm_tui.app.screens.jobs import JobWatchScreen
from swarm_tui.app.widgets.live_table import LiveTable
from swarm_tui.app.widgets.status import StatusBar
from tests.tui_support import T0, FakeClient, frozen_clock, screen_text, wait_for

SIZE = (100, 30)


def make_app(client: FakeClient, **kw: object) -> SwarmApp:
    return SwarmApp(client, clock=frozen_clock, refresh_s=None, tick_s=None, flush_s=0,
                    **kw)  # type: ignore[arg-type]


async def loaded(pilot: object, app: SwarmApp, client: FakeClient) -> None:
    await wait_for(pilot, lambda: app.snapshots >= 1
                   and app.model.events_seen >= client.expected_events, "the fixed data")


def metric(seq: int, step: int, loss: float) -> dict[str, object]:
    return {"seq": seq, "ts": T0, "type": "metric", "data": {
        "job_id": "job-000002", "fellow_id": 1, "stage": 1, "step": step, "loss": loss,
        "tokens_per_s": 1800.0, "state": "RUNNING", "metrics": {}}}


async def test_the_loss_curve_is_the_jobs_whole_history_through_refreshes(tmp_path: Path
                                                                           ) -> None:
    client = FakeClient()
    history = [[float(s), 5.0 - s / 100] for s in range(1, 207)]  # 206 points, as recorded
    client._jobs = [attrs.evolve(j, loss_history=history, last_step=206)
                    if j.job_id == "job-000002" else j for j in client._jobs]
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        app.watch_job("job-000002")
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen), "the watch")
        want = "loss curve: 206 points, first 4.990"
        await wait_for(pilot, lambda: want in screen_text(app), "the whole history")
        # Snapshots (the list route has no history) and live metrics: the curve stays whole.
        for _ in range(2):
            n = app.snapshots
            app.refresh_now()
            await wait_for(pilot, lambda n=n: app.snapshots > n, "a refresh")
        await pilot.pause()
        assert want in screen_text(app)
        app.apply_event(metric((app.model.last_seq or 0) + 1, 207, 2.9))
        await pilot.pause()
        assert "loss curve: 207 points, first 4.990" in screen_text(app)


async def test_a_finished_job_opened_in_a_fresh_console_shows_its_curve(tmp_path: Path
                                                                         ) -> None:
    client = FakeClient()
    history = [[float(s), 4.0 - s / 100] for s in range(1, 6)]
    client._jobs = [attrs.evolve(j, loss_history=history) if j.job_id == "job-000004" else j
                    for j in client._jobs]
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        app.watch_job("job-000004")
        await wait_for(pilot, lambda: "job-000004" in client.fetched, "the job fetched")
        await wait_for(pilot, lambda: "loss curve: 5 points, first 3.990" in screen_text(app),
                       "the finished job's curve")
        app.refresh_now()
        await pilot.pause(0.2)
        assert "loss curve: 5 points" in screen_text(app)
        assert "no losses reported yet" not in screen_text(app)


def burst(app: SwarmApp, *keys: str) -> None:
    """Keys as a terminal delivers a burst or a fast typist over SSH: all queued at once,
    none waiting for the one before it to be handled (Pilot.press waits between keys)."""
    # (the characters Textual's xterm parser gives these keys; named keys of an escape
    # sequence, such as home or left, have none)
    chars = {"tab": "\t", "enter": "\r", "backspace": "\x7f", "slash": "/", "escape": "\x1b"}
    for key in keys:
        event = events.Key(key, chars.get(key, key if len(key) == 1 else None))
        event.set_sender(app)
        app._driver.send_message(event)  # type: ignore[union-attr]


async def test_keys_typed_in_a_burst_reach_the_fields_they_were_typed_into() -> None:
    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("down", "down", "s")  # fellow 2, no limits yet
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                and app.screen, "the set-speed dialog")
        burst(app, "5", "tab", "6", "tab", "7")
        await pilot.pause(0.2)
        # (a field reached by tab has its text selected: the 7 replaces the latency's 0)
        assert [dialog.query_one(f"#{f}", Input).value for f in ("tx", "rx", "latency")] == \
            ["5", "6", "7"]
        burst(app, "enter")
        await wait_for(pilot, lambda: client.calls, "the request")
        (what, (fid, req)), = client.calls
        assert (what, fid, req.tx_mbps, req.rx_mbps, req.latency_ms) == \
            ("set_speed", 2, 5.0, 6.0, 7.0)


async def test_the_set_speed_dialogs_slowdown_reaches_the_request() -> None:
    """Issue 34 point 2: the dialog's fourth field is the emulated compute slowdown; left
    empty it is not sent (unchanged). Typed over the link fields as they were filled in, it
    goes alone: the link is not sent (a torch job's fellow refuses a link set)."""
    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("down", "down", "s")  # fellow 2, no limits yet
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                and app.screen, "the set-speed dialog")
        dialog.query_one("#slowdown", Input).value = "4"
        burst(app, "enter")
        await wait_for(pilot, lambda: client.calls, "the request")
        (what, (fid, req)), = client.calls
        assert (what, fid, req.tx_mbps, req.slowdown) == ("set_speed", 2, None, 4.0)
        assert client.speed_links == [False]


# The leader's answer to a link set on a fellow of a running torch job (swarm_core/leader/routes.py)
UNSHAPED = ("fellow 0 runs job-000002 on the torch transport, whose links are unshaped (gloo's "
            "sockets are not the app's): a link setting would change nothing; a slowdown still "
            "applies")


class TorchJobClient(FakeClient):
    """As the leader, for a job on the torch transport (fellows 0 and 1 run it): a link set on
    its fellows answers 409 ``unshaped_transport``; a slowdown alone is taken."""

    async def set_speed(self, fellow_id: int, req: SetSpeedRequest, *,
                        link: bool = True) -> dict[str, Any]:
        if link and fellow_id in (0, 1):
            raise ApiError(409, "unshaped_transport", UNSHAPED)
        return await super().set_speed(fellow_id, req, link=link)


async def test_a_link_set_on_a_torch_jobs_fellow_shows_the_leaders_refusal() -> None:
    """The torch transport is unshaped: the leader refuses a link set on its fellows (409
    ``unshaped_transport``). The console says so in the leader's words, in one notice (no
    traceback, the console carries on); a slowdown typed over the link as filled in goes
    alone (the link is not sent), so the leader takes it."""
    client = TorchJobClient()
    app = make_app(client)
    async with app.run_test(size=SIZE, notifications=True) as pilot:  # (toasts drawn)
        await loaded(pilot, app, client)
        await pilot.press("s")  # fellow 0 (gpu-a): 80/80 +20 ms
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                and app.screen, "the set-speed dialog")
        dialog.query_one("#tx", Input).value = "40"
        await pilot.press("enter")

        def notices() -> list[tuple[str, str]]:
            return [(n.message, n.severity) for n in app._notifications]

        await wait_for(pilot, notices, "the notice")
        assert notices() == [("set-speed tx 40 Mbit/s, rx 80 Mbit/s, +20 ms: leader refused "
                              + UNSHAPED, "error")]
        assert client.calls == [] and app.is_running
        assert not isinstance(app.screen, SetSpeedDialog)
        await wait_for(pilot, lambda: "leader refused fellow 0 runs job-000002"
                       in " ".join(screen_text(app).split()), "the notice shown")
        # The slowdown alone: the leader takes it.
        app.clear_notifications()
        await pilot.press("s")
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                and app.screen, "the dialog again")
        dialog.query_one("#slowdown", Input).value = "3"
        await pilot.press("enter")
        await wait_for(pilot, lambda: client.calls, "the request")
        (what, (fid, req)), = client.calls
        assert (what, fid, req.slowdown, client.speed_links) == ("set_speed", 0, 3.0, [False])
        await wait_for(pilot, notices, "the notice")
        assert notices() == [("set-speed slowdown 3x (emulated) sent to fellow 0",
                              "information")]


async def test_editing_keys_in_a_burst_apply_in_the_order_they_were_typed() -> None:
    """Issue 36 point 8: a backspace is a binding of the input, which Textual ran only once
    the key had bubbled up to the app, after the characters typed behind it (and, behind a
    priority tab, in the next field): ``55 ⌫ 0 tab 6 enter`` sent tx 550, rx unlimited."""
    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("down", "down", "s")  # fellow 2, no limits yet
        await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog), "the dialog")
        burst(app, "5", "5", "backspace", "0", "tab", "6", "enter")
        await wait_for(pilot, lambda: client.calls, "the request")
        (what, (fid, req)), = client.calls
        assert (what, fid, req.tx_mbps, req.rx_mbps) == ("set_speed", 2, 50.0, 6.0)
        await wait_for(pilot, lambda: not isinstance(app.screen, SetSpeedDialog), "closed")
        # The filter: `local-55 ⌫ 4` filters on local-54; the cursor keys move in order too,
        # and the keys behind the "/" that opens it reach it (they went to the table).
        burst(app, "slash", *"local-55", "backspace", "4", "home", "x", "end", "left", "y")
        table = app.screen.query_one(LiveTable)
        await wait_for(pilot, lambda: table.filter_text == "xlocal-5y4", "the filter")
        await pilot.pause(0.1)
        assert table.filter_text == "xlocal-5y4"
        burst(app, "slash", "enter")  # ("/" in the filter is typed: it is a regex's)
        await wait_for(pilot, lambda: table.filter_text == "xlocal-5y/4", "typed")


def idle_heartbeat(seq: int, ts: float) -> dict[str, object]:
    """Fellow 5 (tx limited to 10 Mbit/s) heartbeating with its counters standing still."""
    return {"seq": seq, "ts": ts, "type": "fellow.heartbeat", "data": {
        "fellow_id": 5, "name": "cpu-f", "status": "ready", "job_id": None, "step": 0,
        "loss": None, "tokens_per_s": 0.0,
        "link": {"tx_mbps": 10.0, "rx_mbps": None, "latency_ms": 0.0},
        "counters": {"control_tx": 1, "control_rx": 1, "data_tx": 0, "data_rx": 0}}}


def test_link_plots_are_scaled_to_the_limit() -> None:
    from swarm_tui.app.widgets.graph import graph_top

    assert graph_top(80.0, [0.0, 12.0]) == 80.0
    assert graph_top(None, [0.0]) == 1.0  # an unlimited idle link: the floor
    assert graph_top(10.0, [14.0]) == 14.0  # a burst over the limit raises the top
    # (an idle link drawn along the bottom: tests/unit/test_tui_plots.py)


async def test_the_jobs_sort_says_what_orders_the_rows() -> None:
    from swarm_tui.app.screens.jobs import JobsScreen
    from swarm_tui.app.widgets.live_table import LiveTable

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(160, 30)) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("2")
        table = await wait_for(pilot, lambda: isinstance(app.screen, JobsScreen)
                               and app.screen.query_one(LiveTable), "the jobs view")
        await wait_for(pilot, lambda: table.row_count == 4, "four jobs")
        # The default order (running, the queue, then the history newest first) is by state.
        assert table.shown_keys == ["job-000002", "job-000003", "job-000001", "job-000004"]
        assert "sort state▲" in screen_text(app)
        table.set_sort("id", reverse=False)
        app.screen.query_one(StatusBar).update_status()
        await pilot.pause()
        assert table.shown_keys == ["job-000001", "job-000002", "job-000003", "job-000004"]
        assert "sort job▲" in screen_text(app)


async def test_a_view_key_goes_to_the_view_not_to_a_screen_left_open_over_it() -> None:
    from swarm_tui.app.screens.fellows import FellowDetailScreen, FellowsScreen
    from swarm_tui.app.screens.jobs import JobsScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, FellowDetailScreen), "a detail")
        await pilot.press("2")
        await wait_for(pilot, lambda: isinstance(app.screen, JobsScreen), "the jobs view")
        await pilot.press("enter")  # a job's watch, left open too
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen), "a watch")
        await pilot.press("1")
        await wait_for(pilot, lambda: app.current_mode == "fellows", "the fellows mode")
        await pilot.pause()
        assert type(app.screen) is FellowsScreen
        await pilot.press("2")
        await wait_for(pilot, lambda: app.current_mode == "jobs", "the jobs mode")
        await pilot.pause()
        assert type(app.screen) is JobsScreen


async def test_release_all_counts_only_the_fellows_still_in_the_cluster() -> None:
    from swarm_tui.app.screens.dialogs import ConfirmDialog

    client = FakeClient()  # six fellows, one of them released
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("R")
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog)
                                and app.screen, "the confirmation")
        assert dialog.title_text == "Release ALL 5 fellows?"


def test_a_fellow_long_silent_after_leaving_shows_as_left() -> None:
    from swarm_tui.app.cells import fellow_cells
    from swarm_tui.app.model import ClusterModel
    from tests.tui_support import _fellow

    model = ClusterModel(lambda: T0)
    model.apply_fellows([_fellow(7, "old", "leaving", age=600.0),
                         _fellow(8, "going", "leaving", age=1.0)])
    assert fellow_cells(model, model.fellows[7], False)["status"].plain == "left"
    assert fellow_cells(model, model.fellows[8], False)["status"].plain == "leaving"


async def test_the_top_bar_keeps_the_leader_and_its_state_at_80_columns() -> None:
    from tests.unit.test_tui_cluster import DeadLeader

    app = SwarmApp(DeadLeader(), leader_url="http://127.0.0.1:8765", clock=frozen_clock,
                   refresh_s=None, tick_s=None, flush_s=0)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.connection == "lost", "the leader lost")
        await pilot.pause()
        top = screen_text(app).splitlines()[0].rstrip()
        assert "✖ leader lost, retrying" in top and top.endswith("@ 127.0.0.1:8765"), top
    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        await pilot.pause()
        top = screen_text(app).splitlines()[0].rstrip()
        assert "● live  5 fellows" in top and top.endswith("@ leader.test:8765"), top


async def test_the_essential_keys_stay_in_the_footer_at_60_columns() -> None:
    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(60, 20)) as pilot:
        await loaded(pilot, app, client)
        await pilot.pause()
        footer = screen_text(app).splitlines()[-1]
        assert "q Quit" in footer and "? Help" in footer, footer


async def test_dialogs_name_their_keys_and_the_footer_shows_the_dialogs_keys() -> None:
    from textual.widgets import Button

    from swarm_tui.app.screens.dialogs import ConfirmDialog, ExportDialog

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("2", "c")  # cancel the running job
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog)
                                and app.screen, "the confirmation")
        await pilot.pause()
        labels = [str(b.label) for b in dialog.query(Button)]
        assert labels == ["Cancel job (y)", "Keep job (n/esc)"]
        footer = screen_text(app).splitlines()[-1]
        assert "y Yes" in footer and "n No" in footer and "Cancel job" not in footer, footer
        await pilot.press("n", "e")  # the export dialog: centred like the others
        export = await wait_for(pilot, lambda: isinstance(app.screen, ExportDialog)
                                and app.screen, "the export dialog")
        await pilot.pause()
        box = export.query_one("#dialog").region
        assert abs((box.x + box.width / 2) - 40) <= 1 and box.y > 2, box
        assert [str(b.label) for b in export.query(Button)] == ["Write (enter)",
                                                                "Cancel (esc)"]


async def test_at_80_columns_the_tables_show_whole_columns_with_id_and_name_frozen() -> None:
    from swarm_tui.app.widgets.live_table import LiveTable

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        await pilot.pause()
        table = app.screen.query_one(LiveTable)
        header = screen_text(app).splitlines()[1]
        labels = {c.key: c.label for c in table.spec}
        for key in table.visible:  # every column on screen is whole: no "tx Mb" cut off
            assert labels[key].strip() in header or key == "sel", (key, header)
        assert sum(table.col_widths.values()) + 2 * len(table.col_widths) <= 79
        assert table.fixed_columns == 3  # mark, id, name
        # Every column chosen: wider than the screen; scrolled right, id and name stay.
        table.choose(tuple(c.key for c in table.spec))
        await pilot.pause()
        table.scroll_to(x=table.max_scroll_x, animate=False)
        await pilot.pause()
        row = next(line for line in screen_text(app).splitlines() if "gpu-a" in line)
        assert row.split()[:2] == ["0", "gpu-a"] and "cuda:0,1" in row, row
        # Export writes every column, shown or not.
        table.choose(None)
        await pilot.pause()
        columns, rows = table.export_rows()
        assert "dev" not in table.visible and "slots" in columns
        assert rows[0]["latency_ms"] == 20.0


def test_sweep_runs_are_named_by_their_run_before_their_timestamp() -> None:
    from swarm_tui.app.cells import job_label

    name = "20261201T230112-exp_tiny_sweep_v1-03-small_none-fixed_int8-wan_80-s1-r0"
    assert job_label(name) == \
        "small_none-fixed_int8-wan_80-s1-r0 · exp_tiny_sweep_v1 #3 20261201T230112"
    assert job_label("smoke") == "smoke"


async def test_the_latency_a_fellow_was_set_to_is_shown_with_its_rates() -> None:
    from swarm_tui.app.screens.fellows import FellowDetailScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 30)) as pilot:
        await loaded(pilot, app, client)
        app.push_screen(FellowDetailScreen(0))  # gpu-a: 80 Mbit/s each way, +20 ms
        await wait_for(pilot, lambda: "tx 16.0 of 80 Mbit/s (20%) +20 ms" in screen_text(app),
                       "the latency beside the tx rate")


async def test_a_fellows_detail_lists_its_per_pair_links() -> None:
    """Under a link matrix, the detail pane gives each peer link: cells, sites, the pair's rate,
    latency and jitter, its bytes and the rate it achieved (issue 40)."""
    from swarm_core.protocol import PeerLinkState
    from swarm_tui.app.screens.fellows import FellowDetailScreen

    client = FakeClient()
    client._fellows[1] = attrs.evolve(client._fellows[1], peers=[
        PeerLinkState(job_id="job-000002", cell="1.0", peer="0.0", site="b", peer_site="a",
                      peer_fellow=0, tx_mbps=40.0, latency_ms=5.0, tx_bytes=3_000_000,
                      rx_bytes=2_900_000, achieved_mbps=38.5),
        PeerLinkState(job_id="job-000002", cell="1.0", peer="2.0", site="b", peer_site="c",
                      peer_fellow=2, tx_mbps=10.0, latency_ms=20.0, jitter_ms=2.0,
                      tx_bytes=1_000_000, rx_bytes=0)])
    app = make_app(client)
    async with app.run_test(size=(120, 40)) as pilot:
        await loaded(pilot, app, client)
        app.push_screen(FellowDetailScreen(1))
        await wait_for(pilot, lambda: "pair 1.0 -> 2.0" in screen_text(app), "the pairs")
        text = screen_text(app)
        assert "pair 1.0 -> 0.0 (fellow 0) b->a: 40 Mbit/s +5 ms" in text
        assert "sent at 38.5 Mbit/s" in text
        assert "pair 1.0 -> 2.0 (fellow 2) b->c: 10 Mbit/s +20 ±2 ms" in text


async def test_exports_name_columns_with_their_units_and_round_as_shown() -> None:
    from swarm_tui.app.widgets.live_table import LiveTable

    client = FakeClient()
    app = SwarmApp(client, clock=lambda: T0 + 0.00346779823303, refresh_s=None, tick_s=None,
                   flush_s=0)
    async with app.run_test(size=(160, 30)) as pilot:
        await loaded(pilot, app, client)
        columns, rows = app.screen.query_one(LiveTable).export_rows()
        assert {"hb_age_s", "tx_mbps", "rx_mbps", "tx_limit_mbps", "latency_ms",
                "tokens_per_s"} <= set(columns)
        gpu_a = next(r for r in rows if r["name"] == "gpu-a")
        assert gpu_a["hb_age_s"] == 0.0 and gpu_a["latency_ms"] == 20.0
        assert gpu_a["tx_mbps"] == round(gpu_a["tx_mbps"], 3)
        await pilot.press("2")
        await wait_for(pilot, lambda: app.current_mode == "jobs", "the jobs view")
        await pilot.pause()
        columns, rows = app.screen.query_one(LiveTable).export_rows()
        assert "age_s" in columns and "age" not in columns
        # (the leader's clock is a fraction of a second on: 300.00346779823303 s, shown 5m)
        assert next(r for r in rows if r["id"] == "job-000002")["age_s"] == 300.0


async def test_vim_keys_and_home_end_move_the_cursor_as_help_says() -> None:
    from swarm_tui.app.widgets.live_table import LiveTable

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        table = app.screen.query_one(LiveTable)
        await pilot.press("j", "j")
        assert table.cursor_row == 2
        await pilot.press("k")
        assert table.cursor_row == 1
        await pilot.press("G")
        assert table.cursor_row == 5
        await pilot.press("g")
        assert table.cursor_row == 0
        await pilot.press("end")
        assert table.cursor_row == 5
        await pilot.press("home")
        assert table.cursor_row == 0


async def test_the_palette_offers_every_views_actions_from_anywhere() -> None:
    from textual.command import CommandList, CommandPalette

    from swarm_tui.app.screens.dialogs import ExportDialog
    from swarm_tui.app.screens.jobs import JobsScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot, app, client)
        for start, command, opens in [("2", "fellows: set speed", SetSpeedDialog),
                                      ("1", "jobs: export view", ExportDialog)]:
            await pilot.press(start)
            await pilot.pause()
            await pilot.press("ctrl+p")
            palette = await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette)
                                     and app.screen, "the command palette")
            palette.query_one(Input).value = command
            await wait_for(pilot, lambda p=palette: p.query_one(CommandList).option_count,
                           "hits")
            await pilot.press("down", "enter")
            dialog = await wait_for(pilot, lambda o=opens: isinstance(app.screen, o)
                                    and app.screen, command)
            if isinstance(dialog, SetSpeedDialog):
                assert dialog.targets == [(0, "gpu-a")]  # the fellows table's cursor
            await pilot.press("escape")
            await pilot.pause()
        assert isinstance(app.screen, JobsScreen)


async def test_describe_shows_the_whole_record_and_log_what_the_fellow_did(
        swarm_home: Path) -> None:
    import json

    from swarm_core import local_cluster
    from swarm_core.local_cluster import ClusterRecord, ProcessEntry
    from swarm_tui.app.screens.record import DescribeScreen, FellowLogScreen

    log = swarm_home / "gpu-a.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"line {i}\n" for i in range(500)))
    local_cluster._write(ClusterRecord(
        leader_url="http://leader.test:8765", state_dir="/nowhere",  # (the FakeClient's)
        leader=ProcessEntry(1, "leader", "l.log"),
        fellows=[ProcessEntry(2, "gpu-a", str(log))], started_at=1.0))
    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("d")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, DescribeScreen)
                                and app.screen.text and app.screen, "the fellow's record")
        record = json.loads(screen.text)
        assert record["fellow_id"] == 0 and record["link"]["latency_ms"] == 20.0
        await pilot.press("escape", "l")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, FellowLogScreen)
                                and app.screen.text and app.screen, "the fellow's log")
        assert "joined job-000002" in screen.text
        assert f"{log} (last 200 lines)" in screen.text and "line 499" in screen.text
        assert "line 299\n" not in screen.text
        # gpu-b is not of the local cluster: its own log comes through the leader.
        await pilot.press("escape", "down", "l")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, FellowLogScreen)
                                and "through the leader (" in app.screen.text and app.screen,
                                "gpu-b's log through the leader")
        assert "its own log, through the leader (last 3 lines, as of 0.8s ago)" in screen.text
        assert "swarm.fellow INFO step 92 done" in screen.text and "line 499" not in screen.text
        await pilot.press("escape", "down", "l")  # cpu-c: nothing sent yet, and it says so
        await wait_for(pilot, lambda: isinstance(app.screen, FellowLogScreen)
                       and "fellow 2 has sent no log yet" in app.screen.text, "cpu-c's")
        await pilot.press("escape", "2", "d")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, DescribeScreen)
                                and app.screen.text and app.screen, "the job's record")
        record = json.loads(screen.text)
        assert record["job_id"] == "job-000002" and len(record["loss_history"]) == 31


async def test_the_column_chooser_picks_the_columns_and_a_goes_back_to_by_width() -> None:
    from textual.widgets import SelectionList

    from swarm_tui.app.screens.dialogs import ColumnsDialog
    from swarm_tui.app.widgets.live_table import LiveTable

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        table = app.screen.query_one(LiveTable)
        by_width = table.visible
        assert "dev" not in by_width and "lat" not in by_width
        await pilot.press("C")
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, ColumnsDialog)
                                and app.screen, "the column chooser")
        choice = dialog.query_one(SelectionList)
        choice.deselect("step")
        choice.select("lat")
        choice.select("dev")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, ColumnsDialog), "closed")
        await pilot.pause()
        assert "step" not in table.visible and {"lat", "dev"} <= set(table.visible)
        assert table.fixed_columns == 3
        assert "slots" in screen_text(app).splitlines()[1] or table.max_scroll_x > 0
        await pilot.press("C")
        await wait_for(pilot, lambda: isinstance(app.screen, ColumnsDialog), "the chooser")
        await pilot.press("a")
        await wait_for(pilot, lambda: not isinstance(app.screen, ColumnsDialog), "closed")
        assert table.visible == by_width and table.chosen is None


async def profile_form(pilot: Any, app: Any) -> Any:
    """The launcher (key 3) on its model + training profile form."""
    from textual.widgets import Select

    from swarm_tui.app.screens.launch import LaunchScreen

    await pilot.press("3")
    screen = await wait_for(pilot, lambda: isinstance(app.screen, LaunchScreen)
                            and app.screen, "the launcher")
    screen.query_one("#source", Select).value = "profiles"
    return screen


async def test_the_launcher_offers_sparseloco_and_takes_its_density(tmp_path: Path) -> None:
    from textual.widgets import Select

    from tests.tui_support import snapshot_configs

    client = FakeClient()
    app = make_app(client, configs_dir=snapshot_configs(tmp_path))
    async with app.run_test(size=(100, 40)) as pilot:
        await loaded(pilot, app, client)
        screen = await profile_form(pilot, app)
        await wait_for(pilot, lambda: screen.query_one("#row-density").display,
                       "the profile form's density")
        screen.query_one("#replicas", Input).value = "2"
        screen.query_one("#stages", Input).value = "2"  # (2 x 2: 4 fellows)
        # (a value the Select does not offer would raise: sparseloco is one of its options)
        screen.query_one("#sync", Select).value = "sparseloco"
        await pilot.click("#density")
        await pilot.press(*"0.05")
        await wait_for(pilot, lambda: screen.plan.ok
                       and screen.plan.runs[0].training.sync.density == 0.05, "the plan")
        sync = screen.plan.runs[0].training.sync
        assert (sync.mode, sync.density) == ("sparseloco", 0.05)
        assert screen.plan.bodies[0]["training"]["sync"]["density"] == 0.05  # (the preview's)
        await pilot.press("backspace", "backspace", "backspace", "backspace", "0")
        await wait_for(pilot, lambda: "$.training.sync.density: must be > 0"
                       in screen_text(app), "the preview's error")


async def test_the_launcher_offers_the_torch_transport_and_refuses_it_over_shaped_links(
        tmp_path: Path) -> None:
    """`training.transport`: the profile form offers the profile's (blank, preselected),
    shaped or torch, carried in the job's training; a torch job says so in the preview and
    the question. Over a training profile whose network shapes its links the preview shows
    the config's one-line error at `$.training.transport`, and nothing launches."""
    import json

    from textual.widgets import Select

    from swarm_tui.app.screens.dialogs import ConfirmDialog
    from swarm_tui.app.screens.launch import LaunchScreen
    from tests.tui_support import snapshot_configs

    configs = snapshot_configs(tmp_path)
    shaped = json.loads((configs / "training" / "tiny_sweep.json").read_text())
    shaped["network_profile"] = {"name": "slow", "tx_mbps": 80, "rx_mbps": 80}
    (configs / "training" / "shaped_links.json").write_text(json.dumps(shaped))
    client = FakeClient()
    app = make_app(client, configs_dir=configs)
    async with app.run_test(size=(100, 40)) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("3")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, LaunchScreen)
                                and app.screen, "the launcher")
        transport = screen.query_one("#transport", Select)
        assert not screen.query_one("#row-transport").display  # (not the sweep's field)
        screen.query_one("#source", Select).value = "profiles"
        await wait_for(pilot, lambda: screen.query_one("#row-transport").display
                       and screen.plan.ok, "the profile form")
        assert transport.value is Select.NULL and screen.choice().transport is None
        assert screen.plan.bodies[0]["training"]["transport"] == "shaped"  # (the profile's)
        assert "torch" not in screen_text(app).split("preview")[-1]
        screen.query_one("#training", Select).value = "training/tiny_sweep.json"
        transport.value = "torch"
        await wait_for(pilot, lambda: screen.plan.ok
                       and screen.plan.runs[0].train.transport == "torch", "the torch plan")
        assert screen.plan.bodies[0]["training"]["transport"] == "torch"  # (the preview's)
        await wait_for(pilot, lambda: "transport: torch (gloo; unshaped" in screen_text(app),
                       "the preview's note")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "the question")
        assert "torch transport" in " ".join(screen_text(app).split())
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen, "back in the launcher")
        # Torch over links its network profile shapes: the config's error, and no launch.
        screen.query_one("#training", Select).value = "training/shaped_links.json"
        await wait_for(pilot, lambda: "preview: not valid" in screen_text(app), "the error")
        assert screen.plan.field == "$.training.transport"
        assert (screen.plan.error or "").startswith("must be 'shaped' where the job's link or "
                                                    "network shapes its links")
        assert "$.training.transport: must be 'shaped'" in screen_text(app)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: "nothing to launch: must be 'shaped'"
                       in screen_text(app), "the launch refused")
        assert app.screen is screen and client.calls == []
        transport.value = "shaped"  # (the shaped transport takes the shaped links)
        await wait_for(pilot, lambda: screen.plan.ok, "the shaped plan")
        # A torch launch reaches the leader as torch.
        screen.query_one("#training", Select).value = "training/tiny_sweep.json"
        transport.value = "torch"
        await wait_for(pilot, lambda: screen.plan.ok
                       and screen.plan.runs[0].train.transport == "torch", "the torch plan")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "the question")
        await pilot.press("y")
        await wait_for(pilot, lambda: client.calls, "the submit")
        (what, req), = client.calls
        assert what == "submit" and req.train is not None and req.train.transport == "torch"


async def test_the_launchers_transport_starts_as_the_profiles_and_a_pick_overrides_it(
        tmp_path: Path) -> None:
    """The transport field starts blank ("the profile's"): the launcher writes no transport
    over the training profile's, so a torch profile launches torch; picking shaped or torch
    writes that pick, and blank again is the profile's once more. (It once preselected
    shaped, writing `training.transport: shaped` over a torch profile.)"""
    import json

    from textual.widgets import Select

    from swarm_tui.app.screens.dialogs import ConfirmDialog
    from tests.tui_support import snapshot_configs

    configs = snapshot_configs(tmp_path)
    torch = json.loads((configs / "training" / "tiny_sweep.json").read_text())
    torch["transport"] = "torch"
    (configs / "training" / "torch_profile.json").write_text(json.dumps(torch))
    client = FakeClient()
    app = make_app(client, configs_dir=configs)
    async with app.run_test(size=(100, 40)) as pilot:
        await loaded(pilot, app, client)
        screen = await profile_form(pilot, app)
        await wait_for(pilot, lambda: screen.query_one("#row-transport").display
                       and screen.plan.ok, "the profile form")
        transport = screen.query_one("#transport", Select)
        assert transport.value is Select.NULL  # (blank, the default)
        assert "the profile's" in screen_text(app)  # (the blank's prompt)
        screen.query_one("#training", Select).value = "training/torch_profile.json"
        await wait_for(pilot, lambda: screen.plan.ok
                       and screen.plan.runs[0].train.transport == "torch", "the torch plan")
        assert screen.choice().transport is None  # (the launcher writes no transport)
        assert screen.plan.bodies[0]["training"]["transport"] == "torch"  # (the profile's)
        await wait_for(pilot, lambda: "transport: torch (gloo; unshaped" in screen_text(app),
                       "the preview's note")
        # A pick overrides the profile's: shaped over the torch profile, then torch.
        transport.value = "shaped"
        await wait_for(pilot, lambda: screen.plan.ok
                       and screen.plan.runs[0].train.transport == "shaped", "the shaped plan")
        assert screen.plan.bodies[0]["training"]["transport"] == "shaped"
        transport.value = "torch"
        await wait_for(pilot, lambda: screen.plan.ok
                       and screen.plan.runs[0].train.transport == "torch", "the picked torch")
        assert screen.choice().transport == "torch"
        # Blank again: the profile's (torch), launched as torch.
        transport.clear()
        await wait_for(pilot, lambda: screen.choice().transport is None and screen.plan.ok
                       and screen.plan.runs[0].train.transport == "torch", "the profile's")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "the question")
        assert "torch transport" in " ".join(screen_text(app).split())
        await pilot.press("y")
        await wait_for(pilot, lambda: client.calls, "the submit")
        (what, req), = client.calls
        assert what == "submit" and req.train is not None and req.train.transport == "torch"


async def test_launch_asks_first_and_names_the_grid_the_form_asks_for(tmp_path: Path) -> None:
    """Issue 36 point 10: a remembered focus, tab and enter queued a whole sweep. Every
    launch asks first (enter goes back; y launches), naming the runs and their grid; the form
    asks for stages, as `swarm submit --stages` (stages 2, replicas 2 is a 2 x 2 job)."""
    from textual.widgets import Select

    from swarm_tui.app.screens.dialogs import ConfirmDialog
    from swarm_tui.app.screens.launch import LaunchScreen
    from tests.tui_support import snapshot_configs

    client = FakeClient()
    app = make_app(client, configs_dir=snapshot_configs(tmp_path))
    async with app.run_test(size=(100, 40)) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("3")
        screen = await wait_for(pilot, lambda: isinstance(app.screen, LaunchScreen)
                                and app.screen, "the launcher")
        await wait_for(pilot, lambda: "preview: 2 runs" in screen_text(app), "the sweep")
        assert "grid: 2 stages x 1 replica = 2 fellows" in screen_text(app)
        # The accident: focus on the sweep's config, tab (to the button), enter.
        screen.query_one("#config", Select).focus()
        await pilot.press("tab", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog)
                       and "Launch 2 runs?" in screen_text(app), "the question")
        text = screen_text(app)
        assert "Launch 2 runs?" in text and "exp_tiny_sweep_v1: 2 runs, queued at once" in text
        assert "2 stages x 1 replica = 2 fellows" in text
        await pilot.press("enter")  # (focus starts on the safe answer)
        await wait_for(pilot, lambda: app.screen is screen, "back in the launcher")
        assert not app.launching and client.calls == []
        # A train job of stages 2 x replicas 2: the preview and the question say 4 fellows.
        screen.query_one("#source", Select).value = "profiles"
        await wait_for(pilot, lambda: screen.query_one("#row-stages").display, "the form")
        assert not screen.query("#row-fellows")  # (stages, not fellows in all)
        await pilot.click("#stages")
        burst(app, "2", "tab", "2")
        await wait_for(pilot, lambda: screen.plan.ok
                       and screen.plan.runs[0].topology.replicas == 2, "the plan")
        topo = screen.plan.runs[0].topology
        assert (topo.stages, topo.replicas, topo.fellows) == (2, 2, 4)
        assert "grid: 2 stages x 2 replicas = 4 fellows" in screen_text(app)
        burst(app, "enter")  # (enter in a field asks too)
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog)
                       and "small_fixed_int8: 2 stages x 2 replicas = 4 fellows"
                       in screen_text(app), "the question")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen is screen, "back in the launcher")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "the question")
        await pilot.press("y")
        await wait_for(pilot, lambda: client.calls, "the submit")
        (what, req), = client.calls
        assert what == "submit" and (req.topology.stages, req.topology.replicas,
                                     req.topology.fellows) == (2, 2, 4)


async def test_the_focused_field_stands_out_in_256_colours(tmp_path: Path) -> None:
    """Issue 36 point 10: the focused field was one grey step brighter than the rest. In 256
    colours its background and its label's are a colour, not a grey, and not the others'."""
    from rich.color import ColorSystem
    from textual.widgets import Label, Select

    from tests.tui_support import snapshot_configs

    def colour256(widget: object) -> tuple[int, int, int]:
        bg = widget.rich_style.bgcolor  # type: ignore[attr-defined]
        assert bg is not None
        return bg.downgrade(ColorSystem.EIGHT_BIT).get_truecolor()

    def grey(rgb: tuple[int, int, int]) -> bool:
        return max(rgb) - min(rgb) < 24

    client = FakeClient()
    app = make_app(client, configs_dir=snapshot_configs(tmp_path))
    async with app.run_test(size=(100, 40)) as pilot:
        await loaded(pilot, app, client)
        screen = await profile_form(pilot, app)
        await wait_for(pilot, lambda: screen.query_one("#row-stages").display, "the form")
        await pilot.click("#stages")
        await pilot.pause()
        stages, replicas = screen.query_one("#stages", Input), screen.query_one("#replicas", Input)
        label = screen.query_one("#row-stages").query_one(Label)
        other = screen.query_one("#row-replicas").query_one(Label)
        assert stages.has_focus
        for focused, plain in ((stages, replicas), (label, other)):
            assert not grey(colour256(focused)) and colour256(focused) != colour256(plain)
        # A pick list too.
        from textual.widgets._select import SelectCurrent

        screen.query_one("#model", Select).focus()
        await pilot.pause()
        model = screen.query_one("#model", Select).query_one(SelectCurrent)
        training = screen.query_one("#training", Select).query_one(SelectCurrent)
        assert not grey(colour256(model)) and colour256(model) != colour256(training)
        assert not grey(colour256(screen.query_one("#row-model").query_one(Label)))
        assert colour256(label) == colour256(other)  # (the stages field's, back to plain)
        # And in the set-speed dialog.
        app.switch_view("fellows")
        await pilot.pause()
        await pilot.press("s")
        dialog = await wait_for(pilot, lambda: isinstance(app.screen, SetSpeedDialog)
                                and app.screen, "the dialog")
        await pilot.pause()
        tx, rx = dialog.query_one("#tx", Input), dialog.query_one("#rx", Input)
        assert tx.has_focus and not grey(colour256(tx)) and colour256(tx) != colour256(rx)


# --- issue 36 point 14: at 80 columns and in the palette ---------------------------------------


async def test_at_80_columns_every_sortable_column_shows_its_sort_arrow() -> None:
    from swarm_tui.app.cells import JOB_COLUMNS, SORTABLE_FELLOW_COLUMNS
    from swarm_tui.app.screens.jobs import JobsScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        for view, columns in (("fellows", SORTABLE_FELLOW_COLUMNS), ("jobs", JOB_COLUMNS)):
            app.switch_view(view)
            await pilot.pause()
            table = app.screen.query_one(LiveTable)
            for col in columns:
                for reverse, arrow in ((False, "▲"), (True, "▼")):
                    table.set_sort(col.key, reverse=reverse)
                    await pilot.pause()
                    header = screen_text(app).splitlines()[1]
                    # (a column too wide for 80 shows while it sorts: id and name stay)
                    assert col.label.strip() + arrow in header, (view, col.key, header)
                    assert sum(table.col_widths.values()) + 2 * len(table.col_widths) <= 79
        assert isinstance(app.screen, JobsScreen)


async def test_long_run_names_are_cut_in_the_middle() -> None:
    """Four runs of a sweep, alike but for their seed and repeat: cut at the end, they read
    alike at 80 columns; cut in the middle, each shows the end that tells it apart."""
    from tests.tui_support import _job

    runs = [f"20261201T2301{i:02d}-exp_grid_v1-{i:02d}-small_none-fixed_int8-wan_80-s{s}-r{r}"
            for i, (s, r) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)])]
    client = FakeClient()
    client._jobs = [_job(10 + i, "COMPLETED", name=name, step=3, steps=3)
                    for i, name in enumerate(runs)]
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_for(pilot, lambda: app.snapshots >= 1, "the fixed data")
        await pilot.press("2")
        table = await wait_for(pilot, lambda: (t := app.screen.query_one(LiveTable)).row_count
                               == 4 and t, "the sweep's runs")
        await pilot.pause()
        shown = [table.get_cell(key, "name").plain for key in table.shown_keys]
        assert len(set(shown)) == 4, shown
        assert all(len(name) == table.col_widths["name"] and "…" in name for name in shown)
        assert sorted(name[-6:] for name in shown) == ["-s0-r0", "-s0-r1", "-s1-r0", "-s1-r1"]
        assert all(name.startswith("small_no") for name in shown)
        assert all(name in screen_text(app) for name in shown)
        # The export keeps the whole name; the sort, the run's.
        _columns, rows = table.export_rows()
        assert sorted(r["name"] for r in rows) == sorted(runs)
    from swarm_tui.app.cells import cut_middle

    assert cut_middle("abcdefghijkl", 7) == "abc…jkl" and cut_middle("short", 7) == "short"


async def test_the_top_bar_keeps_the_running_count_at_80_columns() -> None:
    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        app.watch_job("job-000002")
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen), "the watch")
        await pilot.pause()
        top = screen_text(app).splitlines()[0].rstrip()
        assert top.startswith(" job-000002  ● live  5 fellows · 1 stale  1 running") \
            and top.endswith("@ leader.test:8765"), top


async def test_every_action_is_in_the_palette_with_its_keys(tmp_path: Path) -> None:
    """Every binding of every view (the tables' movement and the forms' tab aside) has a
    palette entry, shown with its keys as remapped."""
    from textual.binding import Binding
    from textual.command import CommandList, CommandPalette

    from swarm_tui.app.app import MODAL_VIEWS, help_sections
    from swarm_tui.app.commands import SwarmCommands
    from swarm_tui.app.screens.fellows import FellowDetailScreen
    from swarm_tui.app.screens.record import DescribeScreen, FellowLogScreen

    client = FakeClient()
    app = make_app(client, keymap={"fellows.set_speed": "x"})
    wanted = {(title, b.action): b for title, bindings in help_sections()
              if title not in MODAL_VIEWS and title not in ("tables", "tables and forms")
              for b in bindings if isinstance(b, Binding) and b.id
              and not b.id.endswith(("next_field", "previous_field")) and b.id != "app.palette"
              and not b.action.startswith("scroll(")}  # (moving, as the tables' keys)
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot, app, client)
        found: dict[tuple[type, str], str] = {}
        for opened in (lambda: None, lambda: app.push_screen(FellowDetailScreen(0)),
                       lambda: app.watch_job("job-000002"),
                       lambda: app.push_screen(DescribeScreen("job", "job-000002")),
                       lambda: app.push_screen(FellowLogScreen(0))):
            app.switch_view("fellows")
            opened()
            await pilot.pause()
            provider = SwarmCommands(app.screen)
            for command in provider.commands():
                if command.key_of is not None:
                    found[command.key_of] = provider.hint(command)
        owners = {title: cls for title, cls in [
            ("everywhere", SwarmApp), ("fellow detail", FellowDetailScreen),
            ("job watch", JobWatchScreen), ("describe", DescribeScreen),
            ("fellow log", FellowLogScreen)]}
        from swarm_tui.app.screens.fellows import FellowsScreen
        from swarm_tui.app.screens.jobs import JobsScreen
        from swarm_tui.app.screens.launch import LaunchScreen

        owners |= {"fellows": FellowsScreen, "jobs": JobsScreen, "launch": LaunchScreen}
        missing = [f"{title}: {b.id}" for (title, action), b in wanted.items()
                   if (owners[title], action) not in found]
        assert not missing, missing
        assert found[(FellowsScreen, "set_speed")] == "x"  # (remapped)
        assert found[(JobsScreen, "watch")] == "w enter"
        # On screen: the entry and its key.
        await pilot.press("ctrl+p")
        palette = await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette)
                                 and app.screen, "the palette")
        palette.query_one(Input).value = "fellows: release all"
        await wait_for(pilot, lambda: palette.query_one(CommandList).option_count, "hits")
        await wait_for(pilot, lambda: "fellows: release all  R" in screen_text(app), "its key")


async def test_describe_scrolls_like_the_tables_searches_and_shows_times(tmp_path: Path
                                                                         ) -> None:
    import json

    from swarm_tui.app.screens.record import DescribeScreen, fmt_time

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("2", "d")  # job-000002, its 31-point loss history: 100+ lines
        screen = await wait_for(pilot, lambda: isinstance(app.screen, DescribeScreen)
                                and app.screen.text and app.screen, "the job's record")
        record = json.loads(screen.text)
        job = next(j for j in client._jobs if j.job_id == "job-000002")
        assert record["created_at"] == fmt_time(job.created_at)
        assert record["created_at"][:4] in ("2023", "2024") and record["finished_at"] is None
        assert record["link_changes"][0]["at"] == fmt_time(job.link_changes[0].at)
        assert ":20.2 " in fmt_time(1700000000.25) and ":20 " in fmt_time(1700000000.0)
        scroll = screen.scroller
        await pilot.pause()
        assert scroll.max_scroll_y > 20
        await pilot.press("j", "j", "j")
        await wait_for(pilot, lambda: scroll.scroll_y == 3, "three lines down")
        await pilot.press("k")
        await wait_for(pilot, lambda: scroll.scroll_y == 2, "one up")
        await pilot.press("G")
        await wait_for(pilot, lambda: scroll.scroll_y == scroll.max_scroll_y, "the bottom")
        await pilot.press("g")
        await wait_for(pilot, lambda: scroll.scroll_y == 0, "the top")
        # / searches: the view goes to the first match, n and N to the next and previous.
        await pilot.press("slash", *"eval_history", "enter")
        line = screen.text.splitlines().index(next(ln for ln in screen.text.splitlines()
                                                   if "eval_history" in ln))
        await wait_for(pilot, lambda: scroll.scroll_y > 0 and abs(
            scroll.scroll_y - (line - 2)) <= 1, "the match in view")
        assert '"eval_history"' in screen_text(app) and "1/1" in screen_text(app)
        await pilot.press("escape")  # closes the search
        await pilot.press("slash", *"2.5")
        await wait_for(pilot, lambda: len(screen.matches) > 1, "several matches")
        first = screen.match
        await pilot.press("enter", "n")
        await wait_for(pilot, lambda: screen.match == (first + 1) % len(screen.matches),
                       "the next")
        await pilot.press("N", "N")
        await wait_for(pilot, lambda: screen.match == (first - 1) % len(screen.matches),
                       "the previous")
        await pilot.press("escape", "escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, DescribeScreen), "back")


async def test_quitting_a_local_cluster_with_a_running_job_says_it_will_fail() -> None:
    from swarm_tui.app.screens.dialogs import ConfirmDialog

    class Running:
        def running(self) -> bool:
            return True

        def is_current(self) -> bool:
            return True

    client = FakeClient()
    app = make_app(client, cluster=Running())
    async with app.run_test(size=(100, 30)) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("q")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog)
                       and "will fail" in screen_text(app), "the question")
        assert "so job-000002 small_fixed_int8, running on it, will fail" \
            in str(app.screen.body)  # type: ignore[attr-defined]
        await pilot.press("n")
        await wait_for(pilot, lambda: not isinstance(app.screen, ConfirmDialog), "stayed")


def test_no_mouse_leaves_the_mouse_to_the_terminal(monkeypatch) -> None:  # type: ignore
    from swarm_tui import cli

    runs: list[dict[str, object]] = []
    monkeypatch.setattr(SwarmApp, "run", lambda self, **kw: runs.append(kw))
    monkeypatch.delenv("SWARM_LEADER_URL", raising=False)
    assert cli.main_tui(["--leader-url", "http://127.0.0.1:1", "--no-mouse"]) == 0
    assert cli.main_tui(["--leader-url", "http://127.0.0.1:1"]) == 0
    assert runs == [{"mouse": False}, {"mouse": True}]
