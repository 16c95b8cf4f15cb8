"""Bodies of the leader's HTTP API (``/api/v1``), shared by the leader and :mod:`swarm_core.client`.

Field names here are public interface: scripts read them from ``--format json`` output.
"""

from __future__ import annotations

import enum
import ipaddress
import math
import re
from typing import Any, Literal

import attrs

from swarm_core.schema import FieldError

API_PREFIX = "/api/v1"

SignalKind = Literal["START", "STOP", "RELEASE", "SET_SPEED"]
# What a fellow says about itself; the leader adds "stale" and "offline" (see FellowInfo.status).
ReportedStatus = Literal["ready", "busy", "released", "leaving"]
JobKind = Literal["smoke", "train"]
ReportedJobState = Literal["RUNNING", "COMPLETED", "FAILED"]

MAX_NAME = 128


class JobState(enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


# Validators carry the JSON Schema they enforce (``json_schema``), so the OpenAPI document
# states exactly what the leader accepts.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
DEVICE_SLOT = re.compile(r"cpu|cuda:[0-9]+")


def _name(_inst: Any, attr: attrs.Attribute, value: str) -> None:
    if not value or len(value) > MAX_NAME or _CONTROL.search(value):
        raise FieldError(f"must be 1-{MAX_NAME} characters without control characters",
                         attr.name)


_name.json_schema = {  # type: ignore[attr-defined]
    "minLength": 1, "maxLength": MAX_NAME, "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f]+$"}


def _non_negative(_inst: Any, attr: attrs.Attribute, value: float | int | None) -> None:
    if value is not None and value < 0:
        raise FieldError(f"must be >= 0, got {value}", attr.name)


_non_negative.json_schema = {"minimum": 0}  # type: ignore[attr-defined]


# A link rate: 1 kbit/s (below, one 64 KiB frame outlasts any sensible timeout) to 1 Tbit/s
# (above, no token bucket on a CPU would notice; 1e308 read back as unlimited).
RATE_MBPS = (0.001, 1_000_000.0)


def rate_or_none(_inst: Any, attr: attrs.Attribute, value: float | None) -> None:
    """attrs validator of a link rate in Mbit/s (None: unlimited)."""
    if value is not None and not RATE_MBPS[0] <= value <= RATE_MBPS[1]:
        raise FieldError(f"must be {RATE_MBPS[0]:g}-{RATE_MBPS[1]:g} Mbit/s (or null for "
                         f"unlimited), got {value}", attr.name)


rate_or_none.json_schema = {  # type: ignore[attr-defined]
    "minimum": RATE_MBPS[0], "maximum": RATE_MBPS[1]}


def _bounded(lo: float, hi: float):
    def check(_inst: Any, attr: attrs.Attribute, value: float | int | None) -> None:
        if value is not None and not lo <= value <= hi:
            raise FieldError(f"must be between {lo:g} and {hi:g}, got {value}", attr.name)

    check.json_schema = {"minimum": lo, "maximum": hi}  # type: ignore[attr-defined]
    return check


MAX_JSON_DEPTH = 64  # orjson writes at most 255 levels; stored jobs and signals nest a few more


def _nests_within(value: Any, depth: int) -> bool:
    if isinstance(value, dict):
        return depth > 0 and all(_nests_within(v, depth - 1) for v in value.values())
    if isinstance(value, list):
        return depth > 0 and all(_nests_within(v, depth - 1) for v in value)
    return True


def _shallow(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not _nests_within(value, MAX_JSON_DEPTH):
        raise FieldError(f"nests deeper than {MAX_JSON_DEPTH} levels", attr.name)


def _meta(doc: str, **kw: Any) -> dict[str, Any]:
    return {"doc": doc, **kw}


@attrs.define
class LinkLimits:
    """Link shaping of one fellow's data plane. null means unlimited."""

    tx_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none, metadata=_meta("send limit, Mbit/s")
    )
    rx_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none, metadata=_meta("receive limit, Mbit/s")
    )
    latency_ms: float = attrs.field(
        default=0.0,
        validator=_bounded(0, 60_000),
        metadata=_meta("added one-way latency, ms", minimum=0, maximum=60000),
    )


