"""Plots with axes (plotext, through textual-plotext): one series against steps or time, its y
axis ticked at its bottom, middle and top with the unit beside it, eval points marked and
set-speed changes drawn as vertical marks.

What is drawn is described by a ``PlotSpec`` (plain data, so views and tests build and compare
them without a terminal); the widget redraws only when its spec changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs
from rich.text import Text
from textual.app import RenderResult
from textual_plotext import PlotextPlot
from textual_plotext.plot import Plot as Figure

EVAL_MARKER = "⠤"  # (a dash of braille dots at the eval's value, in EVAL_COLOR)
LEFT_MARKER, JOINED_MARKER = "▼", "▲"  # a replica left / joined (over a vertical mark)
LEFT_COLOR, JOINED_COLOR = "red", "green"
MARK_COLOR = "orange"  # set-speed marks
EVAL_COLOR = "magenta"
LIMIT_COLOR = "red"


def fmt_tick(value: float) -> str:
    """A tick label in at most five characters or so: 0, 0.25, 3.14, 42.5, 1830, 12.3k."""
    v = abs(value)
    if v >= 10_000:
        return f"{value / 1000:.0f}k" if v >= 100_000 else f"{value / 1000:.1f}k"
    if v >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.1f}" if v >= 10 else f"{value:.2f}"


@attrs.frozen
class PlotSpec:
    """One series and its marks. ``xs`` ascend. ``y_min``/``y_max`` fix the axis (a link's
    rate is drawn from 0 to its limit, so an idle link is a line along the bottom, not a
    full-height graph); else it spans the data."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    x_label: str  # what the x axis counts: "step", "seconds"
    unit: str  # the y axis's unit, beside its ticks
    empty: str = "no data yet"  # said instead of a plot without points
    y_min: float | None = None
    y_max: float | None = None
    limit: float | None = None  # a horizontal line (a link's limit)
    points: tuple[tuple[float, float], ...] = ()  # marked points (eval losses)
    marks: tuple[float, ...] = ()  # vertical marks at these x (set-speed changes)
    # Where replicas left and joined (a job of several): marked vertical lines, ▼ and ▲.
    left: tuple[float, ...] = ()
    joined: tuple[float, ...] = ()
    fmt: Callable[[float], str] = fmt_tick
    whole_x: bool = False  # the x axis counts whole things (steps): whole ticks
    # The x axis's ends where they are not the data's (a time axis runs to now, 0).
    x_lo: float | None = None
    x_hi: float | None = None
    # A logarithmic y axis (positive values only): a spike does not flatten the tail.
    log_y: bool = False

    def y_range(self) -> tuple[float, float]:
        """The y axis's ends, in the axis's own terms (of a log axis: log10 of the values)."""
        values = [*self.ys, *(y for _x, y in self.points)]
        if self.log_y:
            values = [math.log10(v) for v in values if v > 0]
            lo = min(values, default=0.0)
            hi = max(values, default=1.0)
            if hi <= lo:
                lo, hi = lo - 0.05, hi + 0.05
            return lo, hi
        lo = self.y_min if self.y_min is not None else min(values, default=0.0)
        hi = self.y_max if self.y_max is not None else max(values, default=1.0)
        if hi <= lo:  # a flat series: a band around it
            pad = abs(lo) * 0.05 or 1.0
            lo, hi = (lo, lo + pad) if self.y_min is not None else (lo - pad, hi + pad)
        return lo, hi

    def y_of(self, value: float) -> float:
        """Where a value goes on the y axis (of a log axis, its log10)."""
        if not self.log_y:
            return value
        return math.log10(value) if value > 0 else self.y_range()[0]

    def x_range(self) -> tuple[float, float]:
        # (an eval may come in before the step's loss does)
        xs = [self.xs[0], self.xs[-1], *(x for x, _y in self.points)]
        lo = min(xs) if self.x_lo is None else min(self.x_lo, *xs)
        hi = max(xs) if self.x_hi is None else max(self.x_hi, *xs)
        return (lo, hi) if hi > lo else (lo - 1, hi + 1)


