"""What comes back from a running job: a stage's figures, the job's, one record per step.

Every metric name exists here and nowhere else; fellows fill these classes, the leader merges
them, the CLI, the console and the run artifacts read them. On the wire a figure a stage did
not have is absent, not null (``sparse``), so the JSON reads as it always did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import attrs

from swarm_core.contract.membership import MembershipChange
from swarm_core.contract.rebalance import PeerMove
from swarm_core.protocol import MAX_PEER_LINKS, PeerLinkState
from swarm_core.schema import (
    FieldError,
    converter,
    lenient_converter,
    make_dict_unstructure_fn,
    override,
    sparse,
)
from swarm_core.validators import MAX_BYTES as MAX_BYTES
from swarm_core.validators import (
    MAX_STEPS,
    bounded,
    max_items,
    meta,
    non_negative,
    step_number,
    text_field,
)

ReportedJobState = Literal["RUNNING", "COMPLETED", "FAILED"]


def _codecs_by_peer(_inst: Any, attr: attrs.Attribute, value: dict[str, str] | None) -> None:
    if value is None:
        return
    if len(value) > MAX_PEER_LINKS:
        raise FieldError(f"must list at most {MAX_PEER_LINKS} peers, got {len(value)}",
                         attr.name)
    for peer, codec in value.items():
        text_field(16)(_inst, attr, peer)
        text_field(32)(_inst, attr, codec)


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(50) so a diverged run reads as huge rather than overflowing."""
    return math.exp(min(loss, 50.0))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@sparse
@attrs.define
class CodecErrors:
    """Relative L2 error the wire codec put on what a stage sent: activations downstream,
    gradients upstream, as the receiver decodes the frame (a stochastically rounded one
    included); 0 on an fp32 wire; absent for a direction the stage does not send."""

    act: float | None = None
    grad: float | None = None

    def finite(self) -> CodecErrors | None:
        """The finite figures only (a diverged step's NaN is no codec error), or None."""
        kept = CodecErrors(_finite(self.act), _finite(self.grad))
        return None if kept.act is None and kept.grad is None else kept


def _count(doc: str = "") -> Any:
    return attrs.field(default=None, validator=bounded(0, MAX_BYTES), metadata=meta(doc))


def _amount(doc: str = "") -> Any:
    # (>= 0; NaN passes: a diverged step's figure is reported, and written as null)
    return attrs.field(default=None, validator=non_negative, metadata=meta(doc))


@sparse
@attrs.define
class StageMetrics:
    """Figures one stage reports: after a step, after an evaluation, and for the whole run when
    it completes. The leader keeps the newest of each per stage (``JobMetrics.stages``)."""

    # one step
    wire_tx_bytes: int | None = _count("what this stage's links sent in the step")
    step_seconds: float | None = _amount()
    lr: float | None = _amount()
    activation_peak_bytes: int | None = _count(
        "peak bytes held for backward (the run's largest, once COMPLETED)")
    wait_seconds: float | None = _amount("of step_seconds, the time blocked on its links")
    codec_error: CodecErrors | None = None
    # what the stage's group synchronisation sent in the step, and the time it took (replicas)
    sync_tx_bytes: int | None = _count()
    sync_seconds: float | None = _amount()
    # Emulated, not measured: the compute slowdown the stage's fellow was told to pad to
    # (swarm_core.pipeline.pace); the step's factor, and the run's largest once COMPLETED.
    slowdown: float | None = _amount("emulated compute slowdown in force (absent: none)")
    # Swarm wiring: the micro-batches the step's route gave this cell (the run's mean once
    # COMPLETED); absent under chain wiring, where every cell runs its replica's M.
    micro_batches: float | None = _amount("swarm wiring: micro-batches routed to this cell")
    # an evaluation
    eval_loss: float | None = None
    perplexity: float | None = _amount()
    # the whole run (COMPLETED)
    steps: int | None = attrs.field(default=None, validator=step_number, metadata=meta(""))
    wall_s: float | None = _amount()
    tokens_per_s: float | None = _amount()
    wire_tx_bytes_per_step: float | None = _amount()
    expected_wire_tx_bytes_per_step: int | None = _count()
    sync_tx_bytes_per_step: float | None = _amount()
    expected_sync_tx_bytes_per_step: float | None = _amount()
    wait_fraction: float | None = _amount()
    sync_fraction: float | None = _amount("of wall_s, the share its group's synchronisation took")
    final_loss: float | None = None
    best_loss: float | None = None
    shard_dir: str | None = attrs.field(default=None, validator=text_field(4096))
    # Per peer, the links a link matrix shaped: settings, bytes and achieved rates (COMPLETED).
    peer_links: list[PeerLinkState] | None = attrs.field(
        default=None, validator=attrs.validators.optional(max_items(MAX_PEER_LINKS)),
        metadata=meta(""))
    # Selective compression (training.compress_when): the format this cell sends each peer cell
    # in, by the peer's "stage.replica" (its boundaries' frames, its ring's sync; COMPLETED).
    link_codecs: dict[str, str] | None = attrs.field(
        default=None, validator=_codecs_by_peer,
        metadata=meta("compress_when: the format sent to each peer cell"))
    # added by the leader: who reported it, and the step of the cell's newest report
    fellow_id: int | None = _amount()
    step: int | None = attrs.field(default=None, validator=step_number, metadata=meta(""))

    def merged(self, newer: StageMetrics) -> StageMetrics:
        """These figures with ``newer``'s where it has them."""
        return attrs.evolve(self, **{k: v for k, v in attrs.asdict(newer, recurse=False).items()
                                     if v is not None})

    @property
    def wait_share(self) -> float | None:
        """The share of the step it sat blocked on its links, in [0, 1]: the run's once it
        completed, else the last step's; None without the figures."""
        if self.wait_fraction is not None:
            return self.wait_fraction
        return step_wait_share(self.wait_seconds, self.step_seconds)

    @property
    def sync_share(self) -> float | None:
        """The share of the step its stage group's synchronisation took, in [0, 1]: the
        run's once it completed, else the last step's; None without replicas."""
        if self.sync_fraction is not None:
            return self.sync_fraction
        return step_wait_share(self.sync_seconds, self.step_seconds)

    @property
    def sync_bytes(self) -> float | None:
        """What its group's synchronisation sent a step: the run's mean once it completed,
        else the last step's; None without replicas."""
        if self.sync_tx_bytes_per_step is not None:
            return self.sync_tx_bytes_per_step
        return self.sync_tx_bytes


