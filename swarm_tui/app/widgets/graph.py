"""A bar graph of a link's rate on a fixed scale: its limit, or a floor when unlimited.

Textual's ``Sparkline`` scales to its data's own range, so an idle link (rates of 0.00 and
0.001) or a single sample drew as solid blocks, "saturated". Here the top of the graph is
``top`` (the link's limit) and zero is blank.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

BARS = " ▁▂▃▄▅▆▇█"  # eighths of a row; a space is nothing
FLOOR_MBPS = 1.0  # the top of an unlimited link's graph, unless it has carried more


def graph_top(limit: float | None, data: Sequence[float]) -> float:
    """Where the graph's top is: the limit (a rate over it, as a burst through the bucket
    shows, raises it), else the floor or the busiest sample."""
    busiest = max(data, default=0.0)
    return max(limit if limit is not None else FLOOR_MBPS, busiest)


def bars(data: Sequence[float], top: float, width: int, height: int) -> list[str]:
    """Rows of the graph, top row first: the newest ``width`` samples, one column each
    (right-aligned: new samples come in on the right)."""
    recent = list(data)[-width:] if width > 0 else []
    full = height * 8
    # (any traffic at all shows as at least an eighth: a trickle is not an idle link)
    levels = [0 if v <= 0 or top <= 0 else max(1, min(full, round(v / top * full)))
              for v in recent]
    return ["".join(BARS[max(0, min(8, level - row * 8))] for level in levels).rjust(width)
            for row in reversed(range(height))]


class LinkGraph(Widget):
    """The rate of one side of a link (Mbit/s), against ``top``."""

    DEFAULT_CSS = """
    LinkGraph { height: 3; color: $accent; }
    """

    data: reactive[tuple[float, ...]] = reactive(tuple)
    top: reactive[float] = reactive(FLOOR_MBPS)

    def show(self, data: Sequence[float], limit: float | None) -> None:
        self.data = tuple(data)
        self.top = graph_top(limit, self.data)

    def render(self) -> Text:
        width, height = self.size.width, max(1, self.size.height)
        return Text("\n".join(bars(self.data, self.top, width, height)), no_wrap=True)
