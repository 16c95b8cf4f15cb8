"""The console's plots with axes (plotext): ticks and scales, and what the job watch and the
fellow detail draw from the fixed data at 80x24: axis labels, eval points and set-speed marks
at the right places, a link's limit, an idle link along the bottom."""

from __future__ import annotations

import re

import pytest

from swarm_tui.app.widgets.plot import MetricPlot, PlotSpec, nice_ticks, nice_top, thin
from tests.tui_support import T0, FakeClient, screen_text, wait_for
from tests.unit.test_tui_views import idle_heartbeat, loaded, make_app

SIZE = (80, 24)


def test_ticks_tops_and_thinning() -> None:
    assert nice_ticks(0, 120, 9, whole=True) == [0, 20, 40, 60, 80, 100, 120]
    assert nice_ticks(90, 120, 4, whole=True) == [90, 100, 110, 120]
    assert nice_ticks(-29.0, 0.0, 4) == [-20, -10, 0]
    assert nice_ticks(0, 3, 9, whole=True) == [0, 1, 2, 3]  # (no half steps)
    assert [nice_top(v) for v in (0, 0.7, 1830 * 1.05, 80)] == [1.0, 1.0, 2000, 100]
    xs, ys = thin(list(range(1000)), [float(i) for i in range(1000)], 10)
    assert len(xs) == 10 and xs[-1] == 999 and ys[0] == pytest.approx(49.5)
    assert thin([1, 2], [3.0, 4.0], 10) == ([1, 2], [3.0, 4.0])
    # A link's axis from 0 to its limit; a flat series gets a band; data sets the rest.
    assert PlotSpec((0.0,), (0.0,), "s", "Mbit/s", y_min=0, y_max=80).y_range() == (0, 80)
    assert PlotSpec((0.0,), (2.0,), "step", "loss").y_range() == (1.9, 2.1)
    spec = PlotSpec((1.0, 2.0), (3.0, 2.0), "step", "loss", points=((2.0, 3.5),))
    assert spec.y_range() == (2.0, 3.5)


def plot_lines(app, widget_id: str) -> list[str]:
    """What the plot with this id shows, row by row (its part of the screen)."""
    plot = app.screen.query_one(f"#{widget_id}", MetricPlot)
    r = plot.content_region
    return [line[r.x:r.x + r.width] for line in screen_text(app).splitlines()[r.y:r.y + r.height]]


