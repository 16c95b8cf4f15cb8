"""Snapshots of the console's screens at 80x24 (an SSH session) and 160x48, from fixed data on a
frozen clock (Textual is pinned exactly: snapshots change between releases).

Update after a deliberate change: ``pytest tests/unit/test_tui_snapshots.py --snapshot-update``,
then look at the SVGs (``snapshot_report.html`` shows the differences when a test fails).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Select

from swarm_tui.app.app import SwarmApp
from swarm_tui.app.screens.dialogs import ConfirmDialog, HelpScreen, SetSpeedDialog
from swarm_tui.app.screens.fellows import FellowDetailScreen
from swarm_tui.app.screens.jobs import JobsScreen, JobWatchScreen
from swarm_tui.app.screens.launch import LaunchScreen
from tests.tui_support import FakeClient, frozen_clock, snapshot_configs, wait_for

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((160, 48), id="160x48")]


def make_app(tmp_path: Path) -> SwarmApp:
    return SwarmApp(FakeClient(), clock=frozen_clock, refresh_s=None, tick_s=None, flush_s=0,
                    configs_dir=snapshot_configs(tmp_path))


def steps(keys: Sequence[str] = (), until: Callable[[SwarmApp], Any] | None = None
          ) -> Callable[[Pilot], Awaitable[None]]:
    """Wait for the fixed data, press ``keys``, wait for ``until``; no blinking cursors."""

    async def run_before(pilot: Pilot) -> None:
        app: SwarmApp = pilot.app  # type: ignore[assignment]
        await wait_for(pilot, lambda: app.snapshots >= 1 and app.connection == "live"
                       and app.model.events_seen >= app.client.expected_events,  # type: ignore
                       "the fixed data")
        for key in keys:
            await pilot.press(key)
            await pilot.pause()
        if until is not None:
            await wait_for(pilot, lambda: until(app), "the screen")
        await pilot.pause()
        for inp in app.screen.query(Input):
            inp.cursor_blink = False
        await pilot.pause()

    return run_before


@pytest.mark.parametrize("size", SIZES)
def test_fellows(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=steps())


@pytest.mark.parametrize("size", SIZES)
def test_fellow_detail(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=steps(
        ["enter"], lambda app: isinstance(app.screen, FellowDetailScreen)))


@pytest.mark.parametrize("size", SIZES)
def test_jobs(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=steps(
        ["2"], lambda app: isinstance(app.screen, JobsScreen) and app.screen.table.row_count))


@pytest.mark.parametrize("size", SIZES)
def test_job_watch(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=steps(
        ["2", "enter"], lambda app: isinstance(app.screen, JobWatchScreen)
        and app.screen.job_id == "job-000002"))


@pytest.mark.parametrize("size", SIZES)
def test_launch(snap_compare, tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(make_app(tmp_path), terminal_size=size, run_before=steps(
        ["3"], lambda app: isinstance(app.screen, LaunchScreen)))


def test_launch_profiles(snap_compare, tmp_path: Path) -> None:
    async def profile_form(pilot: Pilot) -> None:
        await steps(["3"], lambda app: isinstance(app.screen, LaunchScreen))(pilot)
        pilot.app.screen.query_one("#source", Select).value = "profiles"
        await wait_for(pilot, lambda: pilot.app.screen.query_one("#row-model").display,
                       "the profile form")
        await pilot.pause(0.1)

    assert snap_compare(make_app(tmp_path), terminal_size=(80, 24), run_before=profile_form)


def test_set_speed_dialog(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(make_app(tmp_path), run_before=steps(
        ["space", "space", "s"], lambda app: isinstance(app.screen, SetSpeedDialog)))


def test_set_speed_dialog_error(snap_compare, tmp_path: Path) -> None:
    async def bad_input(pilot: Pilot) -> None:
        await steps(["s"], lambda app: isinstance(app.screen, SetSpeedDialog))(pilot)
        pilot.app.screen.query_one("#rx", Input).value = "-3"
        await pilot.press("enter")

    assert snap_compare(make_app(tmp_path), run_before=bad_input)


def test_release_confirmation(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(make_app(tmp_path), run_before=steps(
        ["r"], lambda app: isinstance(app.screen, ConfirmDialog)))


def test_help(snap_compare, tmp_path: Path) -> None:
    assert snap_compare(make_app(tmp_path), run_before=steps(
        ["question_mark"], lambda app: isinstance(app.screen, HelpScreen)))
