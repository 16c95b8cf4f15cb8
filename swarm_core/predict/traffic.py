"""What crosses which link in one step: the pipeline's boundaries and the replicas' rings.

The bytes are the project's own plan, not derived again here: a boundary's activations
forward are what the first stage sends (``expected_wire_bytes`` of stage 0: the ACT frames
and, with clipping, its NORM frame) and its gradients backward what the last stage sends
(of stage S-1); every boundary carries the same, so a middle stage's total is exactly its own
``expected_wire_bytes``. A ring member sends its sync's ``planned_bytes`` per step (averaged
over the sync's period: see ``sync_plan``) to the next replica of its stage.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from swarm_core.config.network import Placed
from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.pipeline.routing import Plan
from swarm_core.pipeline.wire_math import expected_wire_bytes, link_bytes, norm_bytes
from swarm_core.predict.network import Cell, Link, Network


@attrs.frozen
class Flow:
    """Bytes one cell sends another in one step: ``act`` (forward), ``grad`` (backward) or
    ``sync`` (the replicas' ring)."""

    src: Cell
    dst: Cell
    nbytes: float
    what: str


def boundary_bytes(model: ModelConfig, training: TrainingConfig, stages: int,
                   replicas: int = 1) -> tuple[int, int]:
    """Bytes per step across one boundary, forward and backward (one replica's chain)."""
    if stages < 2:
        return 0, 0
    return (expected_wire_bytes(model, training, 0, stages, replicas),
            expected_wire_bytes(model, training, stages - 1, stages, replicas))


def step_flows(model: ModelConfig, training: TrainingConfig, stages: int, replicas: int,
               sync_bytes: Sequence[float] = ()) -> list[Flow]:
    """Every transfer of one step. ``sync_bytes[s]``: what each member of stage s's ring
    sends per step (none without replicas)."""
    flows: list[Flow] = []
    for r in range(replicas):
        for b in range(stages - 1):
            a, z = (b, r), (b + 1, r)  # (each link in its own format: compress_when)
            flows += [Flow(a, z, link_bytes(model, training, a, z, stages, replicas), "act"),
                      Flow(z, a, link_bytes(model, training, z, a, stages, replicas), "grad")]
    if replicas > 1:
        for s, nbytes in enumerate(sync_bytes):
            flows += [Flow((s, r), (s, (r + 1) % replicas), nbytes, "sync")
                      for r in range(replicas) if nbytes]
    return flows


def routed_flows(model: ModelConfig, training: TrainingConfig, plans: Sequence[Plan],
                 sync_bytes: Sequence[float] = (), measured: bool = False,
                 groups: Sequence[Sequence[int]] | None = None,
                 placed: Placed | None = None) -> list[Flow]:
    """A swarm-wired step's transfers: each micro-batch's frames cross from the cell of one
    stage that ran it to the cell of the next that runs it (``plans``: the steps' route
    plans; each pair's bytes the mean over them, a frame a chain link's frames' bytes over
    M); the norm exchange's frame goes along each chain link (r to r) alone, with clipping
    and always under ``measured`` routes (their table rides it: ``wire_math.norm_bytes``);
    the rings as a chain's, each stage's round its ``groups`` ids (a layout's; the grid's
    replicas without)."""
    stages, m = len(plans[0]), training.micro_batches
    replicas = len(plans[0][0]) // m
    groups = groups or [list(range(replicas))] * stages
    pairs: dict[tuple[Cell, Cell], float] = {}
    for plan in plans:
        for b in range(stages - 1):
            for g, src in enumerate(plan[b]):
                dst = plan[b + 1][g]
                if src >= 0 and dst >= 0:
                    key = ((b, src), (b + 1, dst))
                    pairs[key] = pairs.get(key, 0.0) + 1.0 / len(plans)
    norm = norm_bytes(training, 0, 2, width=replicas, measured=measured)  # (one frame)
    flows: list[Flow] = []
    for (a, z), frames in sorted(pairs.items()):
        chain = norm if a[1] == z[1] else 0
        flows += [Flow(a, z, frames * link_bytes(model, training, a, z, stages, replicas,
                                                 norm=False, placed=placed) / m + chain,
                       "act"),
                  Flow(z, a, frames * link_bytes(model, training, z, a, stages, replicas,
                                                 norm=False, placed=placed) / m + chain,
                       "grad")]
    for s, nbytes in enumerate(sync_bytes):
        ids = list(groups[s])
        if nbytes and len(ids) > 1:
            flows += [Flow((s, r), (s, ids[(j + 1) % len(ids)]), nbytes, "sync")
                      for j, r in enumerate(ids)]
    return flows


@attrs.frozen
class LinkLoad:
    """One shaped resource and what it carries in a step."""

    name: str
    link: Link
    nbytes: float
    carries: tuple[str, ...]

    @property
    def seconds(self) -> float:
        return self.link.seconds(self.nbytes)


def _cell_name(cell: Cell, replicas: int) -> str:
    return f"stage {cell[0]}" + (f" replica {cell[1]}" if replicas > 1 else "")


def _what(flow: Flow, peer: Cell, arrow: str, replicas: int) -> str:
    return "sync ring" if flow.what == "sync" else \
        f"{flow.what}{arrow}{_cell_name(peer, replicas)}"


def link_loads(flows: Sequence[Flow], network: Network, replicas: int) -> list[LinkLoad]:
    """Each cell's tx and rx bucket with the flows through it, and each pair link that has a
    cap of its own; a resource's latency is the longest of its flows' pairs (frames queued
    together arrive together one latency later: a pipe, not stop-and-wait)."""
    cells = sorted({f.src for f in flows} | {f.dst for f in flows})
    loads: list[LinkLoad] = []

    def add(name: str, own: Link, through: list[Flow], carries: list[str]) -> None:
        if not through:
            return
        latency = max([own.latency_s, *(network.pair(f.src, f.dst).latency_s
                                        for f in through)])
        loads.append(LinkLoad(name, Link(own.mbps, latency), sum(f.nbytes for f in through),
                              tuple(dict.fromkeys(carries))))

    for cell in cells:
        out = [f for f in flows if f.src == cell]
        add(f"{_cell_name(cell, replicas)} tx", network.tx(cell), out,
            [_what(f, f.dst, "→", replicas) for f in out])
        into = [f for f in flows if f.dst == cell]
        add(f"{_cell_name(cell, replicas)} rx", network.rx(cell), into,
            [_what(f, f.src, "←", replicas) for f in into])
    for pair in sorted({(f.src, f.dst) for f in flows}):
        own = network.pair(*pair)
        if own.mbps is not None:
            through = [f for f in flows if (f.src, f.dst) == pair]
            add(f"{_cell_name(pair[0], replicas)} → {_cell_name(pair[1], replicas)}", own,
                through, [f.what for f in through])
    return loads
