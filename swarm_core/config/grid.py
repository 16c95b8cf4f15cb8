"""A sweep's grid axes: ``replicas`` of every stage, ``sync`` mode and a periodic mode's
``inner_steps`` (DiLoCo's H).

The sweep's other axes (models, compressions, networks, seeds) change what one chain trains;
these change the shape of the job: how many replicas of each stage (the training profile's stage
count stays, so a replicas axis adds fellows, never re-cuts the pipeline) and how those replicas
keep one model. Expanded here, apart from the loader, so the rules of the combination live in
one place: the loader (``profiles.load_experiment``) calls :func:`grid_cells` and raises what it
raises with the file and the sweep's field path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from swarm_core.config.methods import SYNC_METHODS
from swarm_core.config.schemas import SyncMode
from swarm_core.schema import FieldError

# "none": a single replica, nothing to keep in step (a job of one replica has no sync); the
# others are SyncConfig.mode's (a mode registered there is an axis value here too).
SyncAxis = Literal["none", SyncMode]
Wiring = Literal["chain", "swarm"]
MAX_REPLICAS = 256  # Topology.replicas' bound
MAX_INNER_STEPS = 1_000_000  # SyncConfig.inner_steps' bound
MAX_FELLOWS = 1024  # ClusterProfile's fellows (and stages x replicas) bound


def layout_label(layout: Sequence[Sequence[int]]) -> str:
    """A swarm layout as every table names it: its cells by stage, ``cells 1+3``."""
    return "cells " + "+".join(str(len(ids)) for ids in layout)


@attrs.frozen
class GridCell:
    """One point of the grid axes: the job's shape and how its replicas synchronise."""

    stages: int
    replicas: int
    sync: SyncAxis
    inner_steps: int | None = None  # a periodic mode's only: the inner steps between syncs
    # How micro-batches travel between neighbouring stages' replicas (a topology's wiring).
    wiring: Wiring = "chain"

    @property
    def fellows(self) -> int:
        return self.stages * self.replicas

    @property
    def label(self) -> str:
        """What run names carry: ``2x1-none``, ``2x2-dp``, ``1x2-diloco_h10``,
        ``1x2-sparseloco_h10`` (a periodic mode with its H), ``2x2-dp-swarm`` (routed)."""
        mode = f"{self.sync}_h{self.inner_steps}" if periodic(self.sync) else self.sync
        routed = "-swarm" if self.wiring == "swarm" else ""
        return f"{self.stages}x{self.replicas}-{mode}{routed}"


def periodic(mode: str) -> bool:
    """Whether ``mode`` syncs every ``inner_steps`` (the inner_steps axis repeats its runs):
    the registry says, so a new periodic mode sweeps as diloco does."""
    method = SYNC_METHODS.get(mode)
    return method is not None and method.periodic


def _periodic_names() -> str:
    """The periodic modes, as an error lists them: ``diloco, sparseloco``."""
    return ", ".join(name for name in SYNC_METHODS if periodic(name))


def sync_mode(replicas: int, training: dict[str, Any]) -> SyncAxis:
    """The sync mode a job of ``replicas`` replicas and these training fields runs: ``none`` for
    one replica, whatever its ``training.sync`` says (it has nothing to synchronise)."""
    if replicas <= 1:
        return "none"
    mode = (training.get("sync") or {}).get("mode", "dp")
    return mode if mode in SYNC_METHODS else "dp"  # (SyncConfig's default)


def check_axes(replicas: list[int] | None, sync: Sequence[str] | None,
               inner_steps: list[int] | None) -> None:
    """Each axis alone: listed (or left out), no value twice (runs are named by them), in range.
    FieldError names the axis."""
    for name, values in (("replicas", replicas), ("sync", sync), ("inner_steps", inner_steps)):
        if values is None:
            continue
        if not values:
            raise FieldError("must list at least one value (or be omitted)", name)
        if len(set(values)) != len(values):
            raise FieldError(f"values must be unique, got {values}", name)
    if replicas is not None and not all(1 <= r <= MAX_REPLICAS for r in replicas):
        raise FieldError(f"each must be 1-{MAX_REPLICAS}, got {replicas}", "replicas")
    if inner_steps is not None and not all(1 <= h <= MAX_INNER_STEPS for h in inner_steps):
        raise FieldError(f"each must be 1-{MAX_INNER_STEPS:,}, got {inner_steps}", "inner_steps")


def grid_cells(stages: int, profile_replicas: int, profile_mode: SyncMode, profile_inner: int,
               replicas: list[int] | None, sync: Sequence[SyncAxis] | None,
               inner_steps: list[int] | None, check: bool = True) -> list[GridCell]:
    """The grid axes expanded, replicas x sync x inner_steps in that nesting order, with the
    training profile's values where an axis is left out.

    One replica runs once, as ``none``, whatever modes are listed (nothing to synchronise);
    several run once per listed mode other than ``none``; ``inner_steps`` multiplies the runs of
    each periodic mode (diloco, sparseloco) only (dp syncs every step: it has no inner steps, so
    its runs are not repeated).
    A combination that would run nothing of what an axis lists is a FieldError naming it: a
    typo, not a silently smaller grid (``check`` False: the caller checks the axes over
    several calls' replicas together, as a sweep's ``grids`` do)."""
    rs = replicas if replicas is not None else [profile_replicas]
    modes = list(sync) if sync is not None else None
    inners = inner_steps if inner_steps is not None else [profile_inner]
    too_many = [r for r in rs if stages * r > MAX_FELLOWS]
    if too_many:
        raise FieldError(f"{stages} stages x {too_many[0]} replicas is more than "
                         f"{MAX_FELLOWS} fellows", "replicas")
    several = [r for r in rs if r > 1]
    if modes is not None and check:
        if "none" in modes and 1 not in rs:
            raise FieldError(f"'none' is the mode of a single replica, and replicas {rs} has "
                             "no 1", "sync")
        if several and not set(modes) - {"none"}:
            raise FieldError(f"replicas {several} need a mode to synchronise by "
                             f"({', '.join(SYNC_METHODS)}), got {modes}", "sync")
        if not several and set(modes) - {"none"}:
            raise FieldError(f"{'/'.join(m for m in modes if m != 'none')} keeps replicas in "
                             "step, and every run has 1 replica (set sweep.replicas or "
                             "cluster_profile.replicas)", "sync")
    run_modes: list[SyncAxis] = modes if modes is not None else [profile_mode]
    if check and inner_steps is not None and not (several and any(map(periodic, run_modes))):
        raise FieldError(f"inner_steps applies to periodic runs only ({_periodic_names()}), "
                         "and this sweep has none (dp syncs every step)", "inner_steps")
    cells: list[GridCell] = []
    for r in rs:
        if r == 1:
            cells.append(GridCell(stages, 1, "none"))
            continue
        for mode in run_modes:
            if periodic(mode):
                cells += [GridCell(stages, r, mode, h) for h in inners]
            elif mode != "none":  # (listed beside the modes of several replicas: theirs)
                cells.append(GridCell(stages, r, mode))
    return cells
