"""Ghost fellows (issue 36, point 13): fellows gone a while leave the default view (a toggle
shows them), point at no finished job, cannot be "released", can be forgotten, and the top
bar's counts agree with the rows. Against the fixed-data client, in process (cheap)."""

from __future__ import annotations

import re

import attrs

from swarm_tui.app.app import SwarmApp
from swarm_tui.app.screens.dialogs import ConfirmDialog
from swarm_tui.app.screens.fellows import FellowsScreen
from swarm_tui.app.widgets.live_table import LiveTable
from tests.tui_support import T0, FakeClient, _fellow, frozen_clock, screen_text, wait_for

SIZE = (140, 30)  # (the top bar in full)


def ghost_client() -> FakeClient:
    """The fixed data and three ghosts: one offline since a leader restarted an hour after it
    last beat (pointing at the finished smoke job), one stale for two minutes (pointing at
    the failed job), one released five minutes ago."""
    client = FakeClient()
    offline = attrs.evolve(_fellow(10, "old-a", "offline", job="job-000001", step=5, loss=3.3,
                                   tps=99.0, age=3600), heartbeat_age_s=None)
    client._fellows += [
        offline,
        _fellow(11, "old-b", "stale", job="job-000004", step=3, loss=7.1, tps=50.0, age=120),
        _fellow(12, "old-c", "released", age=300),
    ]
    return client


def make_app(client: FakeClient) -> SwarmApp:
    return SwarmApp(client, clock=frozen_clock, refresh_s=None, tick_s=None, flush_s=0)


async def loaded(pilot: object, app: SwarmApp, client: FakeClient) -> None:
    await wait_for(pilot, lambda: app.snapshots >= 1
                   and app.model.events_seen >= client.expected_events, "the fixed data")


def top_counts(text: str) -> tuple[int, int, int]:
    """The top bar's fellows, busy and stale counts."""
    top = text.splitlines()[0]
    m = re.search(r"(\d+) fellows?(?: · (\d+) busy)?(?: · (\d+) stale)?", top)
    assert m is not None, top
    return int(m[1]), int(m[2] or 0), int(m[3] or 0)


def row_counts(app: SwarmApp) -> tuple[int, int, int]:
    """The same, counted from the fellows table's rows as shown."""
    table = app.screen.query_one(LiveTable)
    statuses = [table.cells_for(k)["status"].plain.rstrip("!") for k in table.shown_keys]
    present = [s for s in statuses if s not in ("released", "leaving", "left")]
    return (len(present), statuses.count("busy"),
            statuses.count("stale") + statuses.count("offline"))


async def test_ghosts_leave_the_default_view_and_the_counts_agree_with_the_rows() -> None:
    client = ghost_client()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        await pilot.pause()
        table = app.screen.query_one(LiveTable)
        assert sorted(map(int, table.shown_keys)) == [0, 1, 2, 3, 4, 5]
        text = screen_text(app)
        assert top_counts(text) == row_counts(app) == (5, 2, 1)
        assert "+3 gone" in text.splitlines()[0]
        # H lists them too: the counts follow the rows; a ghost points at no finished job.
        await pilot.press("H")
        await wait_for(pilot, lambda: len(table.shown_keys) == 9, "the ghosts listed")
        text = screen_text(app)
        assert top_counts(text) == row_counts(app) == (7, 2, 3)
        assert "gone" not in text.splitlines()[0]
        for fid in (10, 11):
            cells = table.cells_for(str(fid))
            assert [cells[k].plain for k in ("job", "step", "loss", "tps")] == \
                ["-", "-", "-", "-"], fid
        assert table.cells_for("12")["status"].plain == "released"
        await pilot.press("H")
        await wait_for(pilot, lambda: len(table.shown_keys) == 6, "hidden again")


async def test_a_gone_fellow_is_not_released_but_forgotten_after_a_confirmation() -> None:
    client = ghost_client()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        await pilot.press("H")
        table = app.screen.query_one(LiveTable)
        await wait_for(pilot, lambda: len(table.shown_keys) == 9, "the ghosts listed")
        table.move_cursor(row=table.get_row_index("10"))
        await pilot.press("r")
        await pilot.pause()
        assert isinstance(app.screen, FellowsScreen)  # (no dialog: nothing to release)
        assert any("fellow 10 is offline" in n.message and "nothing sent" in n.message
                   for n in app._notifications)
        assert not [c for c in client.calls if c[0] == "release"]
        # A live one is not forgotten.
        table.move_cursor(row=table.get_row_index("2"))
        await pilot.press("F")
        await pilot.pause()
        assert isinstance(app.screen, FellowsScreen)
        assert any("still heartbeats" in n.message for n in app._notifications)
        # Forgotten: asked first, then gone from the leader and the table.
        table.move_cursor(row=table.get_row_index("10"))
        await pilot.press("space", "k")  # (marked: 10; the cursor moved on and back)
        table.move_cursor(row=table.get_row_index("11"))
        await pilot.press("space")
        await pilot.press("F")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmDialog), "the question")
        assert "10 old-a, 11 old-b" in screen_text(app)
        await pilot.press("y")
        await wait_for(pilot, lambda: "10" not in table.shown_keys
                       and "11" not in table.shown_keys, "forgotten")
        assert [c for c in client.calls if c[0] == "forget"] == [("forget", 10),
                                                                 ("forget", 11)]
        assert 10 not in app.model.fellows and 11 not in app.model.fellows


async def test_a_gone_fellow_leaves_the_view_once_silent_a_while() -> None:
    """Stale for 9 s, released 1 s ago: listed; once a minute has passed without a word,
    not (by default)."""
    client = FakeClient()
    now = [T0]
    app = SwarmApp(client, clock=lambda: now[0], refresh_s=None, tick_s=None, flush_s=0)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        table = app.screen.query_one(LiveTable)
        await wait_for(pilot, lambda: "3" in table.shown_keys, "the stale fellow")
        now[0] = T0 + 60
        app._tick()
        await wait_for(pilot, lambda: "3" not in table.shown_keys, "hidden once silent a while")
        assert "4" not in table.shown_keys  # (released 61 s ago)
        assert "+2 gone" in screen_text(app).splitlines()[0]
