"""A job as submitted and as the leader reports it.

``model`` and ``training`` are typed by the job's ``kind``: a ``train`` job carries a
:class:`ModelConfig` and a :class:`TrainingConfig`, a ``smoke`` job no model and a
:class:`SmokeTraining`. They are structured once, where JSON comes in (the leader's submit
route, the client's reply, a stored row), and passed as objects from there on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
from cattrs.errors import ClassValidationError

from swarm_core.config.schemas import ModelConfig, TrainingConfig
from swarm_core.contract.membership import MembershipChange
from swarm_core.contract.metrics import JobMetrics
from swarm_core.contract.placement import (
    MAX_CELL_ID,
    MAX_STAGES,
    Placement,
    PlacementError,
    cell_count,
    normal_layout,
    slot_count,
    split_layers,
)
from swarm_core.contract.rebalance import PeerMove, moves_error
from swarm_core.protocol import LinkLimits
from swarm_core.schema import (
    FieldError,
    checking,
    converter,
    lenient_converter,
    make_dict_structure_fn,
    make_dict_unstructure_fn,
    override,
    sparse,
)
from swarm_core.validators import MAX_JSON_DEPTH, bounded, meta, name_field, nests_within

JobKind = Literal["smoke", "train"]


def check_routing(wiring: str, routing: str) -> None:
    """A route is measured only where micro-batches are routed (a job's topology and a
    cluster profile alike)."""
    if routing != "given" and wiring != "swarm":
        raise FieldError("measured routing is for wiring swarm", "routing")


def route_weights_error(weights: Sequence[Sequence[float]], stages: int, width: int,
                        per: str = "replicas") -> str | None:
    """What is wrong with a swarm route's weights (a row a stage, ``width`` weights a row,
    each ``per`` one), or None: a job's topology and a layout's (by cell id) alike."""
    if len(weights) != stages or any(len(row) != width for row in weights):
        return f"must be {stages} lists (stages) of {width} weights ({per})"
    if any(not (w > 0 and w < 1e9) for row in weights for w in row):
        return "every weight must be a positive number"
    return None


@attrs.define
class Topology:
    """What a job asks of the cluster: a grid of ``stages`` pipeline stages by ``replicas``
    replicas of each (data parallel), one cell per device slot, on ``fellows`` fellows using
    ``slots_per_fellow`` slots each. Give the grid, or the fellows (then stages = fellows x
    slots_per_fellow / replicas); the rest is worked out, and what is given must agree.

    A swarm-wired job may give a ``layout`` instead of a grid: per stage, the ids of its
    cells (``pipeline/layout``; stages = its length, cells = its stages' sizes summed, and
    ``replicas`` stays the job's data shares). A layout that is the grid reads as None."""

    fellows: int | None = attrs.field(
        default=None, validator=bounded(1, 1024), metadata=meta(
            "default: stages x replicas / slots_per_fellow", minimum=1, maximum=1024))
    slots_per_fellow: int = attrs.field(
        default=1, validator=bounded(1, 64), metadata=meta("", minimum=1, maximum=64))
    stages: int | None = attrs.field(
        default=None, validator=bounded(1, 1024), metadata=meta(
            "pipeline stages; default: fellows x slots_per_fellow / replicas",
            minimum=1, maximum=1024))
    replicas: int = attrs.field(
        default=1, validator=bounded(1, 256), metadata=meta(
            "data-parallel replicas of every stage", minimum=1, maximum=256))
    # ``chain``: replica r of stage k feeds replica r of stage k+1. ``swarm`` (SWARM
    # parallelism): each micro-batch goes to a replica of the next stage by the throughput-
    # weighted rule of swarm_core.pipeline.routing, the gradient back along the same path.
    wiring: Literal["chain", "swarm"] = attrs.field(default="chain", metadata=meta(
        "chain: replica r feeds replica r; swarm: micro-batches routed to any replica of the "
        "next stage, weighted by throughput"))
    # Per stage, per replica: the throughput a swarm route deals micro-batches by (stage 0's
    # are its replicas' own shares, whatever they say); absent: equal.
    route_weights: list[list[float]] | None = attrs.field(default=None, metadata=meta(
        "swarm wiring: per stage, each replica's relative throughput (default: equal)"))
    # ``given``: the route deals by ``route_weights`` all run long (a run repeats bit for bit);
    # ``measured``: by each replica's measured throughput (SWARM's estimate, agreed in-band
    # every step: swarm_core.pipeline.routing.ThroughputEstimate), from ``route_weights``.
    routing: Literal["given", "measured"] = attrs.field(default="given", metadata=meta(
        "swarm wiring: deal micro-batches by route_weights (given) or by each replica's "
        "measured throughput (measured, SWARM's)"))
    # Stages of unequal cells (swarm_core.pipeline.layout): per stage, the sorted ids of its
    # cells, each stage with id 0 (its chain evaluates and checkpoints). Left out of the JSON
    # when None, which a layout that is the uniform grid normalises to: a grid job's JSON is
    # as it was before layouts.
    layout: list[list[int]] | None = attrs.field(default=None, metadata=meta(
        "swarm wiring, sync mode dp: per stage, the ids of its cells, each stage with id 0 "
        "(stages of unequal cells; replicas stays the job's data shares); default: every "
        "stage ids 0..replicas-1"))

    # Peers moved between stages (SWARM's rebalancing, pipeline/move): at given steps, or
    # decided in band every ``rebalance_every`` steps from measured throughput.
    moves: list[PeerMove] | None = attrs.field(default=None, metadata=meta(
        "swarm wiring, sync mode dp: peers moved between stages at given steps (each: at, "
        "source, cell, target, new_id)"))
    rebalance_every: int | None = attrs.field(
        default=None, validator=bounded(1, 1_000_000), metadata=meta(
            "swarm wiring, measured routing, sync mode dp: every that many steps, move a peer "
            "to the stage that bounds the pipeline where that raises it by 20 % (SWARM's "
            "rebalancing)", minimum=1, maximum=1_000_000))

    def __attrs_post_init__(self) -> None:
        self._normal_layout()
        if checking():
            self._check_moves()
        self._check_grid()
        if checking():
            check_routing(self.wiring, self.routing)
            if self.layout is not None and self.wiring != "swarm":
                raise FieldError("stages of unequal cells need wiring swarm", "layout")
        if not checking() or self.route_weights is None:
            return
        if self.wiring != "swarm":
            raise FieldError("route weights are for wiring swarm", "route_weights")
        why = route_weights_error(self.route_weights, self.num_stages, self.width,
                                  "replicas" if self.layout is None else "by cell id")
        if why is not None:
            raise FieldError(why, "route_weights")

    def _check_moves(self) -> None:
        if (self.moves or self.rebalance_every is not None) and self.wiring != "swarm":
            raise FieldError("peers move between stages under wiring swarm only",
                             "moves" if self.moves else "rebalance_every")
        if self.moves and self.rebalance_every is not None:
            raise FieldError("give moves or rebalance_every, not both", "moves")
        if self.rebalance_every is not None and self.routing != "measured":
            raise FieldError("rebalancing reads measured throughput: it needs routing "
                             "measured", "rebalance_every")
        if (self.moves or self.rebalance_every is not None) and self.route_weights is not None:
            # (a move's new ids would need weights of their own; equal ones are dealt)
            raise FieldError("route weights are not taken with moving peers (equal ones "
                             "are dealt); leave them out", "route_weights")

    def _normal_layout(self) -> None:
        """``layout`` checked and sorted (``contract.placement.normal_layout``), None where
        it is the grid; it gives the stage count where ``stages`` is not given."""
        if self.layout is None:
            return
        if checking():
            if not 1 <= len(self.layout) <= MAX_STAGES:
                raise FieldError(f"must list 1 to {MAX_STAGES} stages' ids, got "
                                 f"{len(self.layout)}", "layout")
            if any(not 0 <= i < MAX_CELL_ID for ids in self.layout for i in ids):
                raise FieldError(f"ids must be 0 to {MAX_CELL_ID - 1}", "layout")
        if self.stages is None:
            self.stages = len(self.layout)
        try:
            shape = normal_layout(self.layout, self.stages, self.replicas)
        except PlacementError as exc:
            if checking():
                raise FieldError(str(exc).removeprefix("layout: "), "layout") from None
            return  # (a stored row, checked when it came in)
        self.layout = None if shape is None else [list(ids) for ids in shape]

    def _check_grid(self) -> None:
        slots, replicas = self.slots_per_fellow, self.replicas
        if self.stages is None:
            self.fellows = self.fellows or 1
            cells = self.fellows * slots
            if cells % replicas and checking():
                raise FieldError(f"{self.fellows} fellow(s) x {slots} slot(s) is not a whole "
                                 f"number of stages for {replicas} replicas", "replicas")
            self.stages = max(1, cells // replicas)
            return
        cells = self.cells
        shape = f"{self.stages} stage(s) x {replicas} replica(s)" if self.layout is None else \
            f"{self.stages} stage(s) of cells {'+'.join(str(len(i)) for i in self.layout)}"
        if self.fellows is None:
            if cells % slots and checking():
                raise FieldError(f"{shape} do not fill fellows of {slots} slot(s)",
                                 "slots_per_fellow")
            self.fellows = max(1, cells // slots)
        elif self.fellows * slots != cells and checking():
            raise FieldError(f"{self.fellows} fellow(s) x {slots} slot(s) is not "
                             f"{shape}", "fellows")

    @property
    def num_stages(self) -> int:
        assert self.stages is not None
        return self.stages

    @property
    def cells(self) -> int:
        """Stage replicas in all (a layout's: its stages' cells): one device slot each."""
        return cell_count(self.layout, self.num_stages, self.replicas)

    @property
    def width(self) -> int:
        """How many ids a row by id spans (route weights): the replicas, or a layout's
        largest id + 1."""
        return slot_count(self.layout, self.replicas)

    @property
    def num_fellows(self) -> int:
        assert self.fellows is not None
        return self.fellows


@attrs.define
class SmokeTraining:
    """A smoke job's only settings: its fellows walk ``steps`` RUNNING steps of
    ``step_seconds`` each, then COMPLETE. The leader checks them at submit, the fellow again
    at START (a leader of another version)."""

    steps: int = attrs.field(default=5)
    step_seconds: float = attrs.field(default=0.2)

    def __attrs_post_init__(self) -> None:
        if not checking():
            return
        if not 1 <= self.steps <= 100_000:
            raise FieldError(f"must be 1-100000, got {self.steps}", "steps")
        if not 0 <= self.step_seconds <= 60:
            raise FieldError(f"must be 0-60, got {self.step_seconds}", "step_seconds")


AnyTraining = TrainingConfig | SmokeTraining


def kind_parts(kind: str, model: ModelConfig | None,
                training: AnyTraining | None) -> tuple[ModelConfig | None, AnyTraining | None]:
    """``model`` and ``training`` as a job of ``kind`` has them: the defaults where absent;
    an error naming the field where they do not fit the kind."""
    if kind == "smoke":
        if model is not None:
            raise FieldError("a smoke job takes no model", "model")
        if training is not None and not isinstance(training, SmokeTraining):
            raise FieldError("a smoke job's training is steps and step_seconds", "training")
        return None, training or SmokeTraining()
    if kind == "train":
        if training is not None and not isinstance(training, TrainingConfig):
            raise FieldError("a train job's training is a TrainingConfig", "training")
        return model or ModelConfig(), training or TrainingConfig()
    return model, training  # a kind this client does not know: what it was given


@attrs.define
class JobSubmit:
    """Enqueue a job: the model and training config plus the requested topology (defaults for
    what is left out)."""

    name: str = attrs.field(default="job", validator=name_field, metadata=meta("", maxLength=128))
    kind: JobKind = "train"
    model: ModelConfig | None = attrs.field(default=None, metadata=meta(
        "train jobs; null or {} for smoke jobs"))
    training: TrainingConfig | SmokeTraining | None = attrs.field(default=None, metadata=meta(
        "a TrainingConfig for train jobs, a SmokeTraining for smoke jobs"))
    topology: Topology = attrs.field(factory=Topology)

    def __attrs_post_init__(self) -> None:
        self.model, self.training = kind_parts(self.kind, self.model, self.training)
        train = self.train
        if checking() and train is not None and self.topology.wiring == "swarm" \
                and self.topology.replicas > 1 and train.sync.mode != "dp":
            # (a periodic sync's replicas train apart between syncs; routed micro-batches
            # would mix them, so their inner steps would not be DiLoCo's)
            raise FieldError(f"wiring swarm averages each stage group's gradients every "
                             f"step (sync mode dp), not {train.sync.mode}", "topology")
        if checking() and train is not None and self.topology.layout is not None \
                and train.sync.mode != "dp":
            # (the gradient mean over a stage's cells is dp's: pipeline/layout.py)
            raise FieldError(f"a layout's stages of unequal cells need sync mode dp, not "
                             f"{train.sync.mode}", "topology")
        topo = self.topology
        if checking() and train is not None and (topo.moves or topo.rebalance_every):
            if train.sync.mode != "dp":
                raise FieldError(f"peers moved between stages need sync mode dp, not "
                                 f"{train.sync.mode}", "topology")
            layout = topo.layout or [list(range(topo.replicas))] * topo.num_stages
            why = moves_error(topo.moves or [], layout, train.steps)
            if why is not None:
                raise FieldError(why, "topology.moves")

    @property
    def train(self) -> TrainingConfig | None:
        """The training config of a train job; None for a smoke job."""
        return self.training if isinstance(self.training, TrainingConfig) else None


@attrs.define
class Replacement:
    """A stage handed to another fellow by a recovery."""

    __renames__ = {"from_": "from"}

    from_: int
    to: int
    lost: str


@attrs.define
class Restart:
    at_step: int
    resume_step: int
    reason: str
    replaced: dict[str, Replacement] = attrs.field(factory=dict)  # by stage index, as text
    at: float = 0.0


@sparse  # (a change of the link alone is the JSON it always was: no null slowdown beside it)
@attrs.define
class LinkChange:
    """A set-speed on one of a job's fellows while it ran: from which step its link changed,
    or its emulated compute slowdown (swarm_core.pipeline.pace), or both."""

    at_step: int
    fellow_id: int
    # None (absent): the set-speed left the link as it was (a slowdown alone)
    link: LinkLimits | None = None
    at: float = 0.0
    slowdown: float | None = None  # emulated, not measured; None: left as it was
    to_fellow: int | None = None  # a per-pair set-speed: only the links to this fellow


@attrs.define
class ShardReceipt:
    """The leader's note of a stage's newest pushed shard."""

    stage: int
    fellow_id: int
    step: int
    weights_sha256: str | None = None
    weights_bytes: int | None = None
    optimizer_bytes: int | None = None
    config_fingerprint: str | None = None
    received_at: float | None = None


@attrs.define
class JobInfo:
    job_id: str
    name: str
    kind: str
    state: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    last_step: int
    last_loss: float | None
    fellows: list[int]
    topology: Topology
    reason: str
    model: ModelConfig | None = None
    training: TrainingConfig | SmokeTraining | None = None
    waiting_for: str = ""
    metrics: JobMetrics = attrs.field(factory=JobMetrics)
    placement: Placement | None = None
    loss_history: list[list[float]] = attrs.field(factory=list)  # GET /jobs/{id} only
    eval_history: list[list[float]] = attrs.field(factory=list)  # [step, eval loss]; likewise
    latest_shard_pushes: dict[str, ShardReceipt] = attrs.field(factory=dict)
    attempt: int = 0
    restarts: list[Restart] = attrs.field(factory=list)
    # Set-speeds while it ran: the first and the newest 199.
    link_changes: list[LinkChange] = attrs.field(factory=list)
    # How many set-speeds it saw in all: link_changes keeps the first and the newest 199.
    link_changes_total: int = 0
    # Several replicas: those training now (None: all), and who left at which step.
    members: list[int] | None = None
    membership: list[MembershipChange] = attrs.field(factory=list)

    @property
    def train(self) -> TrainingConfig | None:
        return self.training if isinstance(self.training, TrainingConfig) else None

    @property
    def shard_pushes(self) -> list[ShardReceipt]:
        """The newest pushed shard of each stage, by stage."""
        return in_stage_order(self.latest_shard_pushes)


MAX_JOB_PAGE = 10_000  # jobs in one page of GET /jobs
# How GET /jobs orders its jobs: ``queue`` oldest submitted first (the order they run in),
# ``newest`` newest submitted first, ``finished`` only finished jobs, the last to finish first
# (a console's history: a pending job cancelled late is recent, whatever its age).
JOB_ORDERS = ("queue", "newest", "finished")


@attrs.define
class JobList:
    """Jobs in the asked order (a page holds at most MAX_JOB_PAGE); with ``limit``,
    ``next_after`` names the last one when more follow (pass it as ``after`` for the next
    page). ``total`` counts the jobs of the asked states on all pages, so a client showing
    one page can say how many it leaves out."""

    jobs: list[JobInfo]
    next_after: str | None = None
    total: int | None = None


def in_stage_order(pushes: dict[str, ShardReceipt]) -> list[ShardReceipt]:
    """A job's newest shard receipts (keyed by stage index as text), by stage."""
    return [pushes[k] for k in sorted(pushes, key=int)]


def export_complete(shards: list[ShardReceipt], num_stages: int) -> bool:
    """Whether a job's newest shards glue into one model: one per stage, all at one step, of
    one configuration."""
    return (len(shards) == num_stages and len({s.stage for s in shards}) == num_stages
            and len({s.step for s in shards}) == 1
            and len({s.config_fingerprint for s in shards}) == 1)


def link_changes_in_all(changes: list[Any], total: int | None) -> int:
    """How many set-speeds a job saw: its count, or as many as its record holds where that is
    more (a record from before the count was kept)."""
    return max(total or 0, len(changes))


# --- structuring by kind -------------------------------------------------------------------------

_PART_TYPES: dict[str, dict[str, type]] = {
    "train": {"model": ModelConfig, "training": TrainingConfig},
    "smoke": {"model": type(None), "training": SmokeTraining},
}


def _as_is(value: Any, _t: Any) -> Any:
    return value


def register_kind_hooks(cls: type, conv: Any) -> None:
    """Structure ``cls``'s ``model`` and ``training`` by its ``kind``, with errors that name
    the field (``$.model.n_heads``)."""
    base: Callable[[Mapping[str, Any], Any], Any] = make_dict_structure_fn(
        cls, conv, model=override(struct_hook=_as_is), training=override(struct_hook=_as_is))

    def hook(value: Any, _t: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        raw = {k: v for k, v in value.items() if k not in ("model", "training")}
        obj = base(raw, cls)  # kind, topology and the rest checked first
        types = _PART_TYPES.get(obj.kind, {})
        parts: dict[str, Any] = {}
        errors = []
        # Depth first, over both: a body nested past what can be stored is refused as such.
        deep = [p for p in ("model", "training") if not nests_within(value.get(p), MAX_JSON_DEPTH)]
        for part in deep or ("model", "training"):
            given = value.get(part)
            try:
                if part in deep:
                    raise FieldError(f"nests deeper than {MAX_JSON_DEPTH} levels")
                if obj.kind == "smoke" and part == "model":
                    if given not in (None, {}):
                        raise FieldError("a smoke job takes no model")
                    parts[part] = None
                elif given is None or part not in types:
                    parts[part] = None  # the kind's default (or a kind this client lacks)
                else:
                    parts[part] = conv.structure(given, types[part])
            except Exception as exc:
                exc.__notes__ = [*getattr(exc, "__notes__", []),
                                 f"Structuring class {cls.__name__} @ attribute {part}"]
                errors.append(exc)
        if errors:
            raise ClassValidationError(f"While structuring {cls.__name__}", errors, cls)
        return attrs.evolve(obj, **parts)

    conv.register_structure_hook(cls, hook)


for _conv in (converter, lenient_converter):
    register_kind_hooks(JobSubmit, _conv)
    register_kind_hooks(JobInfo, _conv)
    # (a topology without a layout is the JSON it always was: no null layout beside it)
    _conv.register_unstructure_hook(Topology, make_dict_unstructure_fn(
        Topology, _conv, layout=override(omit_if_default=True),
        moves=override(omit_if_default=True), rebalance_every=override(omit_if_default=True)))


def warm_split_mismatch(spec: JobSubmit, source: JobSubmit, source_id: str) -> str | None:
    """What besides the model ties a warm start to its source (the caller has checked the
    models are equal), or None: a learned boundary's halves are trained where the source's
    split put them (by boundary index, so another split would load them at another depth);
    a subspace boundary's frame is rebuilt from the seed, never stored (its weights live in
    the source's subspace); and tied weights split over stages train apart, so they cannot
    warm a job of one stage, which ties them. The leader checks a submitted job by it, and a
    sweep's loader each run against its warm-up."""
    model, train, theirs = spec.model, spec.train, source.train
    assert model is not None and train is not None and theirs is not None
    comp = model.compression_spec
    stages, source_stages = spec.topology.num_stages, source.topology.num_stages
    if comp.learned:
        def split(job: JobSubmit, weights: list[float] | None) -> list[tuple[int, int]]:
            return split_layers(model.n_layers, weights or [1.0] * job.topology.num_stages)

        mine, source_split = split(spec, train.stage_weights), split(source, theirs.stage_weights)
        if mine != source_split:
            return (f"{model.compression} learns its boundaries where {source_id}'s split "
                    f"put them: its layers by stage {source_split}, this job's {mine}")
    if comp.subspace is not None and train.seed != theirs.seed:
        return (f"{model.compression} rebuilds its frame from the seed: {source_id}'s seed "
                f"{theirs.seed}, this job's {train.seed}")
    if model.tie_weights and stages == 1 and source_stages > 1:
        return (f"tie_weights: {source_id}'s {source_stages} stages trained the embedding and "
                "the head apart; a job of one stage ties them")
    return None
