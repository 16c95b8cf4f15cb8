"""Bodies of the leader's HTTP API (``/api/v1``), shared by the leader and :mod:`swarm_core.client`.

Field names here are public interface: scripts read them from ``--format json`` output.
"""

from __future__ import annotations

import enum
import ipaddress
from typing import Any, Literal

import attrs

from swarm_core.schema import FieldError
from swarm_core.validators import (
    CONTROL,
    DEVICE_SLOT,
    bounded,
    meta,
    name_field,
    non_negative,
    rate_or_none,
    text_field,
)

API_PREFIX = "/api/v1"

SignalKind = Literal["START", "STOP", "RELEASE", "SET_SPEED", "MEMBERS"]


class FellowStatus(enum.StrEnum):
    """Where a fellow stands. It reports the first four itself; the leader judges the last two
    from its heartbeats (see FellowInfo.status)."""

    READY = "ready"
    BUSY = "busy"
    RELEASED = "released"
    LEAVING = "leaving"
    STALE = "stale"  # no heartbeat for the stale timeout
    OFFLINE = "offline"  # none since this leader started

    @property
    def live(self) -> bool:
        """Heartbeating and in the cluster."""
        return self in (FellowStatus.READY, FellowStatus.BUSY)

    @property
    def left(self) -> bool:
        """Released or leaving: gone from the cluster on purpose."""
        return self in (FellowStatus.RELEASED, FellowStatus.LEAVING)

    @property
    def reported(self) -> bool:
        """A status a fellow may report of itself."""
        return self not in (FellowStatus.STALE, FellowStatus.OFFLINE)


# What a fellow may say of itself in a heartbeat (the leader judges stale and offline).
ReportedStatus = Literal["ready", "busy", "released", "leaving"]


# The header a fellow names its session in, on every call it makes as a fellow.
SESSION_HEADER = "X-Swarm-Fellow-Session"


class JobState(enum.Enum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED)


@attrs.define
class LinkLimits:
    """Link shaping of one fellow's data plane. null means unlimited."""

    tx_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none, metadata=meta("send limit, Mbit/s")
    )
    rx_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none, metadata=meta("receive limit, Mbit/s")
    )
    latency_ms: float = attrs.field(
        default=0.0,
        validator=bounded(0, 60_000),
        metadata=meta("added one-way latency, ms", minimum=0, maximum=60000),
    )


MAX_PEER_LINKS = 256  # (64 cells x up, down and two ring neighbours)


@attrs.define
class PeerLinkState:
    """One link a link matrix shapes, from a cell this fellow runs to a peer cell: its pair's
    settings now, and what it moved (``achieved_mbps``: the rate whole frames left at)."""

    job_id: str = attrs.field(validator=text_field(128), metadata=meta("", maxLength=128))
    cell: str = attrs.field(validator=text_field(16), metadata=meta("stage.replica",
                                                                     maxLength=16))
    peer: str = attrs.field(validator=text_field(16), metadata=meta("stage.replica",
                                                                     maxLength=16))
    site: str = attrs.field(validator=text_field(32), metadata=meta("", maxLength=32))
    peer_site: str = attrs.field(validator=text_field(32), metadata=meta("", maxLength=32))
    peer_fellow: int | None = None
    tx_mbps: float | None = attrs.field(default=None, validator=rate_or_none,
                                        metadata=meta("the pair's rate, Mbit/s"))
    latency_ms: float = attrs.field(default=0.0, validator=bounded(0, 60_000),
                                    metadata=meta("", minimum=0, maximum=60000))
    jitter_ms: float = attrs.field(default=0.0, validator=bounded(0, 60_000),
                                   metadata=meta("", minimum=0, maximum=60000))
    tx_bytes: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))
    rx_bytes: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))
    achieved_mbps: float | None = attrs.field(default=None, validator=non_negative,
                                              metadata=meta("", minimum=0))
    # Selective compression (training.compress_when): the format the cell sends the peer in
    # (``int8``, ``fp32``); absent without a rule, and in heartbeats.
    codec: str | None = attrs.field(default=None, validator=text_field(32),
                                    metadata=meta("", maxLength=32))


