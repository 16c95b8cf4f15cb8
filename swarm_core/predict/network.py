"""The links a prediction runs over, as a function of who talks to whom.

A cell is one stage replica, (stage, replica): one fellow's data plane. Today's data plane
shapes each fellow as a whole (one tx and one rx token bucket shared by all its peer
connections, plus a one-way latency its sender adds per frame), and a network profile gives
every fellow the same limits: :class:`UniformNetwork`. Per-pair links (a site matrix, issue 40
point 1) plug in as another :class:`Network` whose ``pair`` answers from the matrix; the
predictor asks only these three questions.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

Cell = tuple[int, int]  # (stage, replica)


@attrs.frozen
class Link:
    """A rate (Mbit/s; None: unshaped) and a one-way latency (seconds)."""

    mbps: float | None
    latency_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """A transfer of B bytes at R bit/s with latency L takes L + 8B/R (no rate: L)."""
        return self.latency_s + (0.0 if self.mbps is None else 8 * nbytes / (self.mbps * 1e6))


class Network(Protocol):
    @property
    def name(self) -> str:
        """As tables show it: the profile's name."""
        ...

    def tx(self, cell: Cell) -> Link:
        """What the cell may send in all, to every peer together."""
        ...

    def rx(self, cell: Cell) -> Link:
        """What the cell may receive in all (its latency is the sender's: 0 here)."""
        ...

    def pair(self, src: Cell, dst: Cell) -> Link:
        """The link from ``src`` to ``dst`` itself (a site matrix's entry)."""
        ...


@attrs.frozen
class UniformNetwork:
    """One profile for every fellow: tx and rx caps, and a latency on every frame sent."""

    name: str = "unconstrained"
    tx_mbps: float | None = None
    rx_mbps: float | None = None
    latency_ms: float = 0.0

    @classmethod
    def of(cls, profile: dict[str, Any]) -> UniformNetwork:
        """From a network profile as a resolved run holds it (``RunSpec.network``) or a job's
        ``training.link`` (``LinkLimits``)."""
        return cls(name=str(profile.get("name") or "link"), tx_mbps=profile.get("tx_mbps"),
                   rx_mbps=profile.get("rx_mbps"),
                   latency_ms=float(profile.get("latency_ms") or 0.0))

    def with_rate(self, mbps: float | None) -> UniformNetwork:
        """The same profile with both caps at ``mbps``."""
        return attrs.evolve(self, tx_mbps=mbps, rx_mbps=mbps)

    def tx(self, cell: Cell) -> Link:
        return Link(self.tx_mbps, self.latency_ms / 1000.0)

    def rx(self, cell: Cell) -> Link:
        return Link(self.rx_mbps, 0.0)

    def pair(self, src: Cell, dst: Cell) -> Link:
        return Link(None, self.latency_ms / 1000.0)  # (no cap of its own today)
