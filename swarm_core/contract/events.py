"""What the leader's event stream carries: one attrs class per kind of event.

The leader publishes these objects; the ``/api/v1/events`` route alone turns them into JSON
(:func:`event_json`), one object a frame: ``{"seq", "ts", "type", "data"}``. Its readers (the
console, ``swarm watch``, scripts through ``SwarmClient.event_stream``) read a frame back once
(:func:`read_event`) and from there on read attributes.

A consumer may be older or newer than its leader. An event of a kind it does not know reads as
:class:`Unknown` (its ``seq`` still counts, so a consumer sees no gap); every field but the one
naming the event's subject has a default, so an event from a leader that lacked a field reads
too. Unknown keys are ignored for the same reason.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import attrs

from swarm_core.contract.job import ShardReceipt
from swarm_core.contract.membership import MembershipChange
from swarm_core.contract.metrics import StageMetrics
from swarm_core.protocol import ByteCounters, LinkLimits
from swarm_core.schema import SchemaError, structure, unstructure

FellowUpdateType = Literal["fellow.registered", "fellow.heartbeat", "fellow.status"]
JobUpdateType = Literal["job.submitted", "job.started", "job.updated", "job.recovering",
                        "job.resumed", "job.completed", "job.failed", "job.cancelled"]


@attrs.frozen
class Hello:
    """The first frame of a stream: subscribed, numbering from ``seq`` on."""

    type: ClassVar[str] = "hello"


@attrs.frozen
class FellowUpdate:
    """A fellow registered, heartbeat, or had its status changed by the leader (stale,
    offline): what the leader now knows of it."""

    type: FellowUpdateType = attrs.field(
        validator=attrs.validators.in_(typing.get_args(FellowUpdateType)))
    fellow_id: int
    name: str = ""
    status: str = ""  # a FellowStatus value (kept a string: a newer leader may add one)
    job_id: str | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float = 0.0
    link: LinkLimits | None = None
    counters: ByteCounters | None = None


@attrs.frozen
class SpeedSet:
    """A set-speed sent to a fellow; ``job_id`` is the running job that records it."""

    type: ClassVar[str] = "fellow.set_speed"
    _flat: ClassVar[str] = "link"  # (on the wire its fields sit beside the others)
    fellow_id: int
    job_id: str | None = None
    link: LinkLimits = attrs.field(factory=LinkLimits)
    # An emulated compute slowdown it set (None: left as it was), and True where it left the
    # link as it was (then ``link`` is only the default, not the fellow's link). Both absent
    # from the wire when None: a set-speed of the link alone is the frame it always was.
    _omit_none: ClassVar[tuple[str, ...]] = ("slowdown", "link_kept", "to_fellow")
    slowdown: float | None = None
    link_kept: bool | None = None
    to_fellow: int | None = None  # a per-pair set-speed: the links to this fellow only


@attrs.frozen
class FellowReleased:
    """A release sent to a fellow."""

    type: ClassVar[str] = "fellow.release"
    fellow_id: int
    name: str = ""


@attrs.frozen
class JobUpdate:
    """A job was submitted, started, changed, recovered or finished: its record in short."""

    type: JobUpdateType = attrs.field(
        validator=attrs.validators.in_(typing.get_args(JobUpdateType)))
    job_id: str
    name: str = ""
    kind: str = ""
    state: str = ""  # a JobState value
    last_step: int = 0
    last_loss: float | None = None
    fellows: list[int] = attrs.field(factory=list)
    reason: str = ""


@attrs.frozen
class JobMembership:
    """Replicas left or joined a job: the change as its record keeps it."""

    type: ClassVar[str] = "job.membership"
    _flat: ClassVar[str] = "change"
    job_id: str
    change: MembershipChange


@attrs.frozen
class JobShard:
    """A stage's shard reached the leader."""

    type: ClassVar[str] = "job.shard"
    _flat: ClassVar[str] = "receipt"
    job_id: str
    receipt: ShardReceipt


