"""Per-pair links: sites, a site-to-site matrix of bandwidth, latency and jitter, and per-site
up/down caps (issue 40 point 1).

A job's cells (stage, replica) each sit at a site; the link from one cell to another is shaped
by its ordered pair's entry on the sender (rate, one-way latency, jitter), then by the sending
site's up cap and the receiving site's down cap, then by the fellow's own set-speed limits:
the slowest of them sets the rate. This is what DT-FM's scenario matrices describe (DS3Lab
DT-FM, ``scheduler/generate_sim_com_matrices.py``): stages across cities whose pairwise links
differ, and home peers whose down and up links differ (Covenant's ~500 / ~110 Mbit/s).
"""

from __future__ import annotations

import re
from typing import Protocol

import attrs

from swarm_core.schema import FieldError
from swarm_core.validators import bounded, meta, rate_or_none

MAX_SITES = 64
SITE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")


class Placed(Protocol):
    """A job's placement as far as sites go (``contract.placement.Placement``)."""

    def site(self, stage: int, replica: int) -> str | None: ...


@attrs.define(frozen=True)
class PairLink:
    """One ordered site pair's link: what leaves the first site for the second."""

    mbps: float | None = attrs.field(default=None, validator=rate_or_none,
                                     metadata=meta("bandwidth, Mbit/s (null: unlimited)"))
    latency_ms: float = attrs.field(default=0.0, validator=bounded(0, 60_000),
                                    metadata=meta("one-way latency, ms", minimum=0,
                                                  maximum=60000))
    # Each frame's latency is drawn from latency +- jitter (uniform, floored at 0): the mean
    # stays the latency the matrix gives, which is what a predictor and a reader expect.
    jitter_ms: float = attrs.field(default=0.0, validator=bounded(0, 60_000),
                                   metadata=meta("one-way jitter, ms (uniform +-)",
                                                 minimum=0, maximum=60000))


@attrs.define(frozen=True)
class SiteCaps:
    """A site's own access link, asymmetric: what its fellows may send and receive in all."""

    up_mbps: float | None = attrs.field(default=None, validator=rate_or_none,
                                        metadata=meta("upload cap, Mbit/s"))
    down_mbps: float | None = attrs.field(default=None, validator=rate_or_none,
                                          metadata=meta("download cap, Mbit/s"))


def _sites(_inst: object, _attr: attrs.Attribute, value: dict[str, SiteCaps]) -> None:
    if not value:
        raise FieldError("name at least one site", "sites")
    if len(value) > MAX_SITES:
        raise FieldError(f"at most {MAX_SITES} sites, got {len(value)}", "sites")
    for name in value:
        if not SITE_NAME.fullmatch(name):
            raise FieldError(f"site name {name!r}: 1-32 of letters, digits, '_', '.', '-'",
                             "sites")


@attrs.define(frozen=True)
class LinkMatrix:
    """Sites, the links between them, and where each cell of a job sits.

    ``links[a][b]`` is the link from site a to site b; a pair given one way only is taken as
    symmetric (DT-FM's matrices are), a pair not given at all is ``default`` (an error where
    there is none), and a cell talking to a cell of its own site uses ``links[a][a]`` where
    given, else an unshaped link (a rack's switch). Where a cell sits:
    ``cell_sites[replica][stage]``, else ``stage_sites[stage]`` (every replica of a stage at
    one site: a placement pinning stages to sites), else ``replica_sites[replica]`` (each
    replica's chain at one site: geo-distributed data parallel), else the sites in the order
    given, one cell after another (replica 0's stages, then replica 1's), round robin."""

    sites: dict[str, SiteCaps] = attrs.field(validator=_sites)
    links: dict[str, dict[str, PairLink]] = attrs.field(factory=dict)
    # The link between two distinct sites the matrix does not name (DT-FM's data-centre cases
    # give one figure for every pair); absent, a pair left out is an error.
    default: PairLink | None = None
    stage_sites: list[str] | None = None
    replica_sites: list[str] | None = None
    cell_sites: list[list[str]] | None = None

    def __attrs_post_init__(self) -> None:
        rules = [f for f in ("stage_sites", "replica_sites", "cell_sites")
                 if getattr(self, f) is not None]
        if len(rules) > 1:
            raise FieldError(f"give one of stage_sites, replica_sites, cell_sites, not "
                             f"{' and '.join(rules)}", rules[1])
        for src, row in self.links.items():
            self._known(src, "links")
            for dst in row:
                self._known(dst, f"links.{src}")
        for field in ("stage_sites", "replica_sites"):
            for name in getattr(self, field) or ():
                self._known(name, field)
        for cells in self.cell_sites or ():
            for name in cells:
                self._known(name, "cell_sites")
        # Every pair of distinct sites a cell could talk across needs its link: a matrix with
        # a hole would leave a link unshaped without a word.
        names = list(self.sites)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if self.pair(a, b) is None:
                    raise FieldError(f"no link between sites {a!r} and {b!r} (give "
                                     f"links.{a}.{b}, the other way round, or a default)",
                                     "links")

    def _known(self, name: str, field: str) -> None:
        if name not in self.sites:
            raise FieldError(f"site {name!r} is not one of sites ({', '.join(self.sites)})",
                             field)

    def pair(self, src: str, dst: str) -> PairLink | None:
        """The link from site ``src`` to site ``dst``; None for a site to itself where the
        matrix gives no entry (unshaped), and for a missing pair (refused at load)."""
        given = self.links.get(src, {}).get(dst)
        if given is None and src != dst:
            given = self.links.get(dst, {}).get(src) or self.default
        return given

    def site_of(self, stage: int, replica: int, num_stages: int,
                placed: Placed | None = None) -> str:
        """The site cell (stage, replica) sits at, by the rules in the class's doc; where
        ``placed`` (the job's placement) names the cell's site, that one: a peer a
        rebalancing move took to another stage keeps its fellow, so its site, whatever id
        it has there."""
        site = None if placed is None else placed.site(stage, replica)
        if site is not None:
            return site
        if self.cell_sites is not None:
            return self.cell_sites[replica][stage]
        if self.stage_sites is not None:
            return self.stage_sites[stage]
        if self.replica_sites is not None:
            return self.replica_sites[replica]
        names = list(self.sites)
        return names[(replica * num_stages + stage) % len(names)]

    def shape_error(self, stages: int, replicas: int, width: int | None = None) -> str | None:
        """Why this matrix cannot place a job of ``stages`` x ``replicas`` cells, or None.
        ``width``: the cell ids a layout names (``slot_count``; more than the replicas where
        a stage has extra cells): a row of sites for each id, as for each replica."""
        ids = replicas if width is None else width
        what = "replicas" if ids == replicas else "cell ids (the layout's)"
        if self.stage_sites is not None and len(self.stage_sites) != stages:
            return f"stage_sites names {len(self.stage_sites)} sites for {stages} stages"
        if self.replica_sites is not None and len(self.replica_sites) != ids:
            return f"replica_sites names {len(self.replica_sites)} sites for {ids} {what}"
        if self.cell_sites is not None and (len(self.cell_sites) != ids or any(
                len(row) != stages for row in self.cell_sites)):
            return f"cell_sites must be {ids} rows ({what}) of {stages} sites (stages)"
        return None