@attrs.define
class ByteCounters:
    """Cumulative bytes since the fellow process started."""

    control_tx: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))
    control_rx: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))
    data_tx: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))
    data_rx: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))


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
            or not 0 < int(port) < 65536 or CONTROL.search(host):
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

    name: str = attrs.field(validator=name_field,
                            metadata=meta("unique per cluster", maxLength=128))
    instance_id: str = attrs.field(
        validator=name_field, metadata=meta("random per fellow process", maxLength=128)
    )
    host: str = attrs.field(default="", validator=text_field(255),
                            metadata=meta("hostname", maxLength=255))
    pid: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))
    devices: list[str] = attrs.field(factory=lambda: ["cpu"], metadata=meta("device slots"))
    threads: int = attrs.field(
        default=1, validator=bounded(1, 1024), metadata=meta("", minimum=1, maximum=1024)
    )
    data_addr: str | None = attrs.field(default=None, validator=text_field(255),
                                        metadata=meta("host:port of data plane", maxLength=255))
    data_addrs: list[str] = attrs.field(
        factory=list, metadata=meta("host:port per device slot (data_addr is slot 0's)"))
    version: str = attrs.field(default="", validator=text_field(64),
                               metadata=meta("the fellow's SilentSwarm version", maxLength=64))

    @data_addrs.validator
    def _addrs(self, _attr: attrs.Attribute, value: list[str]) -> None:
        if len(value) > 64 or any(not a or len(a) > 255 or CONTROL.search(a) for a in value):
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
class Signal:
    seq: int
    kind: SignalKind
    job_id: str | None = None
    payload: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class SignalBatch:
    signals: list[Signal] = attrs.field(factory=list)


# The largest emulated slowdown: past it a "slow peer" is a stalled one.
SLOWDOWN_MAX = 100.0


@attrs.define
class SetSpeedRequest:
    """New link limits for a fellow (null rates mean unlimited), and/or its emulated compute
    slowdown."""

    tx_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none, metadata=meta("Mbit/s")
    )
    rx_mbps: float | None = attrs.field(
        default=None, validator=rate_or_none, metadata=meta("Mbit/s")
    )
    latency_ms: float = attrs.field(
        default=0.0, validator=bounded(0, 60_000), metadata=meta("", minimum=0, maximum=60000)
    )
    # Emulated compute slowdown (swarm_core.pipeline.pace): absent leaves it as it is; given
    # alone, it leaves the link as it is too.
    slowdown: float | None = attrs.field(
        default=None, validator=bounded(1, SLOWDOWN_MAX),
        metadata=meta("pad the fellow's compute to this many times its measured time "
                      "(1: none); absent: unchanged", minimum=1, maximum=SLOWDOWN_MAX)
    )

    # Per pair: only the fellow's links to fellow ``to`` (those a job's link matrix shapes)
    # take the link limits (tx: its pair rate; latency: the pair's), not the fellow's own.
    to: int | None = attrs.field(
        default=None, validator=non_negative,
        metadata=meta("set only the links to this fellow (a link matrix's pairs); absent: "
                      "the fellow's own limits", minimum=0))

    def link_given(self, body: Any) -> bool:
        """Whether the body ``self`` came from sets the link: it names a link field, or it
        names no slowdown (``{}`` asks for an unlimited link, as it always did)."""
        named = isinstance(body, dict) and any(k in body for k in LINK_FIELDS)
        return named or self.slowdown is None


LINK_FIELDS = ("tx_mbps", "rx_mbps", "latency_ms")


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
    status: FellowStatus  # as reported, or stale / offline as judged by the leader
    reported_status: FellowStatus
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
    # The links a job's link matrix shapes, per peer (empty under a uniform profile).
    peers: list[PeerLinkState] = attrs.field(factory=list)
    slowdown: float = 1.0  # its emulated compute slowdown, as it last reported it (1: none)


@attrs.define
class NodeInfo:
    """Control-plane traffic of one fellow, as it reported it."""

    fellow_id: int
    name: str
    host: str
    status: FellowStatus
    control_tx: int
    control_rx: int
    data_tx: int
    data_rx: int


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