def step_wait_share(wait: float | None, span: float | None) -> float | None:
    """``wait`` seconds blocked on the links of a step of ``span`` seconds, as a share in
    [0, 1]; None without both."""
    if wait is None or span is None or span <= 0:
        return None
    return min(1.0, max(0.0, wait / span))


@sparse
@attrs.define
class JobMetrics:
    """A job's figures: each stage's newest (by stage index, as text: a JSON object), the last
    stage's loss figures, and the bytes every stage put on the wire per step once all
    completed."""

    stages: dict[str, StageMetrics] | None = None
    eval_loss: float | None = None
    perplexity: float | None = None
    final_loss: float | None = None
    best_loss: float | None = None
    tokens_per_s: float | None = None
    wall_s: float | None = None
    wire_bytes_per_step: float | None = None
    sync_bytes_per_step: float | None = None  # replicas: every stage group's, together

    def stage(self, cell: int | str) -> StageMetrics:
        """A cell's figures, by its label (``Placement.label``: the stage, for one
        replica)."""
        return (self.stages or {}).get(str(cell)) or StageMetrics()


_JOB = attrs.fields(JobMetrics)
# The last stage holds the loss: these of its figures are the job's.
JOB_LEVEL = tuple(f.name for f in (_JOB.eval_loss, _JOB.perplexity, _JOB.final_loss,
                                   _JOB.best_loss, _JOB.tokens_per_s, _JOB.wall_s))
# How the last stages of several replicas make one job-level figure (their mean where not
# named): their throughputs add up, the run lasts as long as its slowest, and the first
# replica evaluates for the group.
REPLICA_COMBINE: dict[str, Literal["sum", "max", "first"]] = {
    _JOB.tokens_per_s.name: "sum", _JOB.wall_s.name: "max",
    _JOB.eval_loss.name: "first", _JOB.perplexity.name: "first"}