def nice_ticks(lo: float, hi: float, n: int, *, whole: bool = False) -> list[float]:
    """About ``n`` ticks at round values (1, 2, 2.5 or 5 times a power of ten) within
    [lo, hi]; ``whole``: whole numbers only (steps)."""
    span = hi - lo
    if span <= 0 or n < 2:
        return [lo]
    raw = span / (n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    if whole:
        step = max(1.0, float(round(step)))
    first = math.ceil(lo / step - 1e-9) * step
    count = math.floor((hi - first) / step + 1e-9) + 1
    return [round(first + i * step, 9) for i in range(count)]


def nice_top(value: float) -> float:
    """The smallest round value (1, 2, 2.5 or 5 times a power of ten) at or above ``value``:
    the top of an axis from 0."""
    if value <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(value))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= value * (1 - 1e-9))


def thin(xs: Sequence[float], ys: Sequence[float], n: int) -> tuple[list[float], list[float]]:
    """At most ``n`` points: the means of equal runs of them, the newest kept as it is (a
    run's history may hold a hundred thousand steps; a terminal shows a few hundred)."""
    if n <= 0 or len(xs) <= n:
        return list(xs), list(ys)
    size = len(xs) / n
    out_x, out_y = [], []
    for i in range(n):
        a, b = int(i * size), max(int((i + 1) * size), int(i * size) + 1)
        out_x.append(sum(xs[a:b]) / (b - a))
        out_y.append(sum(ys[a:b]) / (b - a))
    out_x[-1], out_y[-1] = xs[-1], ys[-1]
    return out_x, out_y


def draw(plt: Figure, spec: PlotSpec, width: int) -> None:
    """Build ``spec`` into a cleared plotext figure."""
    lo, hi = spec.y_range()
    x0, x1 = spec.x_range()
    xs, ys = thin(spec.xs, [spec.y_of(y) for y in spec.ys],
                  2 * max(1, width))  # (braille: two points a column)
    plt.plot(xs, ys, marker="braille")
    # Eval points at the line's resolution (a braille dot is a quarter of a row): a short
    # dash at the value, a column either side. A marker glyph fills a row: with five rows of
    # data, an eval of 2.94 sat where the line read 3.38.
    dx = (x1 - x0) / max(1, width - 6)  # (about a column: the frame and y ticks take some)
    for x, y in spec.points:
        if x0 <= x <= x1:
            at = spec.y_of(y)
            plt.plot([max(x0, x - dx), min(x1, x + dx)], [at, at], marker="braille",
                     color=EVAL_COLOR)
    marks = [x for x in spec.marks if x0 <= x <= x1]  # (one outside would stretch the axis)
    for x in marks:
        plt.vline(x, MARK_COLOR)
    members = []
    for xs_at, marker, color, what in ((spec.left, LEFT_MARKER, LEFT_COLOR, "left"),
                                       (spec.joined, JOINED_MARKER, JOINED_COLOR, "joined")):
        steps = [x for x in xs_at if x0 <= x <= x1]
        for x in steps:
            plt.vline(x, color)
        if steps:
            plt.scatter(steps, [hi] * len(steps), marker=marker, color=color)  # (the top row)
            members.append(f"{marker} {what}")
    if spec.limit is not None and lo <= spec.y_of(spec.limit) <= hi:
        plt.hline(spec.y_of(spec.limit), LIMIT_COLOR)
    plt.xlim(x0, x1)
    ticks = nice_ticks(x0, x1, max(3, width // 8), whole=spec.whole_x)
    plt.xticks(ticks, [fmt_tick(t) for t in ticks])
    plt.ylim(lo, hi)
    mid = (lo + hi) / 2

    def label(t: float) -> str:
        return spec.fmt(10 ** t if spec.log_y else t)

    plt.yticks([lo, mid, hi], [label(lo), label(mid), label(hi)])
    # The key to the marks goes with the x axis's name, on the plot's last row.
    key = ([f"{EVAL_MARKER} eval"] if spec.points else []) + \
        (["│ set-speed"] if marks else []) + members
    plt.xlabel(spec.x_label + (f"  ({', '.join(key)})" if key else ""))
    plt.ylabel(spec.unit + (" (log)" if spec.log_y else ""))


class MetricPlot(PlotextPlot):
    """A ``PlotSpec`` drawn with plotext; ``show`` a new one to redraw."""

    DEFAULT_CSS = """
    MetricPlot { height: 8; width: 1fr; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.spec: PlotSpec | None = None

    def show(self, spec: PlotSpec) -> None:
        if spec != self.spec:
            self.spec = spec
            self.refresh()

    def render(self) -> RenderResult:
        spec = self.spec
        if spec is None or not spec.xs:
            return Text(spec.empty if spec is not None else "", style="italic")
        self.plt.clear_figure()
        draw(self.plt, spec, self.size.width)
        return super().render()