class Axes:
    """A plotext plot read back from its text: the column of each x tick's value, the row of
    each y tick's label, the data rows between the frame's top and bottom."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.top = next(i for i, ln in enumerate(lines) if "┌" in ln)
        self.bottom = next(i for i, ln in enumerate(lines) if "└" in ln)
        ticks = [c for c, ch in enumerate(lines[self.bottom]) if ch in "┬┴"]
        self.x: dict[float, int] = {}
        for m in re.finditer(r"-?\d+(?:\.\d+)?", lines[self.bottom + 1]):
            centre = (m.start() + m.end() - 1) / 2
            self.x[float(m.group())] = min(ticks, key=lambda c, ce=centre: abs(c - ce))
        self.left = lines[self.top].index("┌")
        self.right = lines[self.top].index("┐")
        self.y: dict[str, int] = {}
        for row in range(self.top + 1, self.bottom):
            label = lines[row][:self.left].strip()
            if label:
                self.y[label] = row
        self.label_row = lines[self.bottom + 2]

    def data_rows(self) -> list[str]:
        return [ln[self.left + 1:self.right] for ln in self.lines[self.top + 1:self.bottom]]

    def vertical_marks(self) -> list[int]:
        """Columns (of the plot) where a vertical line runs from the frame's top (which has no
        ticks: a ┬ there is a line's end) through the data rows, where the curve does not
        cover it."""
        rows = self.lines[self.top + 1:self.bottom]
        return [c for c in range(self.left + 1, self.right)
                if self.lines[self.top][c] == "┬" and any(r[c] in "│┼" for r in rows)]

    def found(self, ch: str) -> list[tuple[int, int]]:
        return [(row, c) for row in range(self.top + 1, self.bottom)
                for c, got in enumerate(self.lines[row]) if got == ch]

    def y_at(self, row: int, hi: str, lo: str) -> float:
        r_hi, r_lo = self.y[hi], self.y[lo]
        return float(hi) - (row - r_hi) / (r_lo - r_hi) * (float(hi) - float(lo))


async def test_the_watch_views_loss_plot_has_axes_evals_and_set_speed_marks() -> None:
    from swarm_tui.app.screens.jobs import JobWatchScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        app.watch_job("job-000002")
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                       and "job-000002" in client.fetched and "◆" in screen_text(app),
                       "the watch view's plot")
        await pilot.pause()
        ax = Axes(plot_lines(app, "curve"))
        # y: the bottom, middle and top of the losses (and eval losses), unit beside them.
        assert list(ax.y) == ["5.98", "4.22", "2.46"]
        assert ax.y["4.22"] - ax.y["5.98"] == ax.y["2.46"] - ax.y["4.22"]  # mid on its row
        # x: steps, round ticks across the whole run.
        assert sorted(ax.x) == [0, 20, 40, 60, 80, 100, 120]
        assert ax.label_row.split()[0] == "loss" and "step  (◆ eval, │ set-speed)" in \
            ax.label_row
        # The set-speed from step 100: one vertical mark, on the tick of step 100.
        assert ax.vertical_marks() == [ax.x[100]]
        # Eval points at steps 40, 80 and 120, each on the row of its loss.
        evals = {40.0: 4.15, 80.0: 3.12, 120.0: 2.55}
        marks = ax.found("◆")
        assert sorted(c for _r, c in marks) == [ax.x[s] for s in sorted(evals)]
        spacing = (5.98 - 2.46) / (ax.y["2.46"] - ax.y["5.98"])
        for row, col in marks:
            step = next(s for s, c in ax.x.items() if c == col)
            assert abs(ax.y_at(row, "5.98", "2.46") - evals[step]) <= spacing / 2 + 1e-6
        # A live eval report adds its point.
        app.apply_event({"seq": (app.model.last_seq or 0) + 1, "ts": T0, "type": "metric",
                         "data": {"job_id": "job-000002", "fellow_id": 1, "stage": 1,
                                  "step": 124, "loss": None, "state": "RUNNING",
                                  "metrics": {"eval_loss": 2.5}}})
        await wait_for(pilot, lambda: len(Axes(plot_lines(app, "curve")).found("◆")) == 4,
                       "the new eval point")


async def test_the_fellow_detail_plots_rates_against_limits_and_marks_its_set_speed() -> None:
    from swarm_tui.app.screens.fellows import FellowDetailScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        app.push_screen(FellowDetailScreen(0))
        await wait_for(pilot, lambda: "tx 16.0 of 80 Mbit/s" in screen_text(app), "gpu-a")
        await pilot.pause()
        for side in ("tx", "rx"):
            ax = Axes(plot_lines(app, f"{side}-plot"))
            # From 0 to the 80 Mbit/s limit, whose line is the top row.
            assert list(ax.y) == ["80", "40", "0"]
            assert set(ax.data_rows()[0]) <= {"─", "┼"}
            assert ax.label_row.split()[0] == "Mbit/s" and "seconds" in ax.label_row
            # The last half minute, now at the right; the set-speed 20 s ago marked.
            assert sorted(ax.x) == [-20, -10, 0] and ax.x[0] == ax.right - 1
            assert ax.vertical_marks() == [ax.x[-20]]
        ax = Axes(plot_lines(app, "loss-plot"))
        assert sorted(ax.x) == [90, 100, 110, 120]  # its steps; its link set from step 100
        assert ax.vertical_marks() == [ax.x[100]] and ax.label_row.split()[0] == "loss"
        ax = Axes(plot_lines(app, "tps-plot"))
        assert list(ax.y) == ["2000", "1000", "0"] and ax.label_row.split()[0] == "tok/s"


async def test_an_idle_link_is_a_line_along_the_bottom_not_saturated() -> None:
    from swarm_tui.app.screens.fellows import FellowDetailScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 30)) as pilot:
        await loaded(pilot, app, client)
        seq = app.model.last_seq or 0
        for i in range(1, 4):
            app.apply_event(idle_heartbeat(seq + i, T0 + i))
        assert app.model.fellows[5].tx_mbps == 0.0
        app.push_screen(FellowDetailScreen(5))
        await wait_for(pilot, lambda: "tx 0.00 of 10 Mbit/s (0%)" in screen_text(app),
                       "the idle link's pane")
        await pilot.pause()
        ax = Axes(plot_lines(app, "tx-plot"))
        assert list(ax.y) == ["10", "5", "0"]
        rows = ax.data_rows()
        braille = [any("\u2800" < ch <= "\u28ff" for ch in row) for row in rows]
        assert braille == [False, False, True]  # only the bottom row (0 Mbit/s) is drawn