@sparse
@attrs.define
class ProgressRecord:
    """One training step of a job, assembled from every stage's report: the last stage's loss,
    tokens/s, step time and learning rate; every stage's wire bytes; per stage (keyed by its
    index as text) its activation peak, link wait, own step time and codec error; eval loss
    and perplexity when evaluated."""

    step: int
    wire_bytes: int = 0
    # Cells that reported the step: stage indices for a job of one replica, else indices into
    # the placement's cells.
    stages_reported: list[int] = attrs.field(factory=list)
    loss: float | None = None
    # A job of several replicas: the bytes their stage groups' synchronisation sent, and each
    # replica's loss by replica (as text), whose mean is the step's loss.
    sync_bytes: int | None = None
    replica_losses: dict[str, float] | None = None
    tokens_per_s: float | None = None
    step_seconds: float | None = None
    lr: float | None = None
    activation_peak_bytes: dict[str, int] | None = None
    wait_seconds: dict[str, float] | None = None
    stage_seconds: dict[str, float] | None = None
    codec_error: dict[str, CodecErrors] | None = None
    eval_loss: float | None = None
    perplexity: float | None = None
    ts: float | None = None
    # Replicas that left (or joined) from this step on (see contract/membership.py).
    membership: list[MembershipChange] | None = None
    # Emulated, not measured: the compute slowdown each cell was padded to in the step
    # (swarm_core.pipeline.pace), by its label; None where none was.
    slowdown: dict[str, float] | None = None
    # Swarm wiring: the micro-batches each cell's route gave it in the step, by cell; and by
    # replica those its last stage's cell ran, which weigh its loss in the step's.
    micro_batches: dict[str, float] | None = None
    replica_micro_batches: dict[str, float] | None = None

    def add_stage(self, stage: int, figures: StageMetrics, cell: int | None = None,
                  key: str | None = None) -> bool:
        """Join one cell's step report (``cell``: its index among the placement's cells,
        ``key``: its label; the stage's, for a job of one replica); False if that cell was
        already joined."""
        cell = stage if cell is None else cell
        if cell in self.stages_reported:
            return False
        self.stages_reported.append(cell)
        self.wire_bytes += figures.wire_tx_bytes or 0
        if figures.sync_tx_bytes is not None:
            self.sync_bytes = (self.sync_bytes or 0) + figures.sync_tx_bytes
        key = str(stage) if key is None else key
        if figures.activation_peak_bytes is not None:
            # Per stage, since the schedule gives each stage its own share.
            self.activation_peak_bytes = {**(self.activation_peak_bytes or {}),
                                          key: figures.activation_peak_bytes}
        # Each stage's own step time beside its wait: a stage's first step also waits for its
        # neighbours to start, so the last stage's step_seconds is no denominator.
        if (wait := _finite(figures.wait_seconds)) is not None:
            self.wait_seconds = {**(self.wait_seconds or {}), key: wait}
        if (spent := _finite(figures.step_seconds)) is not None:
            self.stage_seconds = {**(self.stage_seconds or {}), key: spent}
        errors = figures.codec_error.finite() if figures.codec_error else None
        if errors is not None:
            self.codec_error = {**(self.codec_error or {}), key: errors}
        if figures.slowdown is not None:
            self.slowdown = {**(self.slowdown or {}), key: figures.slowdown}
        if figures.micro_batches is not None:
            self.micro_batches = {**(self.micro_batches or {}), key: figures.micro_batches}
        return True

    def add_replica_loss(self, replica: int, loss: float,
                         micro_batches: float | None = None) -> None:
        """One replica's loss of the step: the mean over the micro-batches its last stage ran
        (``micro_batches`` of them under swarm wiring; a chain's equal share otherwise)."""
        self.replica_losses = {**(self.replica_losses or {}), str(replica): loss}
        if micro_batches is not None:
            self.replica_micro_batches = {**(self.replica_micro_batches or {}),
                                          str(replica): micro_batches}
        self.loss = step_loss(self.replica_losses, self.replica_micro_batches)

    def add_eval(self, loss: float | None) -> None:
        self.eval_loss = loss
        if loss is not None:
            self.perplexity = perplexity(loss)


K = TypeVar("K")


def step_loss(losses: Mapping[K, float], micro_batches: Mapping[K, float] | None = None
              ) -> float:
    """A step's loss from its replicas' (each the mean over the micro-batches its last stage
    ran): their mean, weighted by those micro-batches where given (swarm wiring deals a step's
    micro-batches unevenly; chains run equal shares). Where a replica's report is missing
    the figure is the mean over the micro-batches reported, not a share counted as the whole."""
    if micro_batches and all(k in micro_batches for k in losses):
        total = sum(micro_batches[k] for k in losses)
        if total > 0:
            return sum(v * micro_batches[k] for k, v in losses.items()) / total
    return sum(losses.values()) / len(losses)


_RECORD = attrs.fields(ProgressRecord)


class MetricName:
    """Each figure of a step's record by the name its JSON gives it: a ``train_progress.ndjson``
    line, the leader's stored records, the trackers' keys. Read off ProgressRecord's fields, so
    the class stays their one spelling: a renamed field fails here at import (and in mypy), not
    in a reader that silently finds nothing."""

    STEP = _RECORD.step.name
    WIRE_BYTES = _RECORD.wire_bytes.name
    STAGES_REPORTED = _RECORD.stages_reported.name
    LOSS = _RECORD.loss.name
    SYNC_BYTES = _RECORD.sync_bytes.name
    REPLICA_LOSSES = _RECORD.replica_losses.name
    TOKENS_PER_S = _RECORD.tokens_per_s.name
    STEP_SECONDS = _RECORD.step_seconds.name
    LR = _RECORD.lr.name
    ACTIVATION_PEAK_BYTES = _RECORD.activation_peak_bytes.name
    WAIT_SECONDS = _RECORD.wait_seconds.name
    STAGE_SECONDS = _RECORD.stage_seconds.name
    CODEC_ERROR = _RECORD.codec_error.name
    EVAL_LOSS = _RECORD.eval_loss.name
    PERPLEXITY = _RECORD.perplexity.name
    TS = _RECORD.ts.name
    MEMBERSHIP = _RECORD.membership.name
    SLOWDOWN = _RECORD.slowdown.name
    MICRO_BATCHES = _RECORD.micro_batches.name
    REPLICA_MICRO_BATCHES = _RECORD.replica_micro_batches.name


