"""The scale of a link's rate plot: its limit, or a floor when unlimited.

Textual's ``Sparkline`` scaled to its data's own range, so an idle link (rates of 0.00 and
0.001) or a single sample drew as solid blocks, "saturated". A link's plot runs from 0 to
``graph_top`` (the link's limit), so an idle link is a line along the bottom.
"""

from __future__ import annotations

from collections.abc import Sequence

FLOOR_MBPS = 1.0  # the top of an unlimited link's plot, unless it has carried more


def graph_top(limit: float | None, data: Sequence[float]) -> float:
    """Where the plot's top is: the limit (a rate over it, as a burst through the bucket
    shows, raises it), else the floor or the busiest sample."""
    busiest = max(data, default=0.0)
    return max(limit if limit is not None else FLOOR_MBPS, busiest)
