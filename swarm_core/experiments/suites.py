"""Benchmark suites: the same model and training over different cluster shapes.

A suite lists scenarios; each names its model, training and infra profile and its artifact
directory, and may name its grid shape (``grid: {stages, replicas}``, and how micro-batches
travel between replicas: ``wiring``, ``routing``, ``route_weights``, ``layout``, ``moves``,
``rebalance_every`` as a job's topology takes them; by default every cell of the infra is a
pipeline stage, one replica) and how its replicas keep in step (``sync``: any of
``training.sync``'s fields, over the training profile's). An infra profile describes nodes
(groups of fellows), device slots per fellow and the link between nodes. On one machine a node
is a group of fellows; the link between nodes is applied by the fellows' own link shapers.
Every scenario records what was emulated and what was not (``infra_resolved.json``).
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path
from typing import Any, Literal

import attrs

from swarm_core import jsonio
from swarm_core.config.grid import MAX_REPLICAS, Wiring, layout_label
from swarm_core.config.profiles import (
    ClusterProfile,
    ConfigError,
    ExperimentConfig,
    ResolvedExperiment,
    RunSpec,
    TrainingProfile,
    _read_json,
    _structure,
    load_model_profile,
    resolve_ref,
)
from swarm_core.config.schemas import ModelConfig, SyncConfig, TrainingConfig, job_shape_error
from swarm_core.config.traces import (
    LinkTraceSpec,
    TraceError,
    library_or_path,
    load_churn,
    resolve_trace,
)
from swarm_core.contract import JobSubmit
from swarm_core.contract.placement import cell_count
from swarm_core.contract.rebalance import PeerMove
from swarm_core.experiments.report import ReportError, read_records, read_summary
from swarm_core.experiments.summary import MetricsSummary
from swarm_core.paths import atomic_write
from swarm_core.protocol import FellowInfo, LinkLimits
from swarm_core.schema import FieldError, SchemaError, structure, unstructure

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def _name(_i: Any, a: attrs.Attribute, v: str) -> None:
    if not _NAME.fullmatch(v):
        raise FieldError(f"must be 1-64 of letters, digits, '_', '.', '-', got {v!r}", a.name)


@attrs.define
class NodeSpec:
    name: str = attrs.field(validator=_name)
    fellows: int = 1
    slots_per_fellow: int = 1

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.fellows <= 64:
            raise FieldError(f"must be 1-64, got {self.fellows}", "fellows")
        if not 1 <= self.slots_per_fellow <= 16:
            raise FieldError(f"must be 1-16, got {self.slots_per_fellow}", "slots_per_fellow")


@attrs.define
class InfraProfile:
    name: str = attrs.field(validator=_name)
    nodes: list[NodeSpec]
    description: str = ""
    inter_node_link: LinkLimits | None = None

    def __attrs_post_init__(self) -> None:
        if not self.nodes:
            raise FieldError("must list at least one node", "nodes")
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise FieldError(f"node names must be unique, got {names}", "nodes")

    @property
    def stages(self) -> int:
        return sum(n.fellows * n.slots_per_fellow for n in self.nodes)


@attrs.define
class ScenarioArtifacts:
    dir: str = attrs.field(validator=_name)


@attrs.define
class GridShape:
    """A scenario's job as a grid: ``stages`` pipeline stages x ``replicas`` of each; its cells
    are the infra's device slots (fellows x slots_per_fellow), so the two must agree. A
    swarm-wired scenario may give a ``layout`` instead (per stage, its cells' ids; stages of
    unequal cells, ``replicas`` the job's data shares), and ``moves``: a job topology's."""

    stages: int | None = None  # default: the layout's
    replicas: int = 1
    # How micro-batches travel between the replicas (a job topology's fields of the same
    # names): chain, or swarm with its routing, weights, layout, moves and rebalancing.
    wiring: Wiring = "chain"
    routing: Literal["given", "measured"] = "given"
    route_weights: list[list[float]] | None = None
    layout: list[list[int]] | None = None
    moves: list[PeerMove] | None = None
    rebalance_every: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.stages is None:
            if self.layout is None:
                raise FieldError("give stages (or a swarm layout's cells by stage)", "stages")
            self.stages = len(self.layout)
        if not 1 <= self.stages <= 1024:
            raise FieldError(f"must be 1-1024, got {self.stages}", "stages")
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise FieldError(f"must be 1-{MAX_REPLICAS}, got {self.replicas}", "replicas")
        if self.layout is not None and len(self.layout) != self.stages:
            raise FieldError(f"a layout of {len(self.layout)} stages in a grid of "
                             f"{self.stages}", "layout")
        self.wiring_fields()  # (checked as a job's topology is, against its grid)

    @property
    def num_stages(self) -> int:
        assert self.stages is not None
        return self.stages

    @property
    def cells(self) -> int:
        """The device slots it fills: its layout's cells, else stages x replicas."""
        return cell_count(self.layout, self.num_stages, self.replicas)

    @property
    def label(self) -> str:
        """``2x2``, or a layout's cells by stage: ``cells 1+3``."""
        if self.layout is not None:
            return layout_label(self.layout)
        return f"{self.stages}x{self.replicas}"

    def wiring_fields(self) -> dict[str, Any]:
        """The job topology's fields past its grid (``{}`` for a chain); FieldError at the
        field a job's topology would refuse."""
        return ClusterProfile(stages=self.stages, replicas=self.replicas, wiring=self.wiring,
                              routing=self.routing, route_weights=self.route_weights,
                              layout=self.layout, moves=self.moves,
                              rebalance_every=self.rebalance_every).wiring_fields()


@attrs.define
class ScenarioSpec:
    name: str = attrs.field(validator=_name)
    model: str
    training: str
    infra: str
    artifacts: ScenarioArtifacts
    grid: GridShape | None = None  # None: every cell a stage, one replica
    # Fields of SyncConfig over the training profile's ``sync``, so one training profile serves
    # a dp and a DiLoCo scenario; checked against SyncConfig once the profile is read.
    sync: dict[str, Any] | None = None
    # Replayed live against the scenario's job (swarm_core.config.traces): a churn script and a
    # link trace, each a library name or a path relative to the suite.
    churn: str | None = None
    trace: LinkTraceSpec | None = None


@attrs.define
class SuiteSpec:
    name: str = attrs.field(validator=_name)
    scenarios: list[ScenarioSpec]
    description: str = ""
    repeats: int = 1
    baseline: str | None = None

    def __attrs_post_init__(self) -> None:
        if not self.scenarios:
            raise FieldError("must list at least one scenario", "scenarios")
        names = [s.name for s in self.scenarios]
        if len(set(names)) != len(names):
            raise FieldError(f"scenario names must be unique, got {names}", "scenarios")
        dirs = [s.artifacts.dir for s in self.scenarios]
        if len(set(dirs)) != len(dirs):
            raise FieldError(f"artifact dirs must be unique, got {dirs}", "scenarios")
        if self.baseline is not None and self.baseline not in names:
            raise FieldError(f"names no scenario ({self.baseline!r})", "baseline")
        if not 1 <= self.repeats <= 20:
            raise FieldError(f"must be 1-20, got {self.repeats}", "repeats")


@attrs.define
class ResolvedScenario:
    spec: ScenarioSpec
    model: ModelConfig
    training: TrainingConfig
    infra: InfraProfile
    fellows: int  # fellow processes this scenario needs
    stages: int
    slots_per_fellow: int
    emulated: list[str]
    not_emulated: list[str]
    sources: dict[str, str]
    replicas: int = 1  # of every stage
    churn: dict[str, Any] | None = None  # (a ChurnScript, its files made absolute)
    trace: dict[str, Any] | None = None  # (a LinkTraceSpec, its file made absolute)

    @property
    def sync_mode(self) -> str:
        return "none" if self.replicas == 1 else self.training.sync.mode


@attrs.define
class ResolvedSuite:
    path: str
    spec: SuiteSpec
    scenarios: list[ResolvedScenario]

    @property
    def fellows_needed(self) -> int:
        return max(s.fellows for s in self.scenarios)


def _emulation(infra: InfraProfile) -> tuple[int, list[str], list[str]]:
    emulated = [f"node {n.name}: a group of {n.fellows} fellow process(es) on this machine, "
                f"{n.slots_per_fellow} device slot(s) each (stages in one fellow talk over "
                "loopback TCP, outside its link shaping)" for n in infra.nodes]
    missing = []
    fellows = 0
    for n in infra.nodes:
        fellows += n.fellows
        if n.slots_per_fellow > 1:
            missing.append(f"node {n.name}: separate devices: the slots are CPU slots sharing "
                           "this machine's cores")
    if len(infra.nodes) > 1:
        if infra.inter_node_link is not None:
            lk = infra.inter_node_link
            emulated.append(f"inter-node link: tx {lk.tx_mbps} / rx {lk.rx_mbps} Mbit/s, "
                            f"{lk.latency_ms:g} ms added latency, by each fellow's link shaper "
                            "(token buckets; latency per frame)")
        else:
            emulated.append("inter-node link: loopback TCP, unshaped")
        missing.append("separate machines: all nodes share this machine's cores and memory, so "
                       "compute contends where real nodes would not")
        if any(n.fellows > 1 for n in infra.nodes) and infra.inter_node_link is not None:
            missing.append("per-peer shaping: links between a node's fellow processes are "
                           "shaped as inter-node ones (a fellow's own slots are not)")
        missing.append("network namespaces per node: not created by the suite (loopback)")
    return fellows, emulated, missing


def load_suite(path: Path | str) -> ResolvedSuite:
    path = Path(path)
    spec: SuiteSpec = _structure(_read_json(path), SuiteSpec, path)
    base = path.parent
    scenarios = []
    for i, sc in enumerate(spec.scenarios):
        where = f"$.scenarios[{i}]"
        mpath = resolve_ref(base, sc.model, path, f"{where}.model")
        model = load_model_profile(mpath, (path, f"{where}.model"))
        tpath = resolve_ref(base, sc.training, path, f"{where}.training")
        raw = _read_json(tpath, (path, f"{where}.training"))
        training = _structure(raw, TrainingConfig, tpath)
        if sc.sync is not None:
            training = _with_sync(training, sc.sync, path, f"{where}.sync")
        ipath = resolve_ref(base, sc.infra, path, f"{where}.infra")
        infra = _structure(_read_json(ipath, (path, f"{where}.infra")), InfraProfile, ipath)
        fellows, emulated, missing = _emulation(infra)
        slots = {n.slots_per_fellow for n in infra.nodes}
        if len(slots) > 1:
            raise ConfigError(ipath, "all nodes must give their fellows the same number of "
                              "slots (placement fills each fellow's slots evenly)", "$.nodes")
        stages, replicas = _grid(sc, infra, model, training, path, where)
        if sc.sync is not None and replicas == 1:
            # (as a sweep's sync axis over single replicas is: it could only be a slip)
            raise ConfigError(path, "sync keeps the replicas of a stage in step, and this "
                              "scenario runs 1 replica of each (set grid.replicas, or leave "
                              "sync out)", f"{where}.sync")
        if sc.grid is not None and sc.grid.wiring_fields():
            _check_wiring(sc.grid, model, training, path, where)
        if sc.grid is not None and sc.grid.layout is not None:
            emulated.append(f"grid {sc.grid.label}: a swarm layout's cells over {replicas} "
                            f"data shares, each stage's cells kept in step by "
                            f"{training.sync.mode} over the same shaped links")
        elif replicas > 1:
            emulated.append(f"grid {stages}x{replicas}: {replicas} replicas of every stage, "
                            f"kept in step by {training.sync.mode} (sync compression "
                            f"{training.sync.compression}) over the same shaped links")
        churn, trace = _replays(sc, path, where)
        scenarios.append(ResolvedScenario(sc, model, training, infra, fellows, stages,
                                          slots.pop(), emulated, missing,
                                          {"model": str(mpath), "training": str(tpath),
                                           "infra": str(ipath)}, replicas, churn, trace))
    return ResolvedSuite(str(path), spec, scenarios)


def _check_wiring(grid: GridShape, model: ModelConfig, training: TrainingConfig, path: Path,
                  where: str) -> None:
    """A routed grid as the leader checks its job (swarm wiring over a periodic sync, a
    route over a grid it does not fit): a one-line error at the scenario's grid."""
    body = {"name": "check", "kind": "train", "model": unstructure(model),
            "training": unstructure(training),
            "topology": {"stages": grid.stages, "replicas": grid.replicas,
                         **grid.wiring_fields()}}
    try:
        structure(body, JobSubmit)
    except SchemaError as exc:
        raise ConfigError(path, exc.message, f"{where}.grid") from None


def _replays(sc: ScenarioSpec, path: Path, where: str
             ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The scenario's churn script and link trace, read and checked now."""
    churn = trace = None
    try:
        if sc.churn is not None:
            field = f"{where}.churn"
            churn = unstructure(load_churn(library_or_path(sc.churn, "churn", path.parent)))
        if sc.trace is not None:
            field = f"{where}.trace"
            trace = unstructure(resolve_trace(sc.trace, path.parent)[0])
    except TraceError as exc:
        raise ConfigError(path, str(exc), field) from None
    return churn, trace


def _with_sync(training: TrainingConfig, fields: dict[str, Any], path: Path,
               where: str) -> TrainingConfig:
    """``training`` with ``fields`` over its ``sync``, checked as ``training.sync`` is; a bad
    value is a ConfigError at ``where`` in the suite, where it was written."""
    merged = {**unstructure(training.sync), **fields}
    sync: SyncConfig = _structure(merged, SyncConfig, path, where)
    return attrs.evolve(training, sync=sync)


def _grid(sc: ScenarioSpec, infra: InfraProfile, model: ModelConfig, training: TrainingConfig,
          path: Path, where: str) -> tuple[int, int]:
    """The scenario's (stages, replicas): its ``grid``, checked against the infra's cells and
    as the leader checks a job's shape; without one, every cell a stage."""
    cells = infra.stages
    if sc.grid is None:
        if cells > model.n_layers + 2:
            raise ConfigError(path, f"{cells} stages for a {model.n_layers}-layer model",
                              f"{where}.infra")
        return cells, 1
    stages, replicas = sc.grid.num_stages, sc.grid.replicas
    if sc.grid.cells != cells:
        raise ConfigError(path, f"grid {sc.grid.label} is {sc.grid.cells} cells; infra "
                          f"{infra.name!r} has {cells} (fellows x slots_per_fellow)",
                          f"{where}.grid")
    shape = job_shape_error(model, training, stages, replicas, sc.grid.layout)
    if shape is not None:  # (a one-line error at the grid: the shape it names is at fault)
        raise ConfigError(path, shape[0], f"{where}.grid")
    return stages, replicas


def as_experiment(suite: ResolvedSuite, out_dir: Path) -> ResolvedExperiment:
    """The suite as runs for :class:`swarm_core.experiments.runner.Experiment` (one per scenario and
    repeat), so queuing, monitoring and run artifacts are shared with sweeps."""
    runs: list[RunSpec] = []
    for sc in suite.scenarios:
        for rep in range(suite.spec.repeats):
            training = unstructure(sc.training)
            link = sc.infra.inter_node_link if len(sc.infra.nodes) > 1 else None
            training["link"] = None if link is None else unstructure(link)
            name = sc.spec.artifacts.dir + (f"-r{rep}" if suite.spec.repeats > 1 else "")
            runs.append(RunSpec(
                index=len(runs), run_name=name, model=unstructure(sc.model), training=training,
                fellows=sc.fellows, slots_per_fellow=sc.slots_per_fellow,
                network={"name": sc.infra.name, **(unstructure(link) if link else {}),
                         **({"trace": sc.trace} if sc.trace else {})},
                tc_profile=None, seed=sc.training.seed, repeat=rep,
                model_source=sc.sources["model"], compression=sc.model.compression,
                replicas=sc.replicas, churn=sc.churn,
                wiring={} if sc.spec.grid is None else sc.spec.grid.wiring_fields()))
    cfg = ExperimentConfig(name=suite.spec.name, training_config="(per scenario)",
                           model_configs=["(per scenario)"], description=suite.spec.description)
    profile = TrainingProfile(TrainingConfig(), *_dummy_profiles())
    digest = hashlib.sha256(Path(suite.path).read_bytes()).hexdigest()
    return ResolvedExperiment(suite.path, cfg, "(per scenario)", profile, runs, out_dir,
                              digest)


def _dummy_profiles() -> tuple[Any, Any, Any]:
    from swarm_core.config.profiles import ArtifactsProfile, ClusterProfile, NetworkProfile

    # A scenario's folder holds its model export (the workflow glues it from there).
    return ClusterProfile(), NetworkProfile(), ArtifactsProfile(export=True)


def plan(suite: ResolvedSuite, fellows: list[FellowInfo] | None) -> dict[str, Any]:
    """``suite_plan.json``: every scenario resolved, and the topology check when a leader's
    fellows are known."""
    active = None if fellows is None else [f for f in fellows if f.status.live]
    out: dict[str, Any] = {
        "suite": suite.spec.name, "source": suite.path, "planned_at": time.time(),
        "repeats": suite.spec.repeats, "baseline": suite.spec.baseline,
        "fellows_needed": suite.fellows_needed,
        "fellows_active": None if active is None else len(active),
        "scenarios": [],
    }
    for sc in suite.scenarios:
        able = None if active is None else \
            [f for f in active if len(f.devices) >= sc.slots_per_fellow]
        ok = able is None or len(able) >= sc.fellows
        slots = f" with {sc.slots_per_fellow} device slots" if sc.slots_per_fellow > 1 else ""
        out["scenarios"].append({
            "name": sc.spec.name, "artifacts_dir": sc.spec.artifacts.dir,
            "stages": sc.stages, "replicas": sc.replicas, "sync_mode": sc.sync_mode,
            "layout": None if sc.spec.grid is None else sc.spec.grid.layout,
            "fellows_needed": sc.fellows,
            "slots_per_fellow": sc.slots_per_fellow,
            "model": unstructure(sc.model), "training": unstructure(sc.training),
            "infra": unstructure(sc.infra), "emulated": sc.emulated,
            "not_emulated": sc.not_emulated, "sources": sc.sources,
            "churn": sc.churn, "trace": sc.trace,
            "topology_ok": ok,
            "topology_note": "" if ok else
            f"needs {sc.fellows} active fellow(s){slots}, the leader has {len(able or [])}",
        })
    return out


def write_json(path: Path, data: Any) -> None:
    atomic_write(path, jsonio.dumps(data, pretty=True))


def summarize(suite: ResolvedSuite, out_dir: Path, run_dirs: dict[str, Path]) -> dict[str, Any]:
    """``suite_summary.json``: per scenario tokens/s, step time, losses, bytes, slow-down."""
    rows: list[dict[str, Any]] = []
    for sc in suite.scenarios:
        d = run_dirs.get(sc.spec.name)
        summary, status = MetricsSummary(), "NOT RUN"
        steps: list[float] = []
        damage = None
        if d is not None and (d / "metrics_summary.json").exists():
            try:
                summary = read_summary(d)
                status = summary.status or status
                steps = [r["step_seconds"] for r in read_records(d) if r.get("step_seconds")]
            except ReportError as exc:
                summary, status, damage = MetricsSummary(), "DAMAGED", str(exc)
        steps_sorted = sorted(steps[1:] or steps)  # the first step pays for warm-up
        median = steps_sorted[len(steps_sorted) // 2] if steps_sorted else None
        rows.append({
            "scenario": sc.spec.name, "status": status,
            "stages": sc.stages, "replicas": sc.replicas, "sync_mode": sc.sync_mode,
            "layout": None if sc.spec.grid is None else sc.spec.grid.layout,
            "tokens_per_s": summary.tokens_per_s,
            "step_time_s": median, "final_loss": summary.final_loss,
            "eval_loss": summary.eval_loss,
            "wire_bytes_per_step": summary.wire_bytes_per_step,
            "sync_bytes_per_step": summary.sync_bytes_per_step,
            "link": unstructure(sc.infra.inter_node_link) if sc.infra.inter_node_link else None,
            "run_dir": str(d) if d else None,
            **({"damage": damage} if damage else {}),
        })
    base_name = suite.spec.baseline or suite.scenarios[0].spec.name
    base = next(r for r in rows if r["scenario"] == base_name)
    unconstrained = {r["scenario"]: r for r in rows if r["link"] is None and r["stages"] > 1}
    micro = {sc.spec.name: sc.training.micro_batches for sc in suite.scenarios}
    for r in rows:
        if base["step_time_s"] and r["step_time_s"]:
            r["slowdown_vs_baseline"] = r["step_time_s"] / base["step_time_s"]
        if r["link"] and r["wire_bytes_per_step"] and r["link"].get("tx_mbps"):
            # Each direction carries half the step's bytes; both run at once.
            per_dir = r["wire_bytes_per_step"] / 2
            r["link_bound_s"] = per_dir * 8 / (r["link"]["tx_mbps"] * 1e6)
            # The first activation and the last gradient cannot overlap anything on a
            # two-way pipe: with M micro-batches the link is busy (M+1)/M of the bound.
            m = micro[r["scenario"]]
            r["link_fill_s"] = r["link_bound_s"] * (m + 1) / m
            peer = next(iter(unconstrained.values()), None)
            if peer and peer["step_time_s"]:
                r["predicted_step_time_s"] = max(peer["step_time_s"], r["link_fill_s"])
                if r["step_time_s"]:
                    r["measured_vs_predicted"] = r["step_time_s"] / r["predicted_step_time_s"]
    return {"suite": suite.spec.name, "baseline": base_name, "out_dir": str(out_dir),
            "scenarios": rows, "written_at": time.time()}
