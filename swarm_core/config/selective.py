"""Selective compression (issue 34 point 4): a boundary's or the replicas' sync compression
applied only on a class of links, the others sending as ``none`` does.

The heterogeneous pre-training paper (Templar, arXiv 2601.02360) compresses only the
bandwidth-limited participants' pipeline traffic and leaves the well-connected replicas'
uncompressed. Here a job names the class in ``training.compress_when``: the links under a
rate (``below_mbps``, read from the job's link matrix) or the links of named replicas
(``replicas``). Both ends of a link compute the same answer from the job's spec alone (no
frame says which codec a link uses: a receiver checks each frame's codec against the one it
expects), so the rule reads only the matrix's settings, never a live rate or a set-speed.

Torch-free: the leader validates the field and counts bytes with it on a login node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from swarm_core.config.network import LinkMatrix, Placed
from swarm_core.schema import FieldError, checking
from swarm_core.validators import meta, rate_or_none

if TYPE_CHECKING:
    from swarm_core.config.schemas import ModelConfig, TrainingConfig

Cell = tuple[int, int]  # (stage, replica)
Scope = Literal["boundary", "sync"]
MAX_NAMED = 256  # replicas a job may have (Topology.replicas' bound)


def _named(_inst: Any, attr: attrs.Attribute, value: list[int] | None) -> None:
    if value is None:
        return
    if not value or len(value) > MAX_NAMED:
        raise FieldError(f"must name 1-{MAX_NAMED} replicas, got {len(value)}", attr.name)
    if any(not 0 <= r < MAX_NAMED for r in value):
        raise FieldError(f"replica indices are 0-{MAX_NAMED - 1}, got {value}", attr.name)
    if len(set(value)) != len(value):
        raise FieldError(f"names a replica twice: {value}", attr.name)


def _scopes(_inst: Any, attr: attrs.Attribute, value: list[str]) -> None:
    if not value or len(set(value)) != len(value):
        raise FieldError(f"must list boundary, sync or both, each once, got {value}",
                         attr.name)


@attrs.frozen
class CompressWhen:
    """Which links the job's compression applies to; every other link sends as spec ``none``
    does (the model's `wire_dtype` at a boundary, fp32 in the sync). Give one of
    ``below_mbps`` (the links whose rate in the link matrix is below it) and ``replicas``
    (the links of the named replicas' cells)."""

    below_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none,
        metadata=meta("compress a link whose rate (its pair's `mbps`, its sender's site "
                      "`up_mbps`, its receiver's `down_mbps`: the least) is below this, Mbit/s"))
    replicas: list[int] | None = attrs.field(
        default=None, validator=_named,
        metadata=meta("compress the links that start or end at a cell of these replicas"))
    applies_to: list[Scope] = attrs.field(
        factory=lambda: ["boundary", "sync"], validator=_scopes,
        metadata=meta("which compressions the rule selects for: the boundary's "
                      "(`model.compression`), the sync's (`sync.compression`); one not "
                      "listed compresses everywhere"))

    def __attrs_post_init__(self) -> None:
        if checking() and (self.below_mbps is None) == (self.replicas is None):
            raise FieldError("give one of below_mbps and replicas", "below_mbps")

    def covers(self, net: LinkMatrix | None, src: Cell, dst: Cell, num_stages: int,
               placed: Placed | None = None) -> bool:
        """Whether the link from cell ``src`` to cell ``dst`` is in the class (``placed``:
        the job's placement, where it names the cells' sites)."""
        if self.replicas is not None:
            return src[1] in self.replicas or dst[1] in self.replicas
        if net is None or self.below_mbps is None:  # (refused at submit: job_shape_error)
            return True
        rate = link_mbps(net, src, dst, num_stages, placed)
        return rate is not None and rate < self.below_mbps


def link_mbps(net: LinkMatrix, src: Cell, dst: Cell, num_stages: int,
              placed: Placed | None = None) -> float | None:
    """The most the link from cell ``src`` to cell ``dst`` carries alone, as the job's matrix
    sets it: the least of its site pair's ``mbps``, the sending site's ``up_mbps`` and the
    receiving site's ``down_mbps`` (None: unlimited)."""
    a, b = (net.site_of(c[0], c[1], num_stages, placed) for c in (src, dst))
    pair = net.pair(a, b)
    rates = [r for r in (None if pair is None else pair.mbps, net.sites[a].up_mbps,
                         net.sites[b].down_mbps) if r is not None]
    return min(rates) if rates else None


def boundary_compresses(training: TrainingConfig, src: Cell, dst: Cell,
                        num_stages: int, placed: Placed | None = None) -> bool:
    """Whether what cell ``src`` sends cell ``dst`` across a stage boundary (activations
    forward, their gradients backward) is coded by the model's compression spec: everywhere
    without a rule, else where the rule covers the link."""
    rule = training.compress_when
    if rule is None or "boundary" not in rule.applies_to:
        return True
    return rule.covers(training.network, src, dst, num_stages, placed)


def group_compresses(training: TrainingConfig, stage: int, ids: Sequence[int],
                     num_stages: int, placed: Placed | None = None) -> bool:
    """Whether stage ``stage``'s group of cells ``ids`` codes its sync by
    ``sync.compression``. One answer for the whole group (its members hold the same bytes only
    if every hop codes alike): yes if the rule covers any link between two of its cells,
    either way, so a ring a regroup forms later (any two members may become neighbours)
    never changes it. A swarm group asks again each time its members change (a move, a lost
    cell: every member re-forms its sync then, under the same placement), so a peer a move
    brings is judged at its own site (``placed``)."""
    rule = training.compress_when
    if rule is None or "sync" not in rule.applies_to:
        return True
    return any(rule.covers(training.network, (stage, a), (stage, b), num_stages, placed)
               for a in ids for b in ids if a != b)


def selective_error(model: ModelConfig, training: TrainingConfig, stages: int,
                    replicas: int) -> str | None:
    """Why ``training.compress_when`` cannot apply to this job, or None."""
    rule = training.compress_when
    if rule is None:
        return None
    if rule.below_mbps is not None and training.network is None:
        return ("below_mbps reads each link's rate from a link matrix: give training.network "
                "(a network profile's matrix), or name replicas")
    if rule.replicas is not None and max(rule.replicas) >= replicas:
        return (f"replicas names replica {max(rule.replicas)} of a job of {replicas} "
                f"replica{'s' if replicas > 1 else ''} (0-{replicas - 1})")
    comp = model.compression_spec
    if "boundary" in rule.applies_to and (comp.learned or comp.subspace is not None):
        return (f"cannot select links for {model.compression!r}: its trained bottleneck or "
                "subspace is part of every replica's model; only a codec spec (fixed_*, "
                "hadamard_*) can differ per link")
    return None