@attrs.define
class ByteCounters:
    """Cumulative bytes since the fellow process started."""

    control_tx: int = attrs.field(default=0, validator=_non_negative, metadata=_meta("", minimum=0))
    control_rx: int = attrs.field(default=0, validator=_non_negative, metadata=_meta("", minimum=0))
    data_tx: int = attrs.field(default=0, validator=_non_negative, metadata=_meta("", minimum=0))
    data_rx: int = attrs.field(default=0, validator=_non_negative, metadata=_meta("", minimum=0))


# --- fellows -------------------------------------------------------------------------------------


WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})


def is_bind_all(host: str) -> bool:
    """Whether ``host`` means every address of a machine (``0.0.0.0``, ``::``, ``0``, ...)."""
    if host in WILDCARD_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_unspecified
    except ValueError:
        # "0" and the like, which the resolver reads as 0.0.0.0
        return host.isascii() and host.isdigit() and int(host) == 0


def split_host_port(addr: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` too) as (host, port), or None if it is not one."""
    host, sep, port = addr.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or len(port) > 5 \
            or not 0 < int(port) < 65536 or _CONTROL.search(host):
        return None
    return host, int(port)


def _check_dialable(addr: str, field: str) -> None:
    # A neighbour dials what is registered here: a bind-all address would have it dial itself.
    hp = split_host_port(addr)
    if hp is None:
        raise FieldError(f"{addr!r} is not host:port", field)
    if is_bind_all(hp[0]):
        raise FieldError(f"{addr!r} is a bind-all address that neighbours cannot dial; "
                         "register the address they reach this fellow at", field)


@attrs.define
class RegisterRequest:
    """A fellow introduces itself. The same ``name`` gets the same fellow_id back."""

    name: str = attrs.field(validator=_name, metadata=_meta("unique per cluster", maxLength=128))
    instance_id: str = attrs.field(
        validator=_name, metadata=_meta("random per fellow process", maxLength=128)
    )
    host: str = attrs.field(default="", metadata=_meta("hostname", maxLength=255))
    pid: int = attrs.field(default=0, validator=_non_negative, metadata=_meta("", minimum=0))
    devices: list[str] = attrs.field(factory=lambda: ["cpu"], metadata=_meta("device slots"))
    threads: int = attrs.field(
        default=1, validator=_bounded(1, 1024), metadata=_meta("", minimum=1, maximum=1024)
    )
    data_addr: str | None = attrs.field(default=None, metadata=_meta("host:port of data plane"))
    data_addrs: list[str] = attrs.field(
        factory=list, metadata=_meta("host:port per device slot (data_addr is slot 0's)"))
    version: str = ""

    @data_addrs.validator
    def _addrs(self, _attr: attrs.Attribute, value: list[str]) -> None:
        if len(value) > 64 or any(not a or len(a) > 255 or _CONTROL.search(a) for a in value):
            raise FieldError("must list at most 64 host:port addresses", "data_addrs")
        for i, a in enumerate(value):
            _check_dialable(a, f"data_addrs[{i}]")

    @data_addr.validator
    def _addr(self, _attr: attrs.Attribute, value: str | None) -> None:
        if value is not None:
            _check_dialable(value, "data_addr")

    _addrs.json_schema = {  # type: ignore[attr-defined]
        "maxItems": 64, "items": {"type": "string", "minLength": 1, "maxLength": 255,
                                  "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f]+$"}}

    @devices.validator
    def _devices(self, _attr: attrs.Attribute, value: list[str]) -> None:
        if not 1 <= len(value) <= 64:
            raise FieldError("must list 1-64 slots", "devices")
        for d in value:
            if not DEVICE_SLOT.fullmatch(d):
                raise FieldError(f"{d!r} is not 'cpu' or 'cuda:N'", "devices")

    _devices.json_schema = {  # type: ignore[attr-defined]
        "minItems": 1, "maxItems": 64,
        "items": {"type": "string", "pattern": "^(cpu|cuda:[0-9]+)$"}}


@attrs.define
class RegisterResponse:
    fellow_id: int
    session: str
    heartbeat_interval_s: float
    stale_after_s: float


@attrs.define
class Heartbeat:
    """Sent every second by each fellow."""

    status: ReportedStatus = "ready"
    current_job: str | None = None
    current_stage: int | None = None
    current_step: int = attrs.field(
        default=0, validator=_non_negative, metadata=_meta("", minimum=0)
    )
    last_loss: float | None = None
    tokens_per_s: float = attrs.field(
        default=0.0, validator=_non_negative, metadata=_meta("", minimum=0)
    )
    counters: ByteCounters = attrs.field(factory=ByteCounters)
    link: LinkLimits = attrs.field(factory=LinkLimits)
    signal_seq: int = attrs.field(
        default=0, validator=_non_negative, metadata=_meta("last signal applied", minimum=0)
    )


@attrs.define
class Signal:
    seq: int
    kind: SignalKind
    job_id: str | None = None
    payload: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class SignalBatch:
    signals: list[Signal] = attrs.field(factory=list)


@attrs.define
class SetSpeedRequest:
    """New link limits for a fellow; null rates mean unlimited."""

    tx_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none, metadata=_meta("Mbit/s")
    )
    rx_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none, metadata=_meta("Mbit/s")
    )
    latency_ms: float = attrs.field(
        default=0.0, validator=_bounded(0, 60_000), metadata=_meta("", minimum=0, maximum=60000)
    )


def _ids(ids: list[int]) -> None:
    for i, fid in enumerate(ids):  # (an id no fellow can have is a bad body, not "unknown")
        if not 0 <= fid < 2**63:
            raise FieldError(f"must be a fellow id (0 to 2**63-1), got {fid}", f"fellow_ids[{i}]")


@attrs.define
class ReleaseRequest:
    """Release the listed fellows, or all of them."""

    fellow_ids: list[int] = attrs.field(factory=list, validator=lambda _i, _a, v: _ids(v))
    all: bool = False

    __json_schema__ = {"oneOf": [
        {"required": ["fellow_ids"],
         "properties": {"fellow_ids": {"minItems": 1}, "all": {"enum": [False]}}},
        {"required": ["all"],
         "properties": {"all": {"enum": [True]}, "fellow_ids": {"maxItems": 0}}},
    ]}

    def __attrs_post_init__(self) -> None:
        if self.all == bool(self.fellow_ids):
            raise FieldError("give either fellow_ids or all=true, not both and not neither")


@attrs.define
class FellowInfo:
    """The leader's view of one fellow."""

    fellow_id: int
    name: str
    host: str
    pid: int
    devices: list[str]
    threads: int
    data_addr: str | None
    status: str  # ReportedStatus, or "stale" / "offline" as judged by the leader
    reported_status: str
    current_job: str | None
    current_stage: int | None
    current_step: int
    last_loss: float | None
    tokens_per_s: float
    counters: ByteCounters
    link: LinkLimits
    registered_at: float
    last_heartbeat: float | None
    heartbeat_age_s: float | None
    # Why a live fellow may look stuck: "throttled link …", "no new step for …".
    note: str = ""
    data_addrs: list[str] = attrs.field(factory=list)


@attrs.define
class NodeInfo:
    """Control-plane traffic of one fellow, as it reported it."""

    fellow_id: int
    name: str
    host: str
    status: str
    control_tx: int
    control_rx: int
    data_tx: int
    data_rx: int


# --- jobs ---------------------------------------------------------------------------------------


@attrs.define
class Topology:
    """What a job asks of the cluster: fellows, and how many of each one's device slots it
    uses; one pipeline stage per slot, so fellows x slots_per_fellow stages."""

    fellows: int = attrs.field(
        default=1, validator=_bounded(1, 1024), metadata=_meta("", minimum=1, maximum=1024)
    )
    slots_per_fellow: int = attrs.field(
        default=1, validator=_bounded(1, 64), metadata=_meta("", minimum=1, maximum=64))

    @property
    def num_stages(self) -> int:
        return self.fellows * self.slots_per_fellow


@attrs.define
class SmokeTraining:
    """A smoke job's only settings: its fellows walk ``steps`` RUNNING steps of
    ``step_seconds`` each, then COMPLETE. The leader checks them at submit, the fellow again
    at START (a leader of another version)."""

    steps: int = attrs.field(default=5)
    step_seconds: float = attrs.field(default=0.2)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.steps <= 100_000:
            raise FieldError(f"must be 1-100000, got {self.steps}", "steps")
        if not 0 <= self.step_seconds <= 60:
            raise FieldError(f"must be 0-60, got {self.step_seconds}", "step_seconds")


@attrs.define
class JobSubmit:
    """Enqueue a job: the resolved model and training config plus the requested topology."""

    name: str = attrs.field(default="job", validator=_name, metadata=_meta("", maxLength=128))
    kind: JobKind = "train"
    model: dict[str, Any] = attrs.field(factory=dict, validator=_shallow)
    training: dict[str, Any] = attrs.field(factory=dict, validator=_shallow)
    topology: Topology = attrs.field(factory=Topology)


@attrs.define
class JobStatusUpdate:
    """A fellow reports on the job it runs."""

    fellow_id: int = attrs.field(validator=_non_negative, metadata=_meta("", minimum=0))
    state: ReportedJobState
    step: int = attrs.field(default=0, validator=_non_negative, metadata=_meta("", minimum=0))
    loss: float | None = None
    tokens_per_s: float | None = attrs.field(default=None, validator=_non_negative)
    message: str = attrs.field(default="", metadata=_meta("", maxLength=4096))
    attempt: int = attrs.field(default=0, validator=_non_negative,
                               metadata=_meta("the START's attempt; stale reports are ignored",
                                              minimum=0))
    stage: int | None = attrs.field(default=None, validator=_non_negative,
                                    metadata=_meta("the reporting stage (a fellow may hold "
                                                   "several)", minimum=0))
    metrics: dict[str, Any] = attrs.field(
        factory=dict, validator=_shallow,
        metadata=_meta("numbers such as eval_loss, wire_tx_bytes, tokens_per_s"))
    blames_stage: int | None = attrs.field(
        default=None, validator=_non_negative,
        metadata=_meta("on a FAILED report caused by the link to a neighbouring stage (it "
                       "closed, broke or went quiet): that stage. Under resume_policy fail the "
                       "leader then waits up to the stale timeout plus one heartbeat interval "
                       "for a report or a fellow state that names the cause", minimum=0))

    @message.validator
    def _msg(self, _attr: attrs.Attribute, value: str) -> None:
        if len(value) > 4096:
            raise FieldError("must be at most 4096 characters", "message")


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
    model: dict[str, Any]
    training: dict[str, Any]
    waiting_for: str = ""
    metrics: dict[str, Any] = attrs.field(factory=dict)
    placement: dict[str, Any] | None = None
    loss_history: list[list[float]] = attrs.field(factory=list)  # GET /jobs/{id} only
    latest_shard_pushes: dict[str, Any] = attrs.field(factory=dict)
    attempt: int = 0
    restarts: list[dict[str, Any]] = attrs.field(factory=list)
    # {at_step, fellow_id, link: {tx_mbps, rx_mbps, latency_ms}, at}: set-speeds while it ran
    link_changes: list[dict[str, Any]] = attrs.field(factory=list)
    # How many set-speeds it saw in all: link_changes keeps the first and the newest 199.
    link_changes_total: int = 0


def link_changes_in_all(changes: list[Any], total: int | None) -> int:
    """How many set-speeds a job saw: its count, or as many as its record holds where that is
    more (a record from before the count was kept)."""
    return max(total or 0, len(changes))


@attrs.define
class ProgressList:
    """One record per training step: step, loss, tokens_per_s, wire_bytes, step_seconds, lr,
    activation_peak_bytes, wait_seconds, stage_seconds and codec_error ({act, grad}) by stage
    index, eval_loss and perplexity (when evaluated), ts."""

    records: list[dict[str, Any]]


@attrs.define
class JobList:
    jobs: list[JobInfo]


@attrs.define
class FellowList:
    fellows: list[FellowInfo]


@attrs.define
class NodeList:
    nodes: list[NodeInfo]


@attrs.define
class ReleaseResult:
    released: list[int]


@attrs.define
class LeaderInfo:
    version: str
    started_at: float
    state_dir: str
    stale_after_s: float
    heartbeat_interval_s: float
    fellows_total: int
    fellows_ready: int
    jobs_pending: int
    jobs_running: int


def step_wait_share(metrics: dict[str, Any]) -> float | None:
    """From a stage's step report (``wait_seconds``, ``step_seconds``): the share of the step
    it sat blocked on its links, in [0, 1]; None without both."""
    wait, span = metrics.get("wait_seconds"), metrics.get("step_seconds")
    if not isinstance(wait, int | float) or not isinstance(span, int | float) or span <= 0:
        return None
    return min(1.0, max(0.0, wait / span))


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(50) so a diverged run reads as huge rather than overflowing."""
    return math.exp(min(loss, 50.0))

