"""attrs validators of API bodies and configs. Each carries the JSON Schema it enforces
(``json_schema``), so the OpenAPI document states exactly what the leader accepts."""

from __future__ import annotations

import re
from typing import Any

import attrs

from swarm_core.schema import FieldError

MAX_NAME = 128
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")

DEVICE_SLOT = re.compile(r"cpu|cuda:[0-9]+")


def name_field(_inst: Any, attr: attrs.Attribute, value: str) -> None:
    if not value or len(value) > MAX_NAME or CONTROL.search(value):
        raise FieldError(f"must be 1-{MAX_NAME} characters without control characters",
                         attr.name)


name_field.json_schema = {  # type: ignore[attr-defined]
    "minLength": 1, "maxLength": MAX_NAME, "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f]+$"}


NO_CONTROL = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with every control character (ESC of a terminal sequence, NUL, BEL, C1) made a
    space: what a fellow or a file says is shown, never obeyed by a terminal."""
    if keep_newlines:
        return "\n".join(CONTROL.sub(" ", line) for line in text.split("\n"))
    return CONTROL.sub(" ", text)


def log_line(text: str, max_chars: int) -> str:
    """``text`` as one line of a log someone reads on a terminal: tabs expanded (as a terminal
    would have shown them), every other control character (a newline too: a line stays one
    line) made a space, and cut to ``max_chars`` with an ellipsis. A fellow's ring and the
    leader taking a fellow's post both use it, so a line reads the same either way."""
    line = printable(text.expandtabs())
    return line if len(line) <= max_chars else line[:max_chars - 1] + "…"


def text_field(max_len: int):
    """attrs validator of a one-line text of at most ``max_len`` characters (None passes)."""

    def check(_inst: Any, attr: attrs.Attribute, value: str | None) -> None:
        if value is not None and (len(value) > max_len or CONTROL.search(value)):
            raise FieldError(f"must be at most {max_len} characters without control "
                             f"characters", attr.name)

    check.json_schema = {"maxLength": max_len, "pattern": NO_CONTROL}  # type: ignore[attr-defined]
    return check


def non_negative(_inst: Any, attr: attrs.Attribute, value: float | int | None) -> None:
    if value is not None and value < 0:
        raise FieldError(f"must be >= 0, got {value}", attr.name)


non_negative.json_schema = {"minimum": 0}  # type: ignore[attr-defined]


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


def _shown(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def bounded(lo: float, hi: float):
    def check(_inst: Any, attr: attrs.Attribute, value: float | int | None) -> None:
        if value is not None and not lo <= value <= hi:
            raise FieldError(f"must be between {_shown(lo)} and {_shown(hi)}, got {value}",
                             attr.name)

    check.json_schema = {"minimum": lo, "maximum": hi}  # type: ignore[attr-defined]
    return check


# The most steps a job trains (TrainingConfig.steps' bound; a smoke job's is lower): a step a
# fellow names is within it, so what the leader works out from one (the step after it, the
# step a regroup takes effect) stays an int64 it can store and read back. A regroup's steps
# and a pushed shard's the leader also holds to the job's own.
MAX_STEPS = 10_000_000
step_number = bounded(0, MAX_STEPS)

# A byte count one cell reports for a step or a run, or one file of a shard. 16 TiB is past
# any link this field studies and any shard it pushes, and the sum over the largest grid
# (1024 fellows x 64 slots) stays inside the int64 that SQLite and orjson hold: a report can
# never make a job unstorable.
MAX_BYTES = 2**44


MAX_JSON_DEPTH = 64  # orjson writes at most 255 levels; stored jobs and signals nest a few more


def nests_within(value: Any, depth: int) -> bool:
    if isinstance(value, dict):
        return depth > 0 and all(nests_within(v, depth - 1) for v in value.values())
    if isinstance(value, list):
        return depth > 0 and all(nests_within(v, depth - 1) for v in value)
    return True


def meta(doc: str, **kw: Any) -> dict[str, Any]:
    return {"doc": doc, **kw}


def max_items(n: int):
    """attrs validator of a list of at most ``n`` items."""

    def check(_inst: Any, attr: attrs.Attribute, value: list[Any]) -> None:
        if len(value) > n:
            raise FieldError(f"must list at most {n} items, got {len(value)}", attr.name)

    check.json_schema = {"maxItems": n}  # type: ignore[attr-defined]
    return check
