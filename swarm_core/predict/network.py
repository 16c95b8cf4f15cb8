"""The links a prediction runs over, as a function of who talks to whom.

A cell is one stage replica, (stage, replica): one fellow's data plane. Today's data plane
shapes each fellow as a whole (one tx and one rx token bucket shared by all its peer
connections, plus a one-way latency its sender adds per frame), and a network profile gives
every fellow the same limits: :class:`UniformNetwork`. Under a link matrix (per-pair links,
issue 40 point 1) each peer link also passes its site pair's own bucket, and a cell its site's
up and down caps: :class:`MatrixNetwork`. The predictor asks only these three questions.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from swarm_core.config.network import LinkMatrix

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


def _tighter(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


@attrs.frozen
class MatrixNetwork:
    """A link matrix over a uniform profile: a cell's tx and rx are the tighter of the
    profile's caps and its site's up and down caps; a pair is its site pair's rate, and its
    latency the pair's plus the profile's (the sender adds both)."""

    matrix: LinkMatrix
    stages: int
    uniform: UniformNetwork = UniformNetwork()
    # Cells whose site is not the matrix's rule's, (stage, id, site) each: a peer a
    # rebalancing move took elsewhere keeps its own (``StagePlacement.site``).
    placed: tuple[tuple[int, int, str], ...] = ()

    @property
    def name(self) -> str:
        return self.uniform.name

    def _site(self, cell: Cell) -> str:
        return self.matrix.site_of(cell[0], cell[1], self.stages, self)

    def site(self, stage: int, replica: int) -> str | None:
        """A cell's site where it is not the matrix's rule's (``config.network.Placed``: what
        the selective-compression rule reads first); None where the rule's."""
        return next((site for s, r, site in self.placed if (s, r) == (stage, replica)), None)

    def moved(self, src: Cell, dst: Cell) -> MatrixNetwork:
        """The network after the peer of cell ``src`` became cell ``dst``: it keeps its site."""
        kept = tuple(x for x in self.placed if (x[0], x[1]) not in (src, dst))
        return attrs.evolve(self, placed=(*kept, (*dst, self._site(src))))

    def tx(self, cell: Cell) -> Link:
        up = self.matrix.sites[self._site(cell)].up_mbps
        return Link(_tighter(self.uniform.tx_mbps, up), self.uniform.latency_ms / 1000.0)

    def rx(self, cell: Cell) -> Link:
        down = self.matrix.sites[self._site(cell)].down_mbps
        return Link(_tighter(self.uniform.rx_mbps, down), 0.0)

    def pair(self, src: Cell, dst: Cell) -> Link:
        own = self.matrix.pair(self._site(src), self._site(dst))
        latency = self.uniform.latency_ms + (0.0 if own is None else own.latency_ms)
        return Link(None if own is None else own.mbps, latency / 1000.0)


def network_for(profile: dict[str, Any], matrix: LinkMatrix | None,
                stages: int) -> UniformNetwork | MatrixNetwork:
    """The network a run's profile (``RunSpec.network``, or a job's ``training.link``) and
    its training's link matrix describe."""
    uniform = UniformNetwork.of(profile) if profile else UniformNetwork()
    return uniform if matrix is None else MatrixNetwork(matrix, stages, uniform)
