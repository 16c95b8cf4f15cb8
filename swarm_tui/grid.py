"""A job's stages x replicas grid as every surface shows it (``swarm job``, ``swarm watch``,
the console): one :class:`GridCell` per (stage, replica), from the placement and what each
cell last reported (``JobInfo.metrics.stages``). No Textual, no Rich: the figures only; their
names live in ``swarm_core.contract.metrics``."""

from __future__ import annotations

import attrs

from swarm_core.config.schemas import TrainingConfig
from swarm_core.contract import JobInfo, StageMetrics
from swarm_core.contract.rebalance import PeerMove
from swarm_core.experiments.report_cells import movers
from swarm_tui.fmt import fmt_bytes, fmt_cell, fmt_codec_error, fmt_tps


@attrs.frozen
class GridCell:
    stage: int
    replica: int
    fellow_id: int
    name: str
    layers: tuple[int, int]
    figures: StageMetrics
    left: bool = False  # its replica left the job (see JobInfo.membership)

    @property
    def label(self) -> str:
        return fmt_cell(self.stage, self.replica)


def moves(job: JobInfo) -> int:
    """How many times the job's peers moved between stages (a swarm layout's rebalancing)."""
    return sum(1 for ch in job.membership if ch.moved is not None)


def is_grid(job: JobInfo) -> bool:
    """Whether the job has replicas, or stages of their own cells (a layout, or peers that
    moved): a chain keeps its one-row-per-stage look."""
    p = job.placement
    if (p is not None and p.layout is not None) or job.topology.layout is not None \
            or moves(job):
        return True
    return (p.replicas if p is not None else job.topology.replicas) > 1


def move_text(move: PeerMove, fellow: int | None = None) -> str:
    """A peer's move between stages, old cell to new, as every surface writes it:
    "f3 moved 0.1 -> 1.2" (the fellow where known)."""
    return ("" if fellow is None else f"f{fellow} ") + f"moved {move.cells()}"


def move_fellows(job: JobInfo) -> dict[int, int]:
    """Of each move in ``job.membership`` (by its index there), the fellow that moved (its
    new cell's, in the placement just after the move)."""
    return movers(job.placement, job.membership)


def job_grid(job: JobInfo) -> list[GridCell]:
    """Every cell of a placed job (those of its placement now: a moved peer's old cell is
    gone, its new one there), by stage then replica (a layout's: cell id); none before it is
    placed."""
    p = job.placement
    if p is None:
        return []
    members = job.members
    cells = [GridCell(st.stage, st.replica, st.fellow_id, st.name, st.layers.as_tuple(),
                      job.metrics.stage(p.label(st.stage, st.replica)),
                      left=members is not None and st.replica not in members)
             for st in p.stages]
    return sorted(cells, key=lambda c: (c.stage, c.replica))


GRID_HEADERS = ["cell", "fellow", "layers", "step", "tok/s", "link wait", "sync/step",
                "sync wait"]


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def grid_table(job: JobInfo) -> tuple[list[str], list[list[str]]]:
    """``swarm job``'s and ``swarm watch``'s grid table, one row per cell: GRID_HEADERS, then
    ``act mem`` and ``codec error`` where any cell reported them."""
    cells = job_grid(job)
    headers = list(GRID_HEADERS)
    rows = []
    for c in cells:
        m = c.figures
        sync = m.sync_bytes
        # (a replica that left keeps its last figures, marked: its fellow trains no more)
        rows.append([c.label, f"{c.fellow_id} ({c.name})" + (" left" if c.left else ""),
                     f"{c.layers[0]}-{c.layers[1]}",
                     "-" if m.step is None else str(m.step), fmt_tps(m.tokens_per_s),
                     _share(m.wait_share), "-" if sync is None else fmt_bytes(int(sync)),
                     _share(m.sync_share)])
    # The grid is the one place a grid job's per-cell figures are shown, so these join it;
    # only where reported, as a chain's stage rows name them only then (and 80 columns are
    # already full without them).
    peaks = [c.figures.activation_peak_bytes for c in cells]
    errors = [fmt_codec_error(c.figures.codec_error) for c in cells]
    # Swarm wiring: each cell's share of the step's micro-batches (its route's deal).
    routed = job.topology.wiring == "swarm" and isinstance(job.training, TrainingConfig)
    total = job.topology.replicas * job.training.micro_batches \
        if isinstance(job.training, TrainingConfig) else 0
    shares = [None if not routed or c.figures.micro_batches is None
              else f"{c.figures.micro_batches / total:.0%}" for c in cells]
    for title, values in (("mb share", shares),
                          ("act mem", [None if p is None else fmt_bytes(p) for p in peaks]),
                          ("codec error", errors)):
        if any(v is not None for v in values):
            headers.append(title)
            for row, v in zip(rows, values, strict=True):
                row.append("-" if v is None else v)
    return headers, rows


def grid_title(job: JobInfo) -> str:
    """"grid: 2 stage(s) x 2 replicas"; under a layout, or once peers moved, the cells of
    each stage: "grid: 2 stages, cells 1+3 (1 move)"."""
    p = job.placement
    stages, replicas = (p.num_stages, p.replicas) if p is not None else (
        job.topology.num_stages, job.topology.replicas)
    wiring = ", swarm wiring" if job.topology.wiring == "swarm" else ""
    if wiring and job.topology.routing == "measured":
        wiring += " (measured routes)"
    made = moves(job)
    layout = p.layout if p is not None else job.topology.layout
    if layout is None and not made:
        return f"grid: {stages} stage(s) x {replicas} replicas{wiring}"
    sizes = [len(p.ids(k)) for k in range(stages)] if p is not None else \
        [len(ids) for ids in layout or ()]
    moved = f" ({made} move{'s' if made > 1 else ''})" if made else ""
    return f"grid: {stages} stages, cells {'+'.join(map(str, sizes))}{moved}{wiring}"
