"""argparse value types: one place for "a number in this range", with one-line messages."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from swarm_core.config.schemas import MAX_THREADS
from swarm_core.protocol import SLOWDOWN_MAX
from swarm_core.validators import RATE_MBPS
from swarm_tui.typed import clip, decimal_number, whole_number


def number(cast: type[int] | type[float], lo: float, hi: float, what: str,
           lo_open: bool = False) -> Callable[[str], float]:
    """A type that parses ``cast`` and accepts ``lo <= v <= hi`` (``lo < v`` if ``lo_open``)."""

    def parse(text: str) -> float:
        try:
            value = whole_number(text) if cast is int else decimal_number(text)
        except ValueError:
            kind = "a whole number" if cast is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {kind} ({what}), got {clip(text)!r}") \
                from None
        # What was parsed (whitespace gone), cut short: the error stays one line.
        shown = clip(text.strip())
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{what} must be finite, got {shown}")
        low_ok = value > lo if lo_open else value >= lo
        if not low_ok or value > hi:
            def shown_bound(b: float) -> str:
                return f"{int(b)}" if cast is int else f"{b:g}"

            left = f"> {shown_bound(lo)}" if lo_open else f">= {shown_bound(lo)}"
            right = "" if hi == math.inf else f" and <= {shown_bound(hi)}"
            raise argparse.ArgumentTypeError(f"{what} must be {left}{right}, got {shown}")
        return value

    parse.__name__ = what.replace(" ", "_")
    return parse


positive_int = number(int, 1, 2**63 - 1, "count")  # int64: what the leader and SQLite hold
# A job's fellows (the API's bound), and a local cluster's (processes on this machine).
fellow_count = number(int, 1, 1024, "fellow count")
local_fellow_count = number(int, 1, 64, "local fellow count")
core_count = number(int, 1, 4096, "core count")
positive_float = number(float, 0, math.inf, "value", lo_open=True)
step_count = number(int, 0, 1_000_000, "steps")  # DiLoCo's inner and overlap steps' bound
port = number(int, 0, 65535, "port")
fellow_id = number(int, 0, 2**63 - 1, "fellow id")
cell_index = number(int, 0, 1023, "stage or replica index")
latency_ms = number(float, 0, 60_000, "latency in ms")
temperature = number(float, 0, 10, "temperature", lo_open=True)
# torch's thread pool: what a job's stage may use (a fellow with more would refuse every job).
thread_count = number(int, 1, MAX_THREADS, "thread count")
link_mbps = number(float, *RATE_MBPS, "rate in Mbit/s")  # the API's bound
slowdown = number(float, 1, SLOWDOWN_MAX, "slowdown")  # emulated compute slowdown (pace.py)


def cell_slowdown(text: str) -> tuple[int, int, float]:
    """``STAGE.REPLICA=X`` (``swarm predict --slowdown``): a cell's emulated slowdown."""
    cell, eq, factor = text.partition("=")
    stage, dot, replica = cell.strip().partition(".")
    if not eq or not dot or not stage.isdigit() or not replica.isdigit():
        raise argparse.ArgumentTypeError(f"expected STAGE.REPLICA=X (e.g. 1.1=4), got "
                                         f"{clip(text)!r}")
    return int(stage), int(replica), slowdown(factor)

# Sampled one at a time on the CPU: more than this is a typo, not a text.
token_count = number(int, 1, 1_000_000, "token count")
# What torch.Generator.manual_seed takes (a negative seed is another name for a large one).
sampling_seed = number(int, -(2**63), 2**64 - 1, "seed")


def sync_field(cast: type[int] | type[float], field: str) -> Callable[[str], float]:
    """A ``training.sync`` field's number, parsed only: SyncConfig checks its range, so a bad
    value is the one line that names the field, as from a profile."""
    if cast is int:  # (int64 bounds only so that no thousand-digit text reaches the schema)
        return number(int, -(2**63), 2**63 - 1, field)
    return number(float, -math.inf, math.inf, field)


rebalance_every = number(int, 1, 1_000_000, "steps between rebalancing looks")


def cell_layout(text: str) -> list[list[int]]:
    """``--layout``: per stage, its cells' ids, stages split by ";" and ids by ","
    ("0;0,1,2": stage 0 cell 0, stage 1 cells 0, 1 and 2). The rules a layout meets are the
    job's (``Topology.layout``), checked where the job is."""
    try:
        out = [[whole_number(i) for i in stage.split(",")] for stage in text.split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected stages of cell ids like '0;0,1,2' (';' between stages, ',' between "
            f"ids), got {clip(text)!r}") from None
    return out


def utf8_text(value: str) -> str:
    """argv that is not UTF-8 arrives as surrogate escapes, which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return value


def job_id(text: str) -> str:
    """A job id as the leader makes them (``job-000001``): not empty, one short token. What
    else it names is the leader's answer (no such job)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a job id such as job-000001, got nothing")
    if len(text) > 128 or any(c.isspace() or not c.isprintable() for c in text):
        raise argparse.ArgumentTypeError(f"expected a job id such as job-000001, got "
                                         f"{clip(text)!r}")
    return text


def warm_start(text: str) -> dict[str, Any]:
    """``--warm-start JOB[:STEP]``: ``training.warm_start`` (no step: the job's newest
    complete checkpoint, which the leader resolves)."""
    from swarm_core.config.schemas import JOB_ID
    from swarm_core.validators import MAX_STEPS

    job, sep, step = text.partition(":")
    if not JOB_ID.fullmatch(job.strip()):
        raise argparse.ArgumentTypeError(f"expected JOB[:STEP] such as job-000012:2000, got "
                                         f"{clip(text)!r}")
    out: dict[str, Any] = {"job_id": job.strip()}
    if sep:
        out["step"] = int(number(int, 1, MAX_STEPS, "warm-start step")(step))
    return out


def device_slots(text: str) -> str:
    """``cpu,cuda:0,…``: the syntax only (no torch here); whether the machine has the GPUs is
    the fellow's check."""
    from swarm_core.validators import DEVICE_SLOT

    slots = [d.strip() for d in text.split(",") if d.strip()]
    if not slots:
        raise argparse.ArgumentTypeError("expected device slots such as cpu or cpu,cuda:0")
    for d in slots:
        if not DEVICE_SLOT.fullmatch(d):
            raise argparse.ArgumentTypeError(f"{d!r} is not 'cpu' or 'cuda:N'")
    return ",".join(slots)


def data_host(text: str) -> str:
    """A host neighbours can dial: not empty, no port, not a bind-all address."""
    from swarm_core.protocol import is_bind_all

    host = text.strip()
    if not host:
        raise argparse.ArgumentTypeError("expected a host name or address")
    if is_bind_all(host):
        raise argparse.ArgumentTypeError(f"{clip(text)!r} is a bind-all address; give one "
                                         "neighbours can dial")
    if any(c.isspace() or c == ":" for c in host):
        raise argparse.ArgumentTypeError(f"expected a host name or address without a port, "
                                         f"got {clip(text)!r}")
    return host


def data_root(text: str) -> str:
    """A directory jobs may read files under, resolved (symlinks too: a root is where its
    files really are)."""
    try:
        path = Path(text).expanduser()
    except RuntimeError:  # ~user with no such user
        raise argparse.ArgumentTypeError(f"{clip(text, 200)}: no such user's home directory") \
            from None
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{clip(text, 200)} is not a directory")
    return str(path.resolve())
