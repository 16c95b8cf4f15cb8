"""Slow peers, emulated: a stage's compute padded to ``slowdown`` times its measured time.

One machine can then hold a heterogeneous swarm (a fellow told ``--slowdown 4`` computes like a
GPU four times slower) beside link shaping. The padding is a sleep after each forward or
backward op, of (X - 1) times that op's own compute: its wall time less what it sat blocked on
its links, so a slowed stage waiting on a neighbour is not slowed twice. Artifacts name it as
emulation (``StageMetrics.slowdown``), never as the stage's own speed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from swarm_core.protocol import SLOWDOWN_MAX

# Sleeps longer than this are cut in slices, each after a stop check: a stage told to stop
# ends within a slice, and its liveness keeps moving through a long pad.
SLICE_S = 0.25


class Pace:
    """A fellow's emulated slowdown, shared by its stages; set live (SET_SPEED), read by the
    stage thread before each op's padding, so a change applies from the next micro-batch."""

    def __init__(self, slowdown: float = 1.0) -> None:
        self.slowdown = slowdown
        # What the padding added and what it padded, over this Pace's life (tests, reports).
        self.padded_s = 0.0
        self.compute_s = 0.0

    @property
    def slowdown(self) -> float:
        return self._slowdown

    @slowdown.setter
    def slowdown(self, value: float) -> None:
        if not 1.0 <= value <= SLOWDOWN_MAX:  # (the API and the CLI checked it: a bug here)
            raise ValueError(f"slowdown must be between 1 and {SLOWDOWN_MAX:g}, got {value}")
        self._slowdown = float(value)

    def pad(self, compute_s: float, stop: threading.Event,
            check: Callable[[], None] | None = None) -> float:
        """Sleep (X - 1) x ``compute_s`` (none at X = 1); returns the seconds it asked for.
        ``check`` runs before each slice (the stage's stop check: it raises once told to)."""
        x = self._slowdown
        self.compute_s += compute_s
        if x <= 1.0 or compute_s <= 0.0:
            return 0.0
        want = (x - 1.0) * compute_s
        self.padded_s += want
        left = want
        while left > 0.0:
            if check is not None:
                check()
            if stop.wait(min(left, SLICE_S)):
                break
            left -= SLICE_S
        return want