@attrs.define
class ProgressList:
    """One record per training step (see ProgressRecord)."""

    records: list[ProgressRecord]


@attrs.define
class JobStatusUpdate:
    """A fellow reports on the job it runs."""

    fellow_id: int = attrs.field(validator=non_negative, metadata=meta("", minimum=0))
    state: ReportedJobState
    step: int = attrs.field(default=0, validator=step_number, metadata=meta(
        "the step the cell reached (1-based)", minimum=0, maximum=MAX_STEPS))
    loss: float | None = None
    tokens_per_s: float | None = attrs.field(default=None, validator=non_negative)
    message: str = attrs.field(default="", metadata=meta("", maxLength=4096))
    attempt: int = attrs.field(default=0, validator=non_negative,
                               metadata=meta("the START's attempt; stale reports are ignored",
                                              minimum=0))
    stage: int | None = attrs.field(default=None, validator=non_negative,
                                    metadata=meta("the reporting stage (a fellow may hold "
                                                   "several)", minimum=0))
    replica: int = attrs.field(default=0, validator=non_negative,
                               metadata=meta("the reporting stage's replica", minimum=0))
    metrics: StageMetrics = attrs.field(
        factory=StageMetrics,
        metadata=meta("the stage's figures: of the step, of an evaluation, of the run"))
    blames_stage: int | None = attrs.field(
        default=None, validator=non_negative,
        metadata=meta("on a FAILED report caused by the link to a neighbouring stage (it "
                       "closed, broke or went quiet): that stage. Under resume_policy fail the "
                       "leader then waits up to the stale timeout plus one heartbeat interval "
                       "for a report or a fellow state that names the cause", minimum=0))
    epoch: int | None = attrs.field(
        default=None, validator=non_negative,
        metadata=meta("on a COMPLETED report of a job of replicas: the membership its stage "
                      "group finished under (0 before any change). A spare told to join "
                      "under a later one was never taken in. On a step report of a "
                      "swarm-wired job: the membership the step was trained under (one "
                      "trained again after a change replaces it)", minimum=0))
    moved: PeerMove | None = attrs.field(default=None, metadata=meta(
        "on a step report of a swarm job whose peers move between stages: the latest move "
        "made (before 0-based step ``at``, cell ``cell`` of stage ``source`` became cell "
        "``new_id`` of stage ``target``); ``epoch`` counts the moves"))

    @message.validator
    def _msg(self, _attr: attrs.Attribute, value: str) -> None:
        if len(value) > 4096:
            raise FieldError("must be at most 4096 characters", "message")

    _msg.json_schema = {"maxLength": 4096}  # type: ignore[attr-defined]


# Reports a fellow sends at once: a stage training faster than one HTTP report a step gets
# behind by a batch at most this long (the leader stores a batch in one transaction).
MAX_REPORTS_AT_ONCE = 256


def _running_reports(_inst: object, attr: attrs.Attribute, value: list[JobStatusUpdate]
                     ) -> None:
    if not value:
        raise FieldError("must hold at least one report", attr.name)
    for i, upd in enumerate(value):
        if upd.state != "RUNNING":
            raise FieldError("must be RUNNING: a cell's end is reported on its own",
                             f"{attr.name}[{i}].state")
        if upd.fellow_id != value[0].fellow_id:
            raise FieldError("must be the same fellow's as the first report's",
                             f"{attr.name}[{i}].fellow_id")


_running_reports.json_schema = {"minItems": 1}  # type: ignore[attr-defined]


@attrs.define
class JobStatusBatch:
    """A fellow's step reports of one job, several at once and in order: RUNNING ones, as
    ``/status`` takes them one by one (a cell's end, COMPLETED or FAILED, goes alone)."""

    updates: list[JobStatusUpdate] = attrs.field(
        validator=[max_items(MAX_REPORTS_AT_ONCE), _running_reports])


for _conv in (converter, lenient_converter):
    # (a report of a job whose peers never move is the JSON it always was: a leader before
    # moves refuses a field it does not know)
    _conv.register_unstructure_hook(JobStatusUpdate, make_dict_unstructure_fn(
        JobStatusUpdate, _conv, moved=override(omit_if_default=True)))
