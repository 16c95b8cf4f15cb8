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


# Braille dots by (row, column) within a cell: the bit of each.
_DOTS = {0x01: (0, 0), 0x02: (1, 0), 0x04: (2, 0), 0x40: (3, 0),
         0x08: (0, 1), 0x10: (1, 1), 0x20: (2, 1), 0x80: (3, 1)}


def eval_dots(app, widget_id: str) -> list[tuple[int, int, int]]:
    """The eval marks of a plot (braille in the eval colour): (row, column, dot row 0-3 in
    the cell) of each of their cells."""
    from swarm_tui.app.widgets.plot import EVAL_COLOR

    plot = app.screen.query_one(f"#{widget_id}", MetricPlot)
    text = plot.render()
    starts = [0]
    for i, ch in enumerate(text.plain):
        if ch == "\n":
            starts.append(i + 1)
    want = {"magenta": "color(5)"}.get(EVAL_COLOR, EVAL_COLOR)
    out = []
    for span in text.spans:
        if want not in str(span.style):
            continue
        for i in range(span.start, span.end):
            code = ord(text.plain[i]) - 0x2800
            if not 0 < code <= 0xFF:
                continue
            row = max(r for r, st in enumerate(starts) if st <= i)
            for bit, (dot_row, _c) in _DOTS.items():
                if code & bit:
                    out.append((row, i - starts[row], dot_row))
                    break
    return out


async def test_the_watch_views_loss_plot_has_axes_evals_and_set_speed_marks() -> None:
    from swarm_tui.app.screens.jobs import JobWatchScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(pilot, app, client)
        app.watch_job("job-000002")
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                       and "job-000002" in client.fetched
                       and "eval" in "".join(plot_lines(app, "curve")),
                       "the watch view's plot")
        await pilot.pause()
        ax = Axes(plot_lines(app, "curve"))
        # y: the bottom, middle and top of the losses (and eval losses), unit beside them.
        assert list(ax.y) == ["5.98", "4.22", "2.46"]
        assert ax.y["4.22"] - ax.y["5.98"] == ax.y["2.46"] - ax.y["4.22"]  # mid on its row
        # x: steps, round ticks across the whole run.
        assert sorted(ax.x) == [0, 20, 40, 60, 80, 100, 120]
        assert ax.label_row.split()[0] == "loss" and "step  (⠤ eval, │ set-speed)" in \
            ax.label_row
        # The set-speed from step 100: one vertical mark, on the tick of step 100.
        assert ax.vertical_marks() == [ax.x[100]]
        # Eval points at steps 40, 80 and 120: a dash of braille dots around the step's
        # column, at the line's resolution (a quarter of a row): within a dot of its loss.
        evals = {40.0: 4.15, 80.0: 3.12, 120.0: 2.55}
        dots = eval_dots(app, "curve")
        rows = ax.y["2.46"] - ax.y["5.98"] + 1  # (the data rows, top tick's to bottom's)
        dot = (5.98 - 2.46) / (4 * rows - 1)  # (between two braille dot rows, in loss)
        for step, loss in evals.items():
            near = [(r, d) for r, c, d in dots if abs(c - ax.x[step]) <= 1]
            assert near, (step, dots)
            for row, dot_row in near:
                value = 5.98 - ((row - ax.y["5.98"]) * 4 + dot_row) * dot
                assert abs(value - loss) <= dot, (step, value, loss)
        assert dot < (5.98 - 2.46) / 8 / 2  # (finer than half a row of the old 9-row plot)
        # A live eval report adds its point.
        app.apply_event({"seq": (app.model.last_seq or 0) + 1, "ts": T0, "type": "metric",
                         "data": {"job_id": "job-000002", "fellow_id": 1, "stage": 1,
                                  "step": 124, "loss": None, "state": "RUNNING",
                                  "metrics": {"eval_loss": 2.5}}})
        await wait_for(pilot, lambda: len(app.screen.query_one("#curve", MetricPlot).spec
                                          .points) == 4, "the new eval point")
        ax = Axes(plot_lines(app, "curve"))
        assert any(abs(c - ax.x[120]) <= 3 and c > ax.x[120] for _r, c, _d in
                   eval_dots(app, "curve"))


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
        # only the bottom row (0 Mbit/s) is drawn (at 30 rows the plots have five)
        assert braille == [False] * (len(rows) - 1) + [True] and len(rows) == 5


async def test_the_plots_grow_with_the_terminal() -> None:
    """At 80x24 the watch's loss plot has 9 rows (five of data); at 120x40 it takes the rows
    the table does not need (it left 20 empty), odd, so the middle tick has its row; the
    fellow detail's panes grow too."""
    from swarm_tui.app.screens.fellows import FellowDetailScreen
    from swarm_tui.app.screens.jobs import JobWatchScreen

    client = FakeClient()
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        app.watch_job("job-000002")
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                       and "job-000002" in client.fetched, "the watch")
        curve = app.screen.query_one("#curve", MetricPlot)
        await pilot.pause()
        small = curve.size.height
        assert small >= 9 and small % 2 == 1
        await pilot.resize_terminal(120, 40)
        await wait_for(pilot, lambda: curve.size.height >= small + 14, "a taller plot")
        assert curve.size.height % 2 == 1
        lines = screen_text(app).splitlines()
        assert sum(1 for line in lines if not line.strip()) <= 3, "\n".join(lines)
        ax = Axes(plot_lines(app, "curve"))
        assert list(ax.y) == ["5.98", "4.22", "2.46"]
        assert ax.y["4.22"] - ax.y["5.98"] == ax.y["2.46"] - ax.y["4.22"]
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, JobWatchScreen), "back")
        await pilot.pause()
        app.push_screen(FellowDetailScreen(0))
        await wait_for(pilot, lambda: isinstance(app.screen, FellowDetailScreen)
                       and app.screen.query("#tx-plot"), "detail")
        plot = app.screen.query_one("#tx-plot", MetricPlot)
        await wait_for(pilot, lambda: plot.size.height >= 15, "taller panes")
        assert plot.size.height % 2 == 1


