"""The live table paints what it holds: cell writes drop only the changed rows' cached renders
(see swarm_tui/app/widgets/live_table.py), so check the screen, not just the data."""

from __future__ import annotations

from pathlib import Path

from swarm_tui.app.app import SwarmApp
from swarm_tui.app.model import Change
from swarm_tui.app.widgets.live_table import LiveTable
from tests.tui_support import T0, FakeClient, frozen_clock, screen_text, wait_for


def row_of(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if f" {name} " in line)


def heartbeat(seq: int, fid: int, name: str, step: int, loss: float) -> dict[str, object]:
    return {"seq": seq, "ts": T0, "type": "fellow.heartbeat", "data": {
        "fellow_id": fid, "name": name, "status": "busy", "job_id": "job-000002", "step": step,
        "loss": loss, "tokens_per_s": 1000.0,
        "link": {"tx_mbps": 80.0, "rx_mbps": 80.0, "latency_ms": 0.0},
        "counters": {"control_tx": 0, "control_rx": 0, "data_tx": 0, "data_rx": 0}}}


async def test_cell_writes_repaint_their_rows_and_keep_the_rest(tmp_path: Path) -> None:
    client = FakeClient()
    app = SwarmApp(client, clock=frozen_clock, refresh_s=None, tick_s=None, flush_s=0)
    async with app.run_test(size=(100, 20)) as pilot:
        await wait_for(pilot, lambda: app.model.events_seen >= client.expected_events, "data")
        table = app.screen.query_one(LiveTable)
        await pilot.pause()
        before = screen_text(app)
        assert " 120 " in row_of(before, "gpu-b")
        cursor = table.cursor_key
        # Many updates to one row, each painted as it comes.
        seq = app.model.last_seq or 0
        for step in range(121, 141):
            seq += 1
            app.apply_event(heartbeat(seq, 1, "gpu-b", step, 2.0 - step / 1000))
            await pilot.pause()
            assert f" {step} " in row_of(screen_text(app), "gpu-b")
        after = screen_text(app)
        assert "1.860" in row_of(after, "gpu-b")
        for name in ("gpu-a", "cpu-c", "cpu-d", "laptop", "cpu-f"):
            assert row_of(after, name) == row_of(before, name)
        assert table.cursor_key == cursor
        # Sorted by step, descending: an update that passes its neighbour moves the row.
        app.screen.sort_by("step")  # type: ignore[attr-defined]
        app.screen.action_sort_reverse()  # type: ignore[attr-defined]
        await pilot.pause()
        assert [app.model.fellows[int(k)].name for k in table.shown_keys][:2] == \
            ["gpu-b", "gpu-a"]
        seq += 1
        app.apply_event(heartbeat(seq, 0, "gpu-a", 200, 1.5))
        await pilot.pause()
        assert [app.model.fellows[int(k)].name for k in table.shown_keys][:2] == \
            ["gpu-a", "gpu-b"]
        lines = [line for line in screen_text(app).splitlines() if " gpu-" in line]
        assert " gpu-a " in lines[0] and " 200 " in lines[0] and " gpu-b " in lines[1]
        # Ages alone: one column rewritten, rows otherwise untouched.
        updates = table.updates
        app.publish(Change(ages=True))
        assert table.updates == updates  # the clock is frozen: nothing to write


async def test_views_left_open_on_what_is_gone_show_and_do_nothing_stale(tmp_path: Path) -> None:
    """A job that vanishes empties its watch view (nothing stale to read or export); a fellow
    that vanishes takes no set-speed or release from its detail view."""
    from swarm_tui.app.screens.fellows import FellowDetailScreen
    from swarm_tui.app.screens.jobs import JobWatchScreen

    client = FakeClient()
    app = SwarmApp(client, clock=frozen_clock, refresh_s=None, tick_s=None, flush_s=0)
    async with app.run_test(size=(160, 48)) as pilot:
        await wait_for(pilot, lambda: app.model.events_seen >= client.expected_events, "data")
        await pilot.press("2", "enter")
        watch = await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                               and app.screen, "the watch view")
        assert watch.job_id == "job-000002"
        table = watch.query_one(LiveTable)
        await wait_for(pilot, lambda: table.row_count == 2, "its two stages")
        client._jobs = [j for j in client._jobs if j.job_id != "job-000002"]
        app.refresh_now()
        await wait_for(pilot, lambda: table.row_count == 0, "the rows gone")
        assert "not known to the leader" in screen_text(app)
        await pilot.press("escape", "1", "enter")
        detail = await wait_for(pilot, lambda: isinstance(app.screen, FellowDetailScreen)
                                and app.screen, "the detail view")
        assert detail.fellow_id == 0
        client._fellows = [f for f in client._fellows if f.fellow_id != 0]
        app.refresh_now()
        await wait_for(pilot, lambda: 0 not in app.model.fellows, "fellow 0 gone")
        for key in ("s", "r"):
            await pilot.press(key)
            await pilot.pause()
            assert isinstance(app.screen, FellowDetailScreen), f"{key} opened a dialog"
        assert client.calls == []
