"""Which shaper a stage's link to a peer cell gets: the fellow's, a fresh unshaped one for a
link that never leaves the machine, or its site pair's under the job's link matrix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm_core.pipeline.links import LinkShaper, PairShaper
from swarm_core.protocol import MAX_PEER_LINKS, PeerLinkState

if TYPE_CHECKING:
    from swarm_core.pipeline.stage import StageSpec


def cell_label(stage: int, replica: int) -> str:
    return f"{stage}.{replica}"


def peer_shaper(spec: StageSpec, shaper: LinkShaper, stage: int, replica: int,
                local: bool) -> LinkShaper | PairShaper:
    """The shaper of the link from ``spec``'s cell to cell (``stage``, ``replica``).

    Without a matrix: the fellow's ``shaper``, or an unshaped one where the peer runs in this
    fellow (its bytes never leave the machine). With one: the pair's shaper, except between
    two cells of one site in one fellow; a local link between two sites is shaped by the pair
    and the sites' caps (the matrix says the cells are apart) but not by the fellow's limits
    or counters."""
    net = spec.training.network
    if net is None:
        return LinkShaper() if local else shaper
    n = spec.num_stages
    own_site = net.site_of(spec.stage, spec.replica, n, spec.placement)
    peer_site = net.site_of(stage, replica, n, spec.placement)
    if local and own_site == peer_site:
        return LinkShaper()
    index = replica * n + stage
    peer_fellow = spec.cell_fellows[index] if index < len(spec.cell_fellows) else None
    return shaper.pair(
        spec.job_id, cell_label(spec.stage, spec.replica), cell_label(stage, replica),
        peer_fellow, net.sites[own_site], net.pair(own_site, peer_site),
        (own_site, peer_site), local=local)


def peer_states(shaper: LinkShaper, job_id: str | None = None,
                cell: str | None = None) -> list[PeerLinkState]:
    """What a fellow's heartbeat says of the links a link matrix shapes for it now (those of
    one job's cell, given them: its run summary)."""
    states = []
    for (job, own, peer), pair in sorted(shaper.pairs.copy().items()):
        if (job_id is not None and job != job_id) or (cell is not None and own != cell):
            continue
        limits = pair.limits()
        achieved = pair.achieved_mbps
        states.append(PeerLinkState(
            job_id=job, cell=own, peer=peer, site=pair.sites[0], peer_site=pair.sites[1],
            peer_fellow=pair.peer_fellow, tx_mbps=limits.tx_mbps,
            latency_ms=limits.latency_ms, jitter_ms=pair.jitter_s * 1000.0,
            tx_bytes=pair.tx_bytes, rx_bytes=pair.rx_bytes,
            achieved_mbps=None if achieved is None else round(achieved, 3)))
    return states[:MAX_PEER_LINKS]