async def test_the_loss_plot_zooms_log_y_and_from_a_step() -> None:
    """A spike at the first step flattens the tail: `L` draws the loss on a log axis, `z`
    from a later step (10%, 50%, 90% of the steps in, then the whole run again)."""
    import attrs

    from swarm_tui.app.screens.jobs import JobWatchScreen

    client = FakeClient()
    history = [[0.0, 90.0]] + [[float(s), 6.0 - 4.5 * s / 200] for s in range(1, 201)]
    client._jobs = [attrs.evolve(j, loss_history=history, last_step=200, eval_history=[
        [100.0, 3.6]]) if j.job_id == "job-000002" else j for j in client._jobs]
    app = make_app(client)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        app.watch_job("job-000002")
        await wait_for(pilot, lambda: isinstance(app.screen, JobWatchScreen)
                       and "201 points" in screen_text(app), "the whole history")
        curve = app.screen.query_one("#curve", MetricPlot)
        await pilot.pause()

        def tail_rows() -> int:
            """The data rows the tail (steps 1-200) takes."""
            ax = Axes(plot_lines(app, "curve"))
            start = ax.x[min(t for t in ax.x if t > 0)]
            rows = ax.data_rows()
            return sum(1 for r in rows if any("\u2800" < ch <= "\u28ff"
                                              for ch in r[start - ax.left:]))

        linear = tail_rows()
        assert linear <= 2  # (90 at step 0: the tail is a line along the bottom)
        await pilot.press("L")
        await wait_for(pilot, lambda: curve.spec is not None and curve.spec.log_y, "log y")
        await pilot.pause()
        assert "log y (L)" in screen_text(app)
        assert Axes(plot_lines(app, "curve")).label_row.split()[:2] == ["loss", "(log)"]
        assert tail_rows() > linear
        await pilot.press("L", "z")
        await wait_for(pilot, lambda: curve.spec is not None and not curve.spec.log_y
                       and curve.spec.xs[0] == 20.0, "from step 20")
        assert "from step 20 (z)" in screen_text(app)
        await pilot.pause()
        ax = Axes(plot_lines(app, "curve"))
        assert min(ax.x) >= 20 and next(iter(ax.y)) == "5.55"  # (the spike is out of range)
        await pilot.press("z")
        await wait_for(pilot, lambda: curve.spec.xs[0] == 100.0, "from step 100")
        assert curve.spec.points == ((100.0, 3.6),)
        await pilot.press("z", "z")
        await wait_for(pilot, lambda: curve.spec.xs[0] == 0.0, "the whole run again")


async def test_a_links_plot_runs_to_now_with_its_set_speed_marks() -> None:
    """An idle link sampled once, 90 s ago (its rate has not changed since): the tx plot runs
    from then to now (0 at the right), the rate held along the way, and the set-speed sent
    meanwhile is marked at its time (not one dot on a one-second axis)."""
    from swarm_tui.app.app import SwarmApp
    from swarm_tui.app.screens.fellows import FellowDetailScreen

    client = FakeClient()
    now = [T0]
    app = SwarmApp(client, clock=lambda: now[0], refresh_s=None, tick_s=None, flush_s=0)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot, app, client)
        seq = app.model.last_seq or 0
        for i in range(1, 3):
            app.apply_event(idle_heartbeat(seq + i, T0 + i))
        assert len(app.model.fellows[5].tx_hist) == 1  # (sampled when it changes)
        app.apply_event({"seq": seq + 3, "ts": T0 + 40, "type": "fellow.set_speed", "data": {
            "fellow_id": 5, "job_id": None, "tx_mbps": 10.0, "rx_mbps": None,
            "latency_ms": 0.0}})
        for i, t in enumerate(range(10, 93, 10)):  # (heartbeats on, the counters still)
            now[0] = T0 + t
            app.apply_event(idle_heartbeat(seq + 4 + i, T0 + t))
        app.push_screen(FellowDetailScreen(5))
        await wait_for(pilot, lambda: "tx 0.00 of 10 Mbit/s" in screen_text(app), "the pane")
        await pilot.pause()
        plot = app.screen.query_one("#tx-plot", MetricPlot)
        assert plot.spec is not None and plot.spec.xs[-1] == 0.0
        assert plot.spec.x_range() == (-90.0, 0.0)
        ax = Axes(plot_lines(app, "tx-plot"))
        assert 0 in ax.x and ax.x[0] == ax.right - 1 and min(ax.x) <= -50
        bottom = ax.data_rows()[-1]
        drawn = [c for c, ch in enumerate(bottom) if "\u2800" < ch <= "\u28ff"]
        assert drawn and drawn[-1] - drawn[0] >= len(bottom) - 4  # (from then to now)
        assert ax.vertical_marks() == [ax.x[-50]]  # (the set-speed, 50 s ago)
