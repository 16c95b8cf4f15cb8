"""A fellow's own log, as the leader relays it: the tail a fellow posts when asked, and what
``GET /fellows/{id}/log`` answers.

The leader keeps no fellow output on disk. A fellow keeps a bounded ring of its own log lines
(``swarm_core.fellow.logring``); while someone reads its log (the console's log view,
``swarm fellow-log``), the heartbeat answer says ``send_log`` and the fellow posts what is new
since its last post. The leader holds the latest tail per fellow, in memory, bounded.
"""

from __future__ import annotations

import attrs

from swarm_core.schema import FieldError
from swarm_core.validators import max_items, meta, non_negative

MAX_LOG_LINES = 1000  # per post, held per fellow, and asked for by ?lines=
DEFAULT_LOG_LINES = 200
MAX_LINE_CHARS = 512  # a longer line is cut (1000 of them stay well inside the 1 MiB body)


def _lines(_inst: object, attr: attrs.Attribute, value: list[str]) -> None:
    for i, line in enumerate(value):
        if not isinstance(line, str) or len(line) > MAX_LINE_CHARS:
            raise FieldError(f"must be a string of at most {MAX_LINE_CHARS} characters",
                             f"{attr.name}[{i}]")


_lines.json_schema = {  # type: ignore[attr-defined]
    "maxItems": MAX_LOG_LINES, "items": {"type": "string", "maxLength": MAX_LINE_CHARS}}


@attrs.define
class FellowLogTail:
    """What a fellow posts: its newest lines, numbered by ``seq`` (how many lines it has logged
    since it started; the last of ``lines`` is line ``seq``)."""

    seq: int = attrs.field(validator=non_negative,
                           metadata=meta("the number of the newest line", minimum=0))
    lines: list[str] = attrs.field(factory=list, validator=[max_items(MAX_LOG_LINES), _lines])
    replace: bool = attrs.field(
        default=True,
        metadata=meta("lines are the whole tail (else they follow the leader's held tail, "
                      "which must end at seq - len(lines): a 409 otherwise)"))

    def __attrs_post_init__(self) -> None:
        if len(self.lines) > self.seq:
            raise FieldError(f"lists {len(self.lines)} lines but seq is {self.seq}", "seq")


@attrs.define
class FellowLog:
    """The tail of a fellow's own log as the leader last received it."""

    fellow_id: int
    name: str
    lines: list[str]
    seq: int  # the number of the newest line (0: none received)
    received_at: float | None  # leader clock; None: the fellow has sent none yet
    age_s: float | None  # seconds since the leader received it
    # Why there is nothing, or why it may be old: "" when the tail is fresh.
    message: str = ""
    # Whether the leader asked the fellow for newer lines (it does when the fellow is live):
    # a reader polling for a while then gets them.
    asked: bool = False
