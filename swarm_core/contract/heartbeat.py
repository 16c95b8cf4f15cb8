"""What a fellow tells the leader every second: its state, what it runs, what it could not
report. Beside the job contract because it carries a cell's final report."""

from __future__ import annotations

import attrs

from swarm_core.contract.metrics import JobStatusUpdate
from swarm_core.protocol import (
    MAX_PEER_LINKS,
    SLOWDOWN_MAX,
    ByteCounters,
    LinkLimits,
    PeerLinkState,
    ReportedStatus,
)
from swarm_core.validators import (
    MAX_STEPS,
    bounded,
    max_items,
    meta,
    non_negative,
    step_number,
    text_field,
)

MAX_CELLS = 64  # one per device slot
MAX_UNREPORTED = 4


@attrs.define
class Heartbeat:
    """Sent every second by each fellow."""

    status: ReportedStatus = "ready"
    current_job: str | None = attrs.field(default=None, validator=text_field(128),
                                          metadata=meta("", maxLength=128))
    current_stage: int | None = None
    current_step: int = attrs.field(
        default=0, validator=step_number, metadata=meta("", minimum=0, maximum=MAX_STEPS)
    )
    last_loss: float | None = None
    tokens_per_s: float = attrs.field(
        default=0.0, validator=non_negative, metadata=meta("", minimum=0)
    )
    counters: ByteCounters = attrs.field(factory=ByteCounters)
    link: LinkLimits = attrs.field(factory=LinkLimits)
    # Its emulated compute slowdown now (swarm_core.pipeline.pace; 1: none), so the leader's
    # views say which peer is slow on purpose.
    slowdown: float = attrs.field(default=1.0, validator=bounded(1, SLOWDOWN_MAX),
                                  metadata=meta("emulated compute slowdown (1: none)",
                                                minimum=1, maximum=SLOWDOWN_MAX))
    signal_seq: int = attrs.field(
        default=0, validator=non_negative, metadata=meta("last signal applied", minimum=0)
    )
    running: list[CellRef] = attrs.field(
        factory=list, validator=max_items(MAX_CELLS),
        metadata=meta("the cells this fellow runs now: the leader restarts a cell whose START "
                      "was lost and stops one of a job that is over"))
    peers: list[PeerLinkState] = attrs.field(
        factory=list, validator=max_items(MAX_PEER_LINKS),
        metadata=meta("the links a job's link matrix shapes, per peer cell"))
    unreported: list[UnreportedFinal] = attrs.field(
        factory=list, validator=max_items(MAX_UNREPORTED),
        metadata=meta("final reports the fellow could not deliver (the leader was away longer "
                      "than the fellow's patience): the leader applies those it missed"))


@attrs.define
class CellRef:
    """A cell of a job (one replica of one stage, at one attempt)."""

    job_id: str = attrs.field(validator=text_field(128), metadata=meta("", maxLength=128))
    stage: int = attrs.field(validator=non_negative, metadata=meta("", minimum=0))
    replica: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))
    attempt: int = attrs.field(default=0, validator=non_negative, metadata=meta("", minimum=0))


@attrs.define
class UnreportedFinal:
    """A cell's COMPLETED or FAILED report that did not reach the leader."""

    job_id: str = attrs.field(validator=text_field(128), metadata=meta("", maxLength=128))
    report: JobStatusUpdate
