"""Experiment configs: a top-level config referencing model and training profiles, and a sweep.

    exp/configs/<experiment>.json     training_config, model_configs, sweep
    exp/configs/model/*.json          ModelConfig
    exp/configs/training/*.json       TrainingConfig fields + cluster_profile, network_profile,
                                      artifacts

Paths resolve relative to the file that names them. Unknown keys are errors, so a typo never
falls back to a default silently; every error names the file, the field path and what was
expected.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
import re
from pathlib import Path
from typing import Any, Literal

import attrs

from swarm_core import jsonio
from swarm_core.config.grid import (
    MAX_FELLOWS,
    MAX_REPLICAS,
    GridCell,
    SyncAxis,
    Wiring,
    check_axes,
    grid_cells,
    layout_label,
    periodic,
    sync_mode,
)
from swarm_core.config.network import LinkMatrix
from swarm_core.config.schemas import (
    ModelConfig,
    SyncConfig,
    TrainingConfig,
    job_shape_error,
    warm_start_mismatch,
)
from swarm_core.config.traces import (
    LIBRARY,
    LinkTraceSpec,
    TraceError,
    library_or_path,
    load_churn,
    resolve_trace,
)
from swarm_core.contract import JobSubmit
from swarm_core.contract.job import Topology, check_routing
from swarm_core.contract.rebalance import PeerMove
from swarm_core.protocol import LinkLimits
from swarm_core.schema import FieldError, SchemaError, structure, unstructure
from swarm_core.validators import MAX_STEPS, bounded, meta, rate_or_none


class ConfigError(ValueError):
    """``<file>: <field path>: <what was expected>``."""

    def __init__(self, path: Path | str, message: str, field: str | None = None) -> None:
        self.path, self.message, self.field = str(path), message, field
        super().__init__(f"{path}: {field}: {message}" if field else f"{path}: {message}")


def _pos(_i: Any, a: attrs.Attribute, v: float | None) -> None:
    if v is not None and not v > 0:
        raise FieldError(f"must be > 0, got {v}", a.name)


_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


SCENARIO_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _safe_name(_i: Any, a: attrs.Attribute, v: str) -> None:
    if not _SAFE_NAME.fullmatch(v):
        raise FieldError("must be 1-64 of letters, digits, '_', '.', '-' (it names run "
                         f"directories), got {v!r}", a.name)


@attrs.define
class TcProfile:
    """Kernel shaping with tc around a run: in a network namespace or on one named interface."""

    rate_mbit: float = attrs.field(validator=_pos)
    netns: str | None = None
    dev: str | None = None
    delay_ms: float = 0.0
    loss_pct: float = 0.0

    def __attrs_post_init__(self) -> None:
        if (self.netns is None) == (self.dev is None):
            raise FieldError("give exactly one of netns or dev (never all interfaces)", "dev")
        for name in ("netns", "dev"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,15}", value):
                raise FieldError(f"{value!r} is not an interface/namespace name", name)
        if not 0 <= self.loss_pct <= 100:
            raise FieldError(f"must be 0-100, got {self.loss_pct}", "loss_pct")
        if self.delay_ms < 0:
            raise FieldError(f"must be >= 0, got {self.delay_ms}", "delay_ms")


@attrs.define
class NetworkProfile:
    """Link limits every fellow applies during a run (application shaper), optionally tc too."""

    name: str = attrs.field(default="unconstrained", validator=_safe_name)
    tx_mbps: float | None = attrs.field(default=None, validator=rate_or_none)
    rx_mbps: float | None = attrs.field(default=None, validator=rate_or_none)
    latency_ms: float = 0.0
    tc_profile: TcProfile | None = None
    trace: LinkTraceSpec | None = None  # (swarm_core.config.traces: replayed live)
    # Per-pair links between sites (swarm_core.config.network), under the uniform limits above.
    matrix: LinkMatrix | None = None
    # Where the numbers come from (a library scenario cites its sources here).
    description: str = ""

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.latency_ms <= 60_000:
            raise FieldError(f"must be 0-60000, got {self.latency_ms}", "latency_ms")

    @property
    def link(self) -> LinkLimits | None:
        if self.tx_mbps is None and self.rx_mbps is None and not self.latency_ms:
            return None
        return LinkLimits(tx_mbps=self.tx_mbps, rx_mbps=self.rx_mbps,
                          latency_ms=self.latency_ms)


@attrs.define
class ClusterProfile:
    """What the run asks of the cluster, one pipeline cell per fellow: ``fellows`` (then
    fellows / replicas stages), or the grid ``stages`` x ``replicas`` as a job's topology and a
    suite's grid say it (then stages x replicas fellows). Neither: 2 fellows."""

    # Kept as given (None where left out), so a job run from the profile keeps the form the
    # person wrote: the stages of a profile that names them stay when --replicas changes.
    fellows: int | None = None
    replicas: int = 1
    stages: int | None = None
    # How micro-batches travel between the replicas of neighbouring stages (a job topology's
    # ``wiring``): ``chain`` replica r to replica r, ``swarm`` routed by throughput.
    wiring: Literal["chain", "swarm"] = "chain"
    # A swarm's routes: by the topology's weights (``given``) or by measured throughput.
    routing: Literal["given", "measured"] = "given"
    # SWARM's rebalancing (a topology's ``rebalance_every``): every that many steps the cells
    # move a peer to the stage that bounds the pipeline; measured routes only.
    rebalance_every: int | None = None
    # The rest of a swarm topology, as a job's (swarm_core.contract.job.Topology says each):
    # a given route's weights, stages of unequal cells by id (then the stages and fellows are
    # the layout's), peers moved at given steps.
    route_weights: list[list[float]] | None = None
    layout: list[list[int]] | None = None
    moves: list[PeerMove] | None = None

    def __attrs_post_init__(self) -> None:
        check_routing(self.wiring, self.routing)
        if self.rebalance_every is not None:
            if not 1 <= self.rebalance_every <= 1_000_000:
                raise FieldError(f"must be 1-1000000, got {self.rebalance_every}",
                                 "rebalance_every")
            if self.wiring != "swarm" or self.routing != "measured":
                raise FieldError("rebalancing reads measured throughput: it needs wiring "
                                 "swarm and routing measured", "rebalance_every")
        if self.layout is not None:
            cells = sum(len(ids) for ids in self.layout)
            if self.fellows is not None and self.fellows != cells:
                raise FieldError(f"fellows {self.fellows} contradicts the layout's {cells} "
                                 "cells: give one or the other", "fellows")
            self._check_wiring()  # (the layout decides the grid: checked as a job's first)
            return
        for name in ("fellows", "stages"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= MAX_FELLOWS:
                raise FieldError(f"must be 1-{MAX_FELLOWS}, got {value}", name)
        if self.stages is None:
            fellows = self.num_fellows
            if not 1 <= self.replicas <= fellows or fellows % self.replicas:
                raise FieldError(f"must divide fellows ({fellows}), got {self.replicas}",
                                 "replicas")
            return
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise FieldError(f"must be 1-{MAX_REPLICAS}, got {self.replicas}", "replicas")
        cells = self.stages * self.replicas
        if self.fellows is not None and self.fellows != cells:
            # (which one the person meant is a guess either way)
            raise FieldError(f"fellows {self.fellows} contradicts stages {self.stages} x "
                             f"replicas {self.replicas} ({cells} fellows): give fellows or "
                             "stages, not both", "stages")
        if cells > MAX_FELLOWS:
            raise FieldError(f"stages {self.stages} x replicas {self.replicas} is {cells} "
                             f"fellows, more than {MAX_FELLOWS}", "replicas")
        self._check_wiring()

    def _check_wiring(self) -> None:
        """The swarm fields as the leader checks a job's topology (their shapes against the
        grid, the combinations it refuses), a FieldError at the field it names."""
        if self.route_weights is None and self.layout is None and self.moves is None:
            return
        try:
            structure(self.topology(), Topology, "$")
        except SchemaError as exc:
            raise FieldError(exc.message, (exc.field or "$").removeprefix("$.")) from None

    @property
    def num_fellows(self) -> int:
        if self.layout is not None:
            return sum(len(ids) for ids in self.layout)
        if self.stages is not None:
            return self.stages * self.replicas
        return 2 if self.fellows is None else self.fellows

    @property
    def num_stages(self) -> int:
        if self.layout is not None:
            return len(self.layout)
        return self.num_fellows // self.replicas

    def wiring_fields(self) -> dict[str, Any]:
        """A ``Topology``'s fields past its grid that this profile sets: its wiring where it
        is not the chain, a swarm's routing where it is measured, its route weights, layout,
        moves and rebalancing where it has them ({} for a chain)."""
        topo: dict[str, Any] = {}
        if self.wiring != "chain":
            topo["wiring"] = self.wiring
        if self.routing != "given":
            topo["routing"] = self.routing
        for name in ("route_weights", "layout", "moves", "rebalance_every"):
            value = getattr(self, name)
            if value is not None:
                topo[name] = unstructure(value)
        return topo

    def topology(self) -> dict[str, Any]:
        """A ``Topology``'s fields for a job of this profile: its fellows and replicas, its
        stages where it names them (a layout's cells and stages where it gives one), then its
        :meth:`wiring_fields`."""
        topo: dict[str, Any] = {"fellows": self.num_fellows, "replicas": self.replicas}
        if self.stages is not None:
            topo["stages"] = self.stages
        return {**topo, **self.wiring_fields()}


@attrs.define
class ArtifactsProfile:
    runs_dir: str = "../runs"  # relative to the training profile: exp/runs
    shard_push_interval_steps: int = 0
    # Copy each run's final shards from the leader into <run>/model_export/, so the run's own
    # folder glues, evaluates and samples (a benchmark suite always does).
    export: bool = False

    def __attrs_post_init__(self) -> None:
        if self.shard_push_interval_steps < 0:
            raise FieldError("must be >= 0", "shard_push_interval_steps")


PROFILE_KEYS = ("cluster_profile", "network_profile", "artifacts")
# A sweep is queued whole on the leader, a run each: a grid bigger than any study needs is a
# typo (a seed range pasted in), caught before it is expanded.
MAX_RUNS = 10_000


@attrs.define
class TrainingProfile:
    training: TrainingConfig
    cluster_profile: ClusterProfile
    network_profile: NetworkProfile
    artifacts: ArtifactsProfile


@attrs.frozen
class WarmUp:
    """A sweep's warm start, trained first: its first run's job, ``steps`` long (data parallel
    where it has replicas, so no method of the grid is favoured), then every run starts from
    that job's last checkpoint's weights (``training.warm_start``: weights only, a fresh
    optimiser and schedule), so the grid's methods train on from one point."""

    steps: int = attrs.field(validator=bounded(1, MAX_STEPS), metadata=meta(
        "the warm-up job's steps (its last checkpoint is every run's start)", minimum=1,
        maximum=MAX_STEPS))


_GRID = re.compile(r"([1-9][0-9]{0,3})x([1-9][0-9]{0,2})")
# Training fields a sweep sets as its own fields (or its seeds axis), never as overrides.
_SWEEP_FIELDS = frozenset({"dataset", "tokenizer", "real_min_tokens", "steps", "seed"})


def _check_overrides(overrides: dict[str, Any], field: str) -> None:
    bad = set(overrides) & _SWEEP_FIELDS
    if bad:
        raise FieldError(f"set {sorted(bad)} as sweep fields, not overrides", field)
    if "sync" in overrides and not isinstance(overrides["sync"], dict):
        raise FieldError(f"sync must be an object of sync fields, got {overrides['sync']!r}",
                         field)


def merged_overrides(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` set over ``base``, a ``sync`` object's fields merged (a variant's codec keeps
    the sweep's other sync fields, the sweep's the profile's), every other field replaced."""
    out = {**base, **over}
    if isinstance(base.get("sync"), dict) and isinstance(over.get("sync"), dict):
        out["sync"] = {**base["sync"], **over["sync"]}
    return out


@attrs.define
class SweepVariant:
    """A named row of a sweep: its own overrides (set over the sweep's) and, where it gives
    them, its own ``sync`` modes and ``inner_steps`` in place of the sweep's axes: so one
    config holds rows the axes cannot cross (DiLoCo in int8 beside data parallel in fp32,
    Muon inner steps beside AdamW). Its name is in its runs' names and summaries."""

    name: str = attrs.field(validator=lambda i, a, v: _variant_name(v, a.name))
    overrides: dict[str, Any] = attrs.field(factory=dict)
    sync: list[SyncAxis] | None = None
    inner_steps: list[int] | None = None

    def __attrs_post_init__(self) -> None:
        check_axes(None, self.sync, self.inner_steps)
        _check_overrides(self.overrides, "overrides")
        if self.overrides.get("warm_start") is not None:
            raise FieldError("a warm start is the sweep's (sweep.warm_up or "
                             "sweep.overrides.warm_start), not one variant's", "overrides")
        sync = self.overrides.get("sync")
        fixed = sorted(k for k in ("mode", "inner_steps") if isinstance(sync, dict) and k in sync)
        if fixed:
            raise FieldError(f"sync {fixed}: give the variant's own sync / inner_steps list",
                             "overrides")


def _variant_name(v: str, field: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}", v):
        raise FieldError("must be 1-32 of letters, digits, '_', '.', '-' (it names runs), "
                         f"got {v!r}", field)


@attrs.define
class SweepSpec:
    """The grid: models x compressions x networks x (grids or stages x replicas, variants x
    sync x inner_steps x wiring) x seeds x repeats."""

    dataset: Literal["shakespeare", "textfiles", "wikitext103"] | None = None
    tokenizer: Literal["byte", "bpe"] | None = None
    real_min_tokens: int | None = None
    steps: int | None = None
    repeats: int = 1
    seeds: list[int] = attrs.field(factory=lambda: [0])
    compressions: list[str] | None = None
    network_profiles: list[NetworkProfile] | None = None
    # The job's shape and synchronisation (swarm_core.config.grid): replicas of every stage
    # (the training profile's stage count stays), sync modes, a periodic mode's inner steps.
    replicas: list[int] | None = None
    sync: list[SyncAxis] | None = None
    inner_steps: list[int] | None = None
    # Pipeline depths: the stage count of each run (the model's layers cut that many ways;
    # the training profile's cluster_profile otherwise).
    stages: list[int] | None = None
    # Wirings side by side: ``chain`` runs drop the profile's swarm fields (its chain
    # baseline), ``swarm`` runs take them (a chain profile's swarm runs route equally).
    wiring: list[Wiring] | None = None
    overrides: dict[str, Any] = attrs.field(factory=dict)
    # A churn script (swarm_core.config.traces) every run replays: a library name or a path.
    churn: str | None = None
    # A warm-up job trained before the grid, every run starting from its weights.
    warm_up: WarmUp | None = None
    # Job shapes side by side, "SxR" (stages x replicas: "1x4", "2x2"), in place of the
    # stages and replicas axes, which cross each other.
    grids: list[str] | None = None
    # Named rows, each with its own overrides (and sync axes): see SweepVariant.
    variants: list[SweepVariant] | None = None

    @property
    def shapes_the_grid(self) -> bool:
        """Whether it sweeps the job's shape or synchronisation (its runs' names then say
        them)."""
        return any(v is not None for v in (self.replicas, self.sync, self.inner_steps,
                                           self.stages, self.wiring, self.grids))

    @property
    def grid_shapes(self) -> list[tuple[int, int]] | None:
        """``grids`` as (stages, replicas) pairs; None where it is left out."""
        if self.grids is None:
            return None
        return [(int(m[1]), int(m[2])) for m in map(_GRID.fullmatch, self.grids) if m]

    def variant_overrides(self, variant: int | None) -> dict[str, Any]:
        """The overrides of variant ``variant`` (its index; None: none)."""
        return {} if variant is None or not self.variants else self.variants[variant].overrides

    def __attrs_post_init__(self) -> None:
        check_axes(self.replicas, self.sync, self.inner_steps)
        self._check_grids()
        if self.variants is not None:
            names = [v.name for v in self.variants]
            if not names or len(set(names)) != len(names):
                raise FieldError(f"must list variants of unique names, got {names}",
                                 "variants")
        if self.stages is not None:
            if not self.stages or len(set(self.stages)) != len(self.stages):
                raise FieldError(f"must list unique stage counts, got {self.stages}", "stages")
            if not all(1 <= k <= MAX_FELLOWS for k in self.stages):
                raise FieldError(f"each must be 1-{MAX_FELLOWS}, got {self.stages}", "stages")
        if self.wiring is not None and (not self.wiring
                                        or len(set(self.wiring)) != len(self.wiring)):
            raise FieldError(f"must list unique wirings, got {self.wiring}", "wiring")
        if not 1 <= self.repeats <= 100:
            raise FieldError(f"must be 1-100, got {self.repeats}", "repeats")
        if not self.seeds:
            raise FieldError("must list at least one seed", "seeds")
        if any(s < 0 for s in self.seeds):
            raise FieldError("seeds must be >= 0", "seeds")
        if len(set(self.seeds)) != len(self.seeds):  # (runs are named by their seed)
            raise FieldError(f"seeds must be unique, got {self.seeds}", "seeds")
        if self.compressions is not None and not self.compressions:
            raise FieldError("must list at least one spec (or be omitted)", "compressions")
        if self.compressions is not None and len(set(self.compressions)) != \
                len(self.compressions):
            raise FieldError(f"specs must be unique, got {self.compressions}", "compressions")
        if self.network_profiles is not None and not self.network_profiles:
            raise FieldError("must list at least one profile (or be omitted)",
                             "network_profiles")
        if self.network_profiles is not None:
            names = [n.name for n in self.network_profiles]
            if len(set(names)) != len(names):
                raise FieldError(f"network profile names must be unique, got {names}",
                                 "network_profiles")
        if self.steps is not None and self.steps < 1:
            raise FieldError("must be >= 1", "steps")
        _check_overrides(self.overrides, "overrides")
        if self.warm_up is not None and self.overrides.get("warm_start") is not None:
            raise FieldError("give warm_up (a warm-up job the sweep trains first) or "
                             "overrides.warm_start (a finished job's), not both", "warm_up")
        sync = self.overrides.get("sync")
        rows = self.variants or []
        swept = {"mode": self.sync is not None or any(v.sync is not None for v in rows),
                 "inner_steps": self.inner_steps is not None
                 or any(v.inner_steps is not None for v in rows)}
        clash = sorted(k for k, is_swept in swept.items()
                       if is_swept and isinstance(sync, dict) and k in sync)
        if clash:  # (which would win is a guess either way)
            raise FieldError(f"sync {clash} is swept: set it in the sweep's axes only",
                             "overrides")

    def _check_grids(self) -> None:
        if self.grids is None:
            return
        if self.stages is not None or self.replicas is not None:
            raise FieldError("give grids, or the stages and replicas axes (which cross), "
                             "not both", "grids")
        bad = [g for g in self.grids if not _GRID.fullmatch(g)]
        if not self.grids or bad:
            raise FieldError("must list job shapes as STAGESxREPLICAS (\"1x4\", \"2x2\"), "
                             f"got {bad or self.grids}", "grids")
        if len(set(self.grid_shapes or [])) != len(self.grids):
            raise FieldError(f"must list unique shapes, got {self.grids}", "grids")
        for s, r in self.grid_shapes or []:
            if r > MAX_REPLICAS or s * r > MAX_FELLOWS:
                raise FieldError(f"{s}x{r}: at most {MAX_REPLICAS} replicas and "
                                 f"{MAX_FELLOWS} fellows", "grids")


@attrs.define
class ExperimentConfig:
    name: str = attrs.field(validator=_safe_name)
    training_config: str
    model_configs: list[str]
    sweep: SweepSpec = attrs.field(factory=SweepSpec)
    description: str = ""

    def __attrs_post_init__(self) -> None:
        if not self.model_configs:
            raise FieldError("must list at least one model profile", "model_configs")


@attrs.define
class RunSpec:
    """One concrete run of a sweep: exactly what gets queued."""

    index: int
    run_name: str
    model: dict[str, Any]
    training: dict[str, Any]
    fellows: int
    network: dict[str, Any]
    tc_profile: dict[str, Any] | None
    seed: int
    repeat: int
    model_source: str
    compression: str
    slots_per_fellow: int = 1  # one stage per slot
    replicas: int = 1  # of every stage
    churn: dict[str, Any] | None = None  # (a ChurnScript, its files made absolute)
    # The topology's fields past its grid (ClusterProfile.wiring_fields: wiring, routing,
    # route weights, a layout, moves, rebalancing); {} for a chain.
    wiring: dict[str, Any] = attrs.field(factory=dict)
    variant: str | None = None  # the sweep's variant it is a run of (SweepVariant.name)

    @property
    def stages(self) -> int:
        layout = self.wiring.get("layout")
        if layout is not None:
            return len(layout)
        return max(1, self.fellows * self.slots_per_fellow // self.replicas)

    @property
    def wiring_label(self) -> str:
        """Its wiring as a table shows it: ``chain``, ``swarm``, ``swarm measured``, with a
        layout's cells (``cells 1+3``), given moves and a rebalancing cadence after it."""
        w = self.wiring
        words = [w.get("wiring", "chain")]
        if w.get("routing", "given") != "given":
            words.append(w["routing"])
        if w.get("route_weights"):
            words.append("weighted")
        if w.get("layout"):
            words.append(layout_label(w["layout"]))
        if w.get("moves"):
            words.append(f"{len(w['moves'])} move(s)")
        if w.get("rebalance_every"):
            words.append(f"rebalance /{w['rebalance_every']}")
        return " ".join(words)

    @property
    def sync_mode(self) -> SyncAxis:
        """``none`` (one replica), else its ``sync.mode`` (``dp``, ``diloco``, …)."""
        return sync_mode(self.replicas, self.training)

    def job_body(self, run_id: str) -> dict[str, Any]:
        return {"name": run_id, "kind": "train", "model": self.model,
                "training": self.training,
                "topology": {"fellows": self.fellows, "slots_per_fellow": self.slots_per_fellow,
                             "replicas": self.replicas, **self.wiring}}

    def job(self, run_id: str) -> JobSubmit:
        """The run as the leader gets it: a JobSubmit, checked as the leader checks it."""
        return structure(self.job_body(run_id), JobSubmit)


@attrs.define
class ResolvedExperiment:
    config_path: str
    config: ExperimentConfig
    training_path: str
    profile: TrainingProfile
    runs: list[RunSpec]
    runs_dir: Path
    sha256: str
    # Run 0 without its variant's overrides: what a warm-up trains (None: run 0 itself)
    warm_base: RunSpec | None = None

    def warm_up(self, steps: int) -> RunSpec:
        """The sweep's warm-up job (:func:`warm_up_run`) of ``steps`` steps."""
        return warm_up_run(self.warm_base or self.runs[0], steps)


# --- loading ------------------------------------------------------------------------------------


def _read_json(path: Path, referenced_from: tuple[Path, str] | None = None) -> Any:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if referenced_from is not None:
            src, field = referenced_from
            raise ConfigError(src, f"file not found: {path}", field) from None
        raise ConfigError(path, "file not found") from None
    except OSError as exc:
        if referenced_from is not None:  # (a directory, unreadable: named where it is named)
            src, field = referenced_from
            raise ConfigError(src, f"cannot read {path}: {exc.strerror}", field) from None
        raise ConfigError(path, f"cannot read: {exc.strerror}") from None
    try:
        return jsonio.loads(raw)
    except jsonio.JSONDecodeError as exc:
        raise ConfigError(path, f"not valid JSON: {exc}") from None


def resolve_ref(base: Path, rel: str, path: Path, field: str) -> Path:
    """``rel`` as the file at ``path`` names it, made absolute; a name no file system takes
    (a NUL byte, a loop of links) is a ConfigError at ``field``."""
    try:
        return (base / rel).resolve()
    except (ValueError, OSError, RuntimeError) as exc:  # (RuntimeError: a loop, before 3.13)
        raise ConfigError(path, f"not a usable path ({exc}): {rel!r}", field) from None


def network_library(near: Path) -> list[Path]:
    """Where a scenario named by name is looked up: ``network/`` beside the naming file and
    beside its folder (exp/configs/training/x.json names exp/configs/network/), then the
    library this checkout ships."""
    return [near.parent / "network", near.parent.parent / "network", LIBRARY]


def named_network(value: Any, path: Path, field: str) -> Any:
    """A network profile as a file names it: an object as given, or a library scenario's name
    (``"dtfm-worldwide"``) read from ``network/<name>.json``."""
    if not isinstance(value, str):
        return value
    if not SCENARIO_NAME.fullmatch(value):
        raise ConfigError(path, f"{value!r} is not a scenario name (letters, digits, '_', "
                          "'-', '.')", field)
    for folder in network_library(path):
        candidate = folder / f"{value}.json"
        if candidate.is_file():
            return _anchor_trace(_read_json(candidate, (path, field)), candidate.parent)
    raise ConfigError(path, f"no network scenario {value!r} (looked in "
                      f"{', '.join(str(f) for f in network_library(path))})", field)


def _anchor_trace(scenario: Any, folder: Path) -> Any:
    """A scenario file's trace path made absolute where it is relative to that file (as a
    path in a config is), so it does not resolve against the config that names the
    scenario; a bare trace name stays, for the library's traces."""
    trace = scenario.get("trace") if isinstance(scenario, dict) else None
    if not isinstance(trace, dict):
        return scenario
    ref = trace.get("file")
    if not isinstance(ref, str) or not ref.strip() or Path(ref).is_absolute() \
            or not (folder / ref).is_file():
        return scenario
    return {**scenario, "trace": {**trace, "file": str((folder / ref).resolve())}}


def load_network_scenario(which: str) -> NetworkProfile:
    """A network profile by a library scenario's name (``dtfm-worldwide``) or a file's path:
    what ``swarm predict --scenario`` runs a config over. ConfigError if neither."""
    path = Path(which)
    if which.endswith(".json") or os.sep in which:
        return _structure(_read_json(path), NetworkProfile, path)
    here = Path.cwd() / "exp" / "configs" / "scenario.json"  # (looked up as a file there would)
    return _structure(named_network(which, here, "scenario"), NetworkProfile, here)


def _structure(data: Any, cls: type, path: Path, root: str = "$") -> Any:
    try:
        return structure(data, cls, root)
    except SchemaError as exc:
        raise ConfigError(path, exc.message, exc.field) from None


def anchor_dataset_paths(training: dict[str, Any], base: Path) -> dict[str, Any]:
    """``dataset_paths`` as the file that names them meant them: a relative path (or glob) is
    relative to that file's folder, wherever the fellows that read it run from."""
    paths = training.get("dataset_paths")
    if not isinstance(paths, list):
        return training
    return {**training, "dataset_paths": [
        os.path.normpath(os.path.join(base, p))
        if isinstance(p, str) and p and not os.path.isabs(p) and not p.startswith("~") else p
        for p in paths]}


def dataset_files(patterns: list[str]) -> tuple[list[str], list[str]]:
    """The files ``patterns`` name on this machine, each once, in the order first named (patterns
    that overlap must not read a file twice: its second copy would land in the validation split,
    which training then saw), and the patterns that name none."""
    files: dict[str, None] = {}
    unmatched = []
    for pat in patterns:
        hits = [h for h in sorted(glob.glob(os.path.expanduser(pat), recursive=True))
                if os.path.isfile(h)]
        if not hits:
            unmatched.append(pat)
        files.update((os.path.realpath(h), None) for h in hits)
    return list(files), unmatched


def load_model_profile(path: Path, referenced_from: tuple[Path, str] | None = None
                       ) -> ModelConfig:
    return _structure(_read_json(path, referenced_from), ModelConfig, path)


def load_training_profile(path: Path, referenced_from: tuple[Path, str] | None = None
                          ) -> TrainingProfile:
    data = _read_json(path, referenced_from)
    if not isinstance(data, dict):
        raise ConfigError(path, "expected an object", "$")
    profiles = {k: data[k] for k in PROFILE_KEYS if k in data}
    rest = {k: v for k, v in data.items() if k not in PROFILE_KEYS}
    training = _structure(anchor_dataset_paths(rest, path.parent), TrainingConfig, path)
    cluster = _structure(profiles.get("cluster_profile", {}), ClusterProfile, path,
                         "$.cluster_profile")
    network = _structure(named_network(profiles.get("network_profile", {}), path,
                                       "$.network_profile"),
                         NetworkProfile, path, "$.network_profile")
    artifacts = _structure(profiles.get("artifacts", {}), ArtifactsProfile, path,
                           "$.artifacts")
    return TrainingProfile(training, cluster, network, artifacts)


def load_job_cluster(path: Path) -> ClusterProfile | None:
    """The cluster a training profile asks of a job run from it; None when it names none."""
    if "cluster_profile" not in _read_json(path):
        return None
    return load_training_profile(path).cluster_profile


def job_topology(cluster: ClusterProfile | None, fellows: int | None = None,
                 stages: int | None = None, replicas: int | None = None,
                 wiring: str | None = None, routing: str | None = None) -> dict[str, Any]:
    """The grid a job run from a training profile asks for (a ``Topology``'s fields): its
    cluster profile's fellows and replicas (and stages, where it names them), then what the
    person set. Stages set alone decide the fellows (stages x replicas); fellows set alone
    override the profile's stages; replicas set alone keep the profile's stages where it names
    them (as a sweep's replicas axis does), else its fellows."""
    topo: dict[str, Any] = {} if cluster is None else cluster.topology()
    if wiring is not None:
        topo["wiring"] = wiring
        if wiring != "swarm" and routing is None:
            topo.pop("routing", None)  # (a chain asked for over a swarm profile: no routes)
    if routing is not None:
        topo["routing"] = routing
    if stages is not None:
        topo.pop("fellows", None)
        topo["stages"] = stages
    if fellows is not None:
        if stages is None:
            topo.pop("stages", None)
        topo["fellows"] = fellows
    if replicas is not None:
        topo["replicas"] = replicas
        if fellows is None and stages is None and "stages" in topo:
            # (one cell per fellow; a caller that fills in default fellows must find them set)
            topo["fellows"] = topo["stages"] * replicas
    return topo


SYNC_ROOT = "$.training.sync"


def sync_over(training: dict[str, Any], fields: dict[str, Any]) -> SyncConfig:
    """A training profile's ``training.sync`` (``training`` as JSON) with ``fields`` set
    over it, the fields not set kept: what ``swarm submit``'s sync flags and the console
    launcher's sync fields ask for, structured once into the class. SchemaError naming the
    field under ``$.training.sync`` for a bad value or combination."""
    base = training.get("sync")
    return structure({**(base if isinstance(base, dict) else {}), **fields}, SyncConfig,
                     SYNC_ROOT)


def load_job_training(path: Path) -> tuple[dict[str, Any], int | None]:
    """A training profile as one job runs it (``swarm submit --training``): its training
    fields, its artifacts' shard push interval and its network profile's link limits (not
    its tc shaping, which only a sweep sets up), and the fellows its cluster profile asks for
    (None when it names none)."""
    profile = load_training_profile(path)
    named = _read_json(path).keys()  # (an object: it loaded above)
    training = unstructure(profile.training)
    # A profile section it does not name leaves the training fields as the file sets them.
    _apply_profiles(training, profile.artifacts if "artifacts" in named else None,
                    profile.network_profile if "network_profile" in named else None)
    return training, profile.cluster_profile.num_fellows if "cluster_profile" in named \
        else None


def _apply_profiles(training: dict[str, Any], artifacts: ArtifactsProfile | None,
                    network: NetworkProfile | None) -> None:
    """What a training profile's artifacts and network sections set in the job's training."""
    if artifacts is not None:
        training["shard_push_interval_steps"] = artifacts.shard_push_interval_steps
    if network is not None:
        link = network.link
        training["link"] = None if link is None else unstructure(link)
        training["network"] = None if network.matrix is None else unstructure(network.matrix)


def load_experiment(path: Path | str, warm_up: bool = True) -> ResolvedExperiment:
    """Load, resolve references and expand the sweep grid into concrete runs. ``warm_up``
    False: the config's ``sweep.warm_up`` will not be trained (``swarm sweep
    --warm-start`` stands in for it), so the runs are not checked against it."""
    path = Path(path)
    raw = _read_json(path)
    sweep_raw = raw.get("sweep") if isinstance(raw, dict) else None
    if isinstance(sweep_raw, dict) and isinstance(sweep_raw.get("network_profiles"), list):
        sweep_raw["network_profiles"] = [
            named_network(v, path, f"$.sweep.network_profiles[{i}]")
            for i, v in enumerate(sweep_raw["network_profiles"])]
    cfg: ExperimentConfig = _structure(raw, ExperimentConfig, path)
    base = path.parent
    tpath = resolve_ref(base, cfg.training_config, path, "$.training_config")
    profile = load_training_profile(tpath, (path, "$.training_config"))
    models = []
    for i, rel in enumerate(cfg.model_configs):
        mpath = resolve_ref(base, rel, path, f"$.model_configs[{i}]")
        models.append((mpath, load_model_profile(mpath, (path, f"$.model_configs[{i}]"))))
    sweep = cfg.sweep
    networks = sweep.network_profiles or [profile.network_profile]
    cells = _variant_cells(profile, sweep, path, tpath)
    per_model = len(sweep.compressions or [None]) * len(networks) * len(cells) \
        * len(sweep.seeds) * sweep.repeats
    if per_model * len(models) > MAX_RUNS:
        raise ConfigError(path, f"the sweep has {per_model * len(models):,} runs, more than "
                          f"{MAX_RUNS:,}: split it into several experiments", "$.sweep")
    runs: list[RunSpec] = []
    warm_base: RunSpec | None = None
    made_by: dict[str, int] = {}  # run name -> the model profile it came from
    for mi, (mpath, model) in enumerate(models):
        compressions = sweep.compressions or [model.compression]
        for ci, comp in enumerate(compressions):
            model_dict = unstructure(model)
            if sweep.compressions is not None:
                model_dict["compression"] = comp
                if comp != "learned_bottleneck":
                    # The profile's bottleneck_dim is the width of its learned_bottleneck; a
                    # swept spec names its own (learned_dimK) or has none.
                    model_dict["bottleneck_dim"] = None
                try:
                    structure(model_dict, ModelConfig)
                except SchemaError as exc:
                    raise ConfigError(path, f"{exc.message} (with model {mpath.name})",
                                      f"$.sweep.compressions[{ci}]") from None
            for network, (vi, cell), seed, rep in itertools.product(
                    networks, cells, sweep.seeds, range(sweep.repeats)):
                variant = None if vi is None or sweep.variants is None \
                    else sweep.variants[vi]
                training = _run_training(profile, sweep, seed, network, path, cell, vi)
                _check_shape(model_dict, training, cell, sweep, path, tpath, mpath,
                             profile.cluster_profile, vi)
                # Named by the grid too when it is swept or not a chain; a sweep of
                # chains keeps the names (and run folders) it always had.
                shape = [cell.label] if sweep.shapes_the_grid or cell.replicas > 1 \
                    else []
                row = [] if variant is None else [variant.name]
                name = _slug("-".join([model.name, comp, network.name, *row, *shape,
                                       f"s{seed}", f"r{rep}"]))
                if name in made_by and made_by[name] == mi:  # (a run directory each)
                    raise ConfigError(
                        path, f"two runs are named {name!r} (a run's name joins its model, "
                        "spec, network, variant, grid, seed and repeat, a long one cut in "
                        "its middle): give the networks or variants names that keep them "
                        "apart", "$.sweep")
                if name in made_by:
                    raise ConfigError(
                        path, f"model profiles {made_by[name]} and {mi} both make a run "
                        f"named {name!r}: give them different names",
                        f"$.model_configs[{mi}]")
                made_by[name] = mi
                wiring = _run_wiring(profile.cluster_profile, cell)
                runs.append(RunSpec(
                    index=len(runs), run_name=name, model=model_dict,
                    training=training, fellows=profile.cluster_profile.num_fellows
                    if "layout" in wiring else cell.fellows,
                    replicas=cell.replicas,
                    network=unstructure(network),
                    tc_profile=None if network.tc_profile is None
                    else unstructure(network.tc_profile),
                    seed=seed, repeat=rep, model_source=str(mpath), compression=comp,
                    wiring=wiring, variant=None if variant is None else variant.name))
                if wiring:  # (a chain's topology is its grid, checked above)
                    _check_job(runs[-1], path, tpath)
                if len(runs) == 1 and variant is not None and sweep.warm_up is not None \
                        and warm_up:
                    warm_base = _warm_base(runs[0], profile, sweep, network, path, cell)
    runs_dir = resolve_ref(tpath.parent, profile.artifacts.runs_dir, tpath, "$.artifacts.runs_dir")
    resolve_replays(runs, cfg, path, tpath)
    exp = ResolvedExperiment(str(path), cfg, str(tpath), profile, runs, runs_dir,
                             hashlib.sha256(path.read_bytes()).hexdigest(), warm_base)
    if cfg.sweep.warm_up is not None and warm_up:
        _check_warm_up(exp, cfg.sweep.warm_up.steps, path)
    return exp


def warm_up_run(first: RunSpec, steps: int) -> RunSpec:
    """A sweep's warm-up job (``sweep.warm_up``): its first run's, ``steps`` long, and only
    what makes the weights: unshaped, no link-selective compression, data parallel in fp32
    where it has replicas, no moves or rebalancing, no replays."""
    training = {**first.training, "steps": steps, "warm_start": None, "link": None,
                "network": None, "compress_when": None, "sync": {"mode": "dp"}}
    wiring = {k: v for k, v in first.wiring.items() if k not in ("moves", "rebalance_every")}
    return attrs.evolve(first, training=training, wiring=wiring, churn=None, tc_profile=None)


def warm_started(exp: ResolvedExperiment, warm_start: dict[str, Any]) -> ResolvedExperiment:
    """``exp`` with every run starting from a finished job's checkpoint (``swarm sweep
    --warm-start``): the warm-up one sweep trained, shared by another so that several
    configs' rows start from one point. It stands in for the config's ``sweep.warm_up``
    (nothing is trained first); the leader checks each run against that job at submit."""
    runs = [attrs.evolve(r, training={**r.training, "warm_start": dict(warm_start)})
            for r in exp.runs]
    config = attrs.evolve(exp.config, sweep=attrs.evolve(exp.config.sweep, warm_up=None,
                                                          overrides={
        **exp.config.sweep.overrides, "warm_start": dict(warm_start)}))
    return attrs.evolve(exp, config=config, runs=runs)


def _warm_base(first: RunSpec, profile: TrainingProfile, sweep: SweepSpec,
               network: NetworkProfile, path: Path, cell: GridCell) -> RunSpec:
    """Run 0 as a warm-up trains it under variants: no row of the grid favoured, so without
    its variant's overrides, and data parallel (the sweep's sync overrides, a row's method,
    left out with its mode: :func:`warm_up_run` syncs it by dp in fp32)."""
    plain = attrs.evolve(sweep, overrides={k: v for k, v in sweep.overrides.items()
                                           if k != "sync"})
    dp = attrs.evolve(cell, sync="dp" if cell.replicas > 1 else "none", inner_steps=None)
    try:
        training = _run_training(profile, plain, first.seed, network, path, dp, None)
    except ConfigError as exc:
        raise ConfigError(path, f"the warm-up (run 0's job without its variant): "
                          f"{exc.message}", "$.sweep.warm_up") from None
    return attrs.evolve(first, variant=None, training=training)


def _check_warm_up(exp: ResolvedExperiment, steps: int, path: Path) -> None:
    """Every run can start from the warm-up's weights, as the leader would check it at
    submit (the same model, and the split or seed a boundary ties them to): refused now, not
    after the warm-up has trained."""
    from swarm_core.contract.job import warm_split_mismatch

    try:
        warm = exp.warm_up(steps).job("warm-up")
    except SchemaError as exc:
        raise ConfigError(path, f"the warm-up (run 0's job, {steps} steps): {exc.message}",
                          "$.sweep.warm_up") from None
    assert warm.model is not None and warm.train is not None
    shape = job_shape_error(warm.model, warm.train, warm.topology.num_stages,
                            warm.topology.replicas, warm.topology.layout)
    if shape is not None:
        raise ConfigError(path, f"the warm-up (run 0's job, {steps} steps): {shape[0]}",
                          "$.sweep.warm_up")
    for run in exp.runs:
        job = run.job(run.run_name)
        assert job.model is not None and job.train is not None
        why = warm_start_mismatch(job.model, job.train, warm.model, warm.train) \
            or warm_split_mismatch(job, warm, "the warm-up")
        if why is not None:
            raise ConfigError(path, f"run {run.index} {run.run_name} cannot start from the "
                              f"warm-up (run 0's job): {why}", "$.sweep.warm_up")


def _variant_cells(profile: TrainingProfile, sweep: SweepSpec, path: Path, tpath: Path
                   ) -> list[tuple[int | None, GridCell]]:
    """The grid's cells, each with the index of the variant it runs (None: no variants):
    by shape (``grids``, else ``stages``), then variant, then the variant's (or the
    sweep's) replicas, sync and inner steps."""
    if sweep.variants is None:
        cells = _grid(profile, sweep, path, tpath)
        _check_swarm_axis(sweep, cells, path)
        return [(None, cell) for cell in cells]
    if sweep.sync is not None and all(v.sync is not None for v in sweep.variants):
        raise ConfigError(path, "every variant gives its own sync: leave the sweep's out",
                          "$.sweep.sync")
    mode, _ = _profile_sync(profile, sweep)
    out: list[tuple[int | None, GridCell]] = []
    took_inner = False  # (whether a variant repeats its runs by the sweep's inner_steps)
    for i, v in enumerate(sweep.variants):
        # (the sweep's inner steps are its periodic rows': a dp row has none)
        inner = v.inner_steps or (sweep.inner_steps if any(
            map(periodic, v.sync or sweep.sync or [mode])) else None)
        took_inner |= v.inner_steps is None and inner is not None
        axes = attrs.evolve(sweep, sync=v.sync or sweep.sync, inner_steps=inner)
        at = f"$.sweep.variants[{i}]"
        where = {"sync": at if v.sync is not None else "$.sweep",
                 "inner_steps": at if v.inner_steps is not None else "$.sweep"}
        out += [(i, cell) for cell in _grid(profile, axes, path, tpath, where)]
    if sweep.inner_steps is not None and not took_inner:
        raise ConfigError(path, "no variant takes the sweep's inner_steps (each gives its "
                          "own or syncs every step): leave them out", "$.sweep.inner_steps")
    shapes: list[Any] = [*(sweep.grid_shapes or sweep.stages or [])]
    if shapes:  # (a stable sort: by shape, each shape's runs in variant order)
        out.sort(key=lambda run: shapes.index(
            (run[1].stages, run[1].replicas) if sweep.grids is not None else run[1].stages))
    _check_swarm_axis(sweep, [cell for _, cell in out], path)
    return out


def _profile_sync(profile: TrainingProfile, sweep: SweepSpec) -> tuple[Any, int]:
    """The sync mode and inner steps a run takes where no axis sets them: the training
    profile's, or the sweep's overrides of them."""
    sync, over = profile.training.sync, sweep.overrides.get("sync")
    over = over if isinstance(over, dict) else {}
    return over.get("mode", sync.mode), over.get("inner_steps", sync.inner_steps)


def _grid(profile: TrainingProfile, sweep: SweepSpec, path: Path,
          tpath: Path, where: dict[str, str] | None = None) -> list[GridCell]:
    """The sweep's grid axes expanded against the training profile's cluster and sync
    (``where``: by axis, the field its error names, a variant's; the sweep's otherwise)."""
    cluster = profile.cluster_profile
    mode, inner = _profile_sync(profile, sweep)
    # A layout or a given route's weights are drawn for one grid: an axis that changes it
    # (or a chain beside a layout, which has no chain) is refused, not run on a guess.
    fixed = next((name for name in ("layout", "route_weights", "moves")
                  if getattr(cluster, name) is not None), None)
    if fixed is not None:
        for axis in ("stages", "replicas", "grids"):
            if getattr(sweep, axis) is not None:
                raise ConfigError(path, f"the training profile's cluster_profile.{fixed} "
                                  f"({tpath.name}) is drawn for its own grid: sweep.{axis} "
                                  "would change it", f"$.sweep.{axis}")
    if cluster.layout is not None and "chain" in (sweep.wiring or []):
        raise ConfigError(path, f"the training profile's cluster_profile.layout "
                          f"({tpath.name}) has no chain wiring: leave chain out",
                          "$.sweep.wiring")
    try:
        if sweep.grid_shapes is not None:
            # (every listed mode and H must run in some shape, not in each)
            grid_cells(1, cluster.replicas, mode, inner, [r for _, r in sweep.grid_shapes],
                       sweep.sync, sweep.inner_steps)
            cells = [cell for stages, r in sweep.grid_shapes
                     for cell in grid_cells(stages, cluster.replicas, mode, inner, [r],
                                            sweep.sync, sweep.inner_steps, check=False)]
        else:
            cells = [cell for stages in sweep.stages or [cluster.num_stages]
                     for cell in grid_cells(stages, cluster.replicas, mode, inner,
                                            sweep.replicas, sweep.sync, sweep.inner_steps)]
    except FieldError as exc:
        field = exc.field or "sync"
        prefix = (where or {}).get(field, "$.sweep")
        if sweep.grids is not None and field == "replicas":
            field = "grids"
        raise ConfigError(path, str(exc), f"{prefix}.{field}") from None
    # As inner_steps repeats periodic runs only, the wiring (the axis's, or the profile's)
    # applies to the runs it can route: several replicas kept by dp (a periodic mode's
    # replicas train apart between syncs, which routed micro-batches would mix); the others
    # run once, chained. A layout's runs are all its own (its grid is fixed above, and a
    # mode it cannot take is the job's error).
    wirings: list[Wiring] = sweep.wiring or [cluster.wiring]
    chained: list[Wiring] = ["chain"]
    return [attrs.evolve(cell, wiring=w) for cell in cells
            for w in (wirings if cluster.layout is not None
                      or (cell.replicas > 1 and cell.sync == "dp") else chained)]


def _check_swarm_axis(sweep: SweepSpec, cells: list[GridCell], path: Path) -> None:
    if sweep.wiring is not None and "swarm" in sweep.wiring \
            and all(c.wiring == "chain" for c in cells):
        raise ConfigError(path, "swarm wiring routes between the replicas of runs kept by dp, "
                          "and this sweep has none", "$.sweep.wiring")


def _run_wiring(cluster: ClusterProfile, cell: GridCell) -> dict[str, Any]:
    """A run's topology past its grid: the profile's where the run wires as it does, nothing
    for a chain (the swarm fields are a swarm's), equal routes for a chain profile's swarm."""
    if cell.wiring == cluster.wiring:
        return cluster.wiring_fields()
    return {} if cell.wiring == "chain" else {"wiring": "swarm"}


def _check_job(run: RunSpec, path: Path, tpath: Path) -> None:
    """The run as the leader would check it; what it refuses in the topology is the training
    profile's cluster_profile (the sweep's axes were checked apart), the rest the sweep's."""
    try:
        run.job(run.run_name)
    except SchemaError as exc:
        field = exc.field or "$"
        if field.startswith("$.topology"):
            raise ConfigError(tpath, f"{exc.message} (run {run.run_name})",
                              "$.cluster_profile" + field.removeprefix("$.topology")) \
                from None
        raise ConfigError(path, f"{field}: {exc.message} (run {run.run_name})",
                          "$.sweep") from None


def _check_shape(model: dict[str, Any], training: dict[str, Any], cell: GridCell,
                 sweep: SweepSpec, path: Path, tpath: Path, mpath: Path,
                 cluster: ClusterProfile, variant: int | None = None) -> None:
    """What the leader would refuse, refused here first, naming the file and field at fault."""
    # (one cell per fellow, as RunSpec.job_body asks)
    shape = job_shape_error(structure(model, ModelConfig), structure(training, TrainingConfig),
                            cell.stages, cell.replicas,
                            cluster.layout if cell.wiring == cluster.wiring else None)
    if shape is None:
        return
    message, where = shape
    own = sweep.variant_overrides(variant)
    if where == "training.batch_size" and sweep.replicas is not None \
            and "batch_size" not in {**sweep.overrides, **own}:
        # (the replica count that does not divide it is the sweep's)
        at = sweep.replicas.index(cell.replicas)
        raise ConfigError(path, message, f"$.sweep.replicas[{at}]")
    if where.startswith("model."):  # (a model field: the model profile's, by its own name)
        raise ConfigError(mpath, message, "$." + where.removeprefix("model."))
    if where == "topology" and sweep.stages is not None:  # (the stage count the sweep gave)
        raise ConfigError(path, message, f"$.sweep.stages[{sweep.stages.index(cell.stages)}]")
    if sweep.grid_shapes is not None and (where == "topology" or (
            where == "training.batch_size" and "batch_size" not in {**sweep.overrides, **own})):
        at = sweep.grid_shapes.index((cell.stages, cell.replicas))
        raise ConfigError(path, message, f"$.sweep.grids[{at}]")
    if where == "topology":  # (the field the profile gave)
        named = "fellows" if cluster.stages is None else "stages"
        raise ConfigError(tpath, message, f"$.cluster_profile.{named}")
    field = where.removeprefix("training.")
    if field in own:
        raise ConfigError(path, message, f"$.sweep.variants[{variant}](overrides).{field}")
    if field in sweep.overrides:
        raise ConfigError(path, message, f"$.sweep(overrides).{field}")
    raise ConfigError(tpath, message, f"$.{field}")


def _run_training(profile: TrainingProfile, sweep: SweepSpec, seed: int,
                  network: NetworkProfile, path: Path, cell: GridCell,
                  variant: int | None = None) -> dict[str, Any]:
    """A run's training fields: the profile's, the sweep's fields and overrides over them,
    then its variant's overrides (``variant``: its index in ``sweep.variants``), its grid
    cell's sync and its seed."""
    training = unstructure(profile.training)
    for key in ("dataset", "tokenizer", "real_min_tokens", "steps"):
        value = getattr(sweep, key)
        if value is not None:
            training[key] = value
    own = sweep.variant_overrides(variant)
    overrides = merged_overrides(sweep.overrides, own)
    training = merged_overrides(training, anchor_dataset_paths(overrides, path.parent))
    if cell.sync != "none":  # (one replica keeps the profile's sync: it never runs)
        training["sync"] = {**training["sync"], "mode": cell.sync,
                            **({"inner_steps": cell.inner_steps} if cell.inner_steps else {})}
    training["seed"] = seed
    _apply_profiles(training, profile.artifacts, network)
    try:
        structure(training, TrainingConfig)
    except SchemaError as exc:
        field = exc.field or "$"
        # (the variant's where it set the field, the sweep's otherwise)
        keys = field.removeprefix("$.").split(".")
        own_sync: dict[str, Any] = own["sync"] if isinstance(own.get("sync"), dict) else {}
        set_here = keys[1] in own_sync if keys[0] == "sync" and len(keys) > 1 \
            else keys[0] in own
        where = f"$.sweep.variants[{variant}](overrides)" if set_here else "$.sweep(overrides)"
        raise ConfigError(path, exc.message, field.replace("$", where, 1)) from None
    return training


def _slug(text: str, most: int = 120) -> str:
    """``text`` as a folder name: at most ``most`` characters, a long one cut in its middle
    (its end names the run's variant, grid, seed and repeat, which tell runs apart)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", text)
    return slug if len(slug) <= most else f"{slug[:most // 2]}_{slug[-(most - most // 2 - 1):]}"


def resolve_replays(runs: list[RunSpec], cfg: ExperimentConfig, path: Path,
                    tpath: Path) -> None:
    """Each run's link trace and churn script read and checked now (a bad one is an error at
    validate time, not mid-sweep), their files made absolute: a trace relative to the file
    that names its network profile, the churn script to the experiment config."""
    swept = cfg.sweep.network_profiles is not None
    resolved: dict[str, Any] = {}
    for run in runs:
        spec = run.network.get("trace")
        if spec is not None:
            name = str(run.network.get("name"))
            if name not in resolved:
                names = [n.name for n in cfg.sweep.network_profiles or []]
                where = (path, f"$.sweep.network_profiles[{names.index(name)}].trace") \
                    if swept else (tpath, "$.network_profile.trace")
                try:
                    done, _ = resolve_trace(structure(spec, LinkTraceSpec), where[0].parent)
                except (TraceError, SchemaError) as exc:
                    raise ConfigError(where[0], str(exc), where[1]) from None
                resolved[name] = unstructure(done)
            run.network = {**run.network, "trace": resolved[name]}
    if cfg.sweep.churn is not None:
        try:
            script = load_churn(library_or_path(cfg.sweep.churn, "churn", path.parent))
        except TraceError as exc:
            raise ConfigError(path, str(exc), "$.sweep.churn") from None
        for run in runs:
            run.churn = unstructure(script)
