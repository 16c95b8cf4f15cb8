"""What the leader keeps of a job: the job as submitted, where it runs, how far it got.

Stored as one JSON row per job in SQLite (``row``/``from_row``); the row keeps the submitted
job's fields (name, kind, model, training, topology) at its top level, as rows always have.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from swarm_core.contract import (
    JobMetrics,
    JobSubmit,
    LinkChange,
    MembershipChange,
    Placement,
    ProgressRecord,
    RegroupOrder,
    RegroupReport,
    Restart,
    ShardReceipt,
)
from swarm_core.protocol import JobState
from swarm_core.schema import lenient_converter, trusted, unstructure

SPEC_FIELDS = ("name", "kind", "model", "training", "topology")


@attrs.define
class HeldFailure:
    """A FAILED report that blames a neighbour's link, held until the cause shows (see
    Liveness.blamed): the reason to use if none does, the stage it blames, and until when
    (monotonic; a leader restart re-arms the wait, so it is not stored)."""

    reason: str
    stage: int
    until: float = 0.0


@attrs.define
class Recovering:
    """A job that stopped its fellows to resume elsewhere, waiting for them to say they
    stopped or go stale. Stored as its reason; a leader restart starts the wait anew."""

    since: float  # monotonic
    reason: str  # the first report of the loss


@attrs.define
class CellOrder:
    stage: int
    replica: int
    order: RegroupOrder


@attrs.define
class DecidedRegroup:
    """A regroup whose survivors are decided while some stage group has no orders yet (its
    cells were held up behind their chains' regroups and ask at their own next
    synchronisation). Stored, so that a leader restarted in between still gives those groups
    the same orders and records the change, instead of opening a round that the groups
    already ordered, training on under the new membership, never join."""

    epoch: int  # the new membership's
    members: list[int]  # the replicas that go on
    before: list[int]  # the members the round began with
    reason: str = ""  # why the replicas that left are out
    ordered: list[int] = attrs.field(factory=list)  # the stage groups given their orders
    reports: list[RegroupReport] = attrs.field(factory=list)  # the round's reports so far
    orders: list[CellOrder] = attrs.field(factory=list)  # the answers given


@attrs.define
class StoredJoin:
    """Spares told to join as ``replica`` (one a stage) and the order the members were told to
    take it in by. Stored, so that a leader restarted before the group took the joiner in
    knows the join and tells the members again (a MEMBERS signal still queued for them died
    with the old leader, and the joiner would wait for a ring nobody was told to make)."""

    replica: int
    fellow_ids: list[int]
    order: RegroupOrder


@attrs.define(eq=False)
class JobRecord:
    job_id: str
    seq: int
    spec: JobSubmit
    state: JobState
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    last_step: int = 0
    last_loss: float | None = None
    placement: Placement | None = None
    done_stages: list[int] = attrs.field(factory=list)
    reason: str = ""
    metrics: JobMetrics = attrs.field(factory=JobMetrics)
    latest_shard_pushes: dict[str, ShardReceipt] = attrs.field(factory=dict)
    attempt: int = 0
    restarts: list[Restart] = attrs.field(factory=list)
    # Link limits set live on its fellows while it ran: the run's network, as it really was.
    link_changes: list[LinkChange] = attrs.field(factory=list)
    link_changes_total: int = 0  # all of them, also those the capped list let go
    # What the current attempt's STARTs are made of besides the job and its placement, so a
    # leader that restarted can send a START again that its fellow never took.
    data_key: str = attrs.field(default="", repr=False)
    resume_step: int = 0
    held: HeldFailure | None = None
    recovering: Recovering | None = None
    # A job of several replicas: those training now (None: all of them), how many regroups
    # this attempt has had, and who left or joined at which step.
    members: list[int] | None = None
    epoch: int = 0
    # Of a job whose peers move: the moves its membership records from before this attempt
    # (a new attempt's cells count their moves from 0: leader/moves.py)
    moves_base: int = 0
    membership: list[MembershipChange] = attrs.field(factory=list)
    regroup: DecidedRegroup | None = None  # a decided regroup, not yet every group's
    joining: StoredJoin | None = None  # spares joining, not yet taken in
    # Leader-local, not stored: when this leader process began watching the run (restart
    # grace), when a fellow last said it runs the attempt, and the steps being assembled from
    # the stages' reports.
    watched_since: float | None = None
    active_at: float | None = None
    current: dict[int, ProgressRecord] = attrs.field(factory=dict)
    spec_row: dict[str, Any] | None = attrs.field(default=None, repr=False)

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def resume_policy(self) -> str:
        """What a lost stage leads to: "fail", or "replace" (recover on a spare fellow)."""
        train = self.spec.train
        return train.resume_policy if train is not None else "fail"

    @property
    def fellows(self) -> list[int]:
        """The fellow of each stage once placed (a fellow with several slots repeats)."""
        return self.placement.fellows if self.placement is not None else []

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages if self.placement is not None \
            else self.spec.topology.num_stages

    def stages_done_by(self, fellow_id: int) -> bool:
        """Whether every stage this fellow holds has completed."""
        return all(s in self.done_stages for s, f in enumerate(self.fellows) if f == fellow_id)

    def row(self) -> dict[str, Any]:
        if self.spec_row is None:  # (the job as submitted never changes: written once)
            self.spec_row = {k: v for k, v in unstructure(self.spec).items()
                             if k in SPEC_FIELDS}
            if self.spec_row.get("model") is None:
                self.spec_row["model"] = {}  # as a smoke job's always read (older leaders too)
        out = dict(self.spec_row)
        for f in attrs.fields(JobRecord):
            if f.name in _STORED:
                out[f.name] = unstructure(getattr(self, f.name))
        held = self.held
        out["held_reason"], out["held_stage"] = (held.reason, held.stage) if held else ("", None)
        out["recovering_reason"] = self.recovering.reason if self.recovering else ""
        return out

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> JobRecord:
        """A stored row back as a record. Rows were checked when they came in, so their
        validators do not run again: a rule added since must not stop a leader loading its
        history (such rules go to ``job_shape_error``, which runs at submit only)."""
        with trusted():
            spec = lenient_converter.structure(
                {k: row[k] for k in SPEC_FIELDS if k in row}, JobSubmit)
            fields = {name: lenient_converter.structure(row[name], _TYPES[name])
                      for name in _STORED if name in row}
        held = HeldFailure(row["held_reason"], row["held_stage"]) \
            if row.get("held_reason") and row.get("held_stage") is not None else None
        recovering = Recovering(time.monotonic(), row["recovering_reason"]) \
            if row.get("recovering_reason") else None
        return cls(spec=spec, held=held, recovering=recovering, **fields)

    def restore(self, row: dict[str, Any]) -> None:
        """Put back the stored fields of ``row``, this job's own from before a change the
        store refused (see ``leader/undo.py``)."""
        was = JobRecord.from_row(row)
        for name in _STORED:
            setattr(self, name, getattr(was, name))


# Stored otherwise (spec, held) or not at all (what one leader process keeps in memory).
_NOT_AS_IS = ("spec", "held", "recovering", "watched_since", "active_at", "current",
             "spec_row")
_STORED = tuple(f.name for f in attrs.fields(JobRecord) if f.name not in _NOT_AS_IS)
# Every JobRecord attribute is annotated, so resolve_types leaves none untyped.
_TYPES: dict[str, type[Any]] = {f.name: f.type
                                for f in attrs.fields(attrs.resolve_types(JobRecord))
                                if f.type is not None}