@attrs.frozen
class MetricReport:
    """A stage's report on its job, as the leader took it. ``replica`` only for a job of
    several replicas, ``epoch`` only where the report names the membership it trained under
    (a swarm-wired job's step reports: a step trained again after a change carries a later
    one, and replaces the step's earlier reports; a COMPLETED report of a job of replicas:
    the membership it finished under); absent on the wire otherwise."""

    type: ClassVar[str] = "metric"
    _omit_none: ClassVar[tuple[str, ...]] = ("replica", "epoch")
    job_id: str | None = None
    fellow_id: int | None = None
    stage: int | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    state: str = ""  # RUNNING, COMPLETED or FAILED
    metrics: StageMetrics = attrs.field(factory=StageMetrics)
    replica: int | None = None
    epoch: int | None = None


@attrs.frozen
class Unknown:
    """An event this side cannot read: of a kind it does not know (a newer leader's), or
    (``problem`` says why) one whose data does not read. Consumers skip it; only the leader
    ever publishes the others."""

    type: str
    problem: str = ""


EventData = (Hello | FellowUpdate | SpeedSet | FellowReleased | JobUpdate | JobMembership
             | JobShard | MetricReport | Unknown)

_KNOWN: tuple[type[Any], ...] = (Hello, FellowUpdate, SpeedSet, FellowReleased, JobUpdate,
                                 JobMembership, JobShard, MetricReport)


def _types(cls: type[Any]) -> tuple[str, ...]:
    field = attrs.fields_dict(cls).get("type")
    if field is None:
        return (cls.type,)
    hint = typing.get_type_hints(cls)["type"]
    return typing.get_args(hint)


# Every ``type`` string the leader publishes, to the class that carries it.
EVENT_CLASSES: dict[str, type[Any]] = {t: cls for cls in _KNOWN for t in _types(cls)}


@attrs.frozen
class Event:
    """One frame of the stream: the event and where it stands in it (``seq``, the leader's
    ``ts``; absent where a frame lacked them)."""

    data: EventData
    seq: int | None = None
    ts: float | None = None

    @property
    def type(self) -> str:
        return self.data.type


def event_data(data: EventData) -> dict[str, Any]:
    """The ``data`` object of an event's frame."""
    out: dict[str, Any] = unstructure(data)
    out.pop("type", None)  # (the frame's own "type" says it)
    flat = getattr(data, "_flat", None)
    if flat is not None:
        out.update(out.pop(flat))
    for key in getattr(data, "_omit_none", ()):
        if out.get(key) is None:
            out.pop(key, None)
    return out


def event_json(ev: Event) -> dict[str, Any]:
    """An event's frame, as the WebSocket (and ``GET /events``) sends it."""
    return {"seq": ev.seq, "ts": ev.ts, "type": ev.type, "data": event_data(ev.data)}


def _structure_data(cls: type[Any], kind: str, data: Mapping[str, Any]) -> EventData:
    raw = dict(data)
    flat = getattr(cls, "_flat", None)
    if flat is not None:
        own = {a.name for a in attrs.fields(cls)} - {flat}
        raw = {**{k: v for k, v in raw.items() if k in own},
               flat: {k: v for k, v in raw.items() if k not in own}}
    if "type" in attrs.fields_dict(cls):
        raw["type"] = kind
    try:
        made: EventData = structure(raw, cls, "$.data", trust=True)
    except SchemaError as exc:
        nested = f"$.data.{flat}"
        if flat is not None and exc.field is not None and (
                exc.field == nested or exc.field.startswith(nested + ".")):
            # (named by its key on the wire, where the nested part's fields sit in data)
            raise SchemaError(exc.message, "$.data" + exc.field[len(nested):]) from None
        raise
    return made


def read_event(frame: Mapping[str, Any]) -> Event:
    """A frame as its classes, once. Never raises: what does not read is :class:`Unknown`."""
    seq, ts = frame.get("seq"), frame.get("ts")
    seq = seq if isinstance(seq, int) and not isinstance(seq, bool) else None
    ts = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None
    kind = frame.get("type")
    cls = EVENT_CLASSES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return Event(Unknown(str(kind)), seq, ts)
    data = frame.get("data")
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        return Event(Unknown(str(kind), "$.data: expected an object"), seq, ts)
    try:
        return Event(_structure_data(cls, str(kind), data), seq, ts)
    except SchemaError as exc:
        return Event(Unknown(str(kind), str(exc)), seq, ts)
