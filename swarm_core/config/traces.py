"""Network scenarios that change while a run trains: link traces and churn scripts.

A **link trace** is a CSV (header row) or NDJSON (an object a line) of ``t_s`` and any of
``tx_mbps``, ``rx_mbps``, ``latency_ms``: from ``t_s`` seconds into the run, the link is that.
A value column the trace leaves out keeps the run's network profile's value; a blank CSV cell
(an NDJSON row without the key) keeps the row before's; an NDJSON ``null`` rate is unlimited.
Looped, the last row's time is the lap's length (its values hold for no time: the next lap's
first row replaces them).

A **churn script** (JSON) is one of: explicit ``events`` (at ``at_s``, ``kill``, ``leave`` or
``join`` a fellow by name, or the fellow that holds a cell), a seeded ``generator`` (a kill every
``every_s`` seconds, with ``jitter_s``, cycling over the cells of the replicas other than the
first), or a ``spot_trace`` file of preemption times. The same script and seed always give the
same planned timeline (:func:`churn_timeline`); swarm_core.experiments.replay plays it.

Both are named in configs by path (relative to the file naming them) or by a library name
under ``exp/configs/network/`` (``churn/<name>.json``, ``traces/<name>.csv|.ndjson``). Errors
are one line, :class:`TraceError`, naming the file, the line and what is wrong.
"""

from __future__ import annotations

import csv
import heapq
import math
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import attrs

from swarm_core import jsonio
from swarm_core.protocol import LINK_FIELDS, LinkLimits
from swarm_core.schema import FieldError, SchemaError, structure, unstructure
from swarm_core.validators import RATE_MBPS

LIBRARY = Path(__file__).resolve().parents[2] / "exp" / "configs" / "network"
TRACE_SUFFIXES = (".csv", ".ndjson", ".jsonl")
MAX_ROWS = 100_000
# A generator without ``until_s`` is endless: what a replay may draw of it, as a backstop.
MAX_EVENTS = 100_000
_LIBRARY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class TraceError(ValueError):
    """A trace or churn script that cannot be used; the message is one line."""


def _finite_non_negative(_i: Any, a: attrs.Attribute, v: float | None) -> None:
    if v is not None and not (math.isfinite(v) and v >= 0):
        raise FieldError(f"must be a finite number >= 0, got {v}", a.name)


# --- link traces ----------------------------------------------------------------------------------


@attrs.define
class LinkTraceSpec:
    """A link trace a run replays live, each change a set-speed the job records (as `swarm
    set-speed` does): to every fellow of the run's job, or only to the fellows named."""

    # A path (relative to the file that names it) or a name under exp/configs/network/traces/.
    file: str
    loop: bool = False
    fellows: list[str] | None = None
    # Per pair (a job whose network is a link matrix): only the links from those fellows to
    # these (by name) follow the trace, each pair's own (``swarm set-speed --to``); the rest
    # of the matrix stays. None: each fellow's own limits follow it.
    to: list[str] | None = None

    def __attrs_post_init__(self) -> None:
        if not self.file.strip():
            raise FieldError("must name a trace file", "file")
        if self.fellows is not None and not self.fellows:
            raise FieldError("must name at least one fellow (or be left out: every fellow)",
                             "fellows")
        if self.to is not None and not self.to:
            raise FieldError("must name at least one peer fellow (or be left out: each "
                             "fellow's own limits follow the trace)", "to")


@attrs.frozen
class TracePoint:
    """From ``t_s`` on, these link fields (those the trace gives; the others the base's)."""

    t_s: float
    values: dict[str, float | None]

    def link(self, base: LinkLimits | None) -> LinkLimits:
        return LinkLimits(**{**unstructure(base or LinkLimits()), **self.values})


@attrs.frozen
class LinkTrace:
    source: str
    points: tuple[TracePoint, ...]

    @property
    def lap_s(self) -> float:
        return self.points[-1].t_s

    def schedule(self, loop: bool) -> Iterator[tuple[float, TracePoint]]:
        """Every change in time order, looped laps after the first (endless when looped)."""
        if not loop:
            yield from ((p.t_s, p) for p in self.points)
            return
        for lap in range(MAX_EVENTS):
            base = lap * self.lap_s
            for p in self.points[:-1]:
                yield base + p.t_s, p


def _number(text: Any, what: str, where: str) -> float | None:
    """``text`` as a number (None stays None); TraceError ``<where>: <what> is not …``."""
    if text is None:
        return None
    if isinstance(text, bool) or not isinstance(text, int | float | str):
        raise TraceError(f"{where}: {what} is not a number ({text!r})")
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{where}: {what} is not a number ({text!r})") from None
    if not math.isfinite(value):
        raise TraceError(f"{where}: {what} is not finite ({text!r})")
    return value


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise TraceError(f"{path}: cannot read: {why}") from None


def _rows(path: Path, allowed: tuple[str, ...]) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of a CSV or NDJSON file whose columns are among ``allowed`` and
    include ``t_s``."""
    if path.suffix not in TRACE_SUFFIXES:
        raise TraceError(f"{path}: must be a .csv or .ndjson file")
    text = _read_text(path)
    rows: list[tuple[int, dict[str, Any]]] = []
    # (blank lines and ``#`` comments are skipped in both: a file can cite its source)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1)
             if line.strip() and not line.lstrip().startswith("#")]
    if path.suffix == ".csv":
        if not lines:
            raise TraceError(f"{path}: no header row")
        header = [h.strip() for h in next(csv.reader([lines[0][1]]))]
        _check_columns(path, header, allowed)
        for n, line in lines[1:]:
            cells = [c.strip() for c in next(csv.reader([line]))]
            if len(cells) > len(header):
                raise TraceError(f"{path}: line {n}: more cells than columns")
            rows.append((n, {k: v for k, v in zip(header, cells, strict=False) if v}))
    else:
        for n, line in lines:
            try:
                obj = jsonio.loads(line)
            except jsonio.JSONDecodeError:
                raise TraceError(f"{path}: line {n}: not valid JSON") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}: line {n}: expected an object")
            _check_columns(path, list(obj), allowed, n)
            rows.append((n, obj))
    if not rows:
        raise TraceError(f"{path}: no rows")
    if len(rows) > MAX_ROWS:
        raise TraceError(f"{path}: {len(rows)} rows, more than {MAX_ROWS}")
    times: list[float] = []
    for n, row in rows:
        if "t_s" not in row:
            raise TraceError(f"{path}: line {n}: missing column t_s")
        t = _number(row["t_s"], "t_s", f"{path}: line {n}")
        assert t is not None
        if t < 0:
            raise TraceError(f"{path}: line {n}: t_s is negative ({t:g})")
        if times and t <= times[-1]:
            raise TraceError(f"{path}: line {n}: time not monotone: t_s {t:g} after "
                             f"{times[-1]:g} (each row must come later than the one before)")
        times.append(t)
        row["t_s"] = t
    return rows


def _check_columns(path: Path, names: list[str], allowed: tuple[str, ...],
                   line: int | None = None) -> None:
    where = f"{path}: line {line}" if line is not None else str(path)
    unknown = [c for c in names if c not in allowed]
    if unknown:
        raise TraceError(f"{where}: unknown column {unknown[0]!r} (expected "
                         f"{', '.join(allowed)})")
    if line is None and "t_s" not in names:
        raise TraceError(f"{where}: missing column t_s")


def load_trace(path: Path) -> LinkTrace:
    """A link trace, checked whole; TraceError (one line) where it cannot be used."""
    rows = _rows(path, ("t_s", *LINK_FIELDS))
    given = [f for f in LINK_FIELDS if any(f in r for _, r in rows)]
    if not given:
        raise TraceError(f"{path}: missing column: give at least one of "
                         f"{', '.join(LINK_FIELDS)}")
    points: list[TracePoint] = []
    current: dict[str, float | None] = {}
    for n, row in rows:
        for f in given:
            if f not in row:
                if not points:
                    raise TraceError(f"{path}: line {n}: missing {f} (the first row must give "
                                     "every value a later row gives)")
                continue
            value = _number(row[f], f, f"{path}: line {n}")
            if value is not None and value < 0:
                kind = "rate" if f != "latency_ms" else "latency"
                raise TraceError(f"{path}: line {n}: negative {kind}: {f} {value:g}")
            if f == "latency_ms":
                if value is None or value > 60_000:
                    raise TraceError(f"{path}: line {n}: latency_ms must be 0-60000, "
                                     f"got {row[f]!r}")
            elif value is not None and not RATE_MBPS[0] <= value <= RATE_MBPS[1]:
                raise TraceError(f"{path}: line {n}: {f} must be {RATE_MBPS[0]:g}-"
                                 f"{RATE_MBPS[1]:g} Mbit/s, got {value:g}")
            current[f] = value
        points.append(TracePoint(row["t_s"], dict(current)))
    return LinkTrace(str(path), tuple(points))


def library_or_path(ref: str, kind: Literal["churn", "traces"], base: Path) -> Path:
    """The file a config's ``ref`` names: a library entry under exp/configs/network/<kind>/
    when ``ref`` is a bare name one has, else a path relative to ``base``."""
    if _LIBRARY_NAME.fullmatch(ref) and not Path(ref).suffix:
        suffixes = (".json",) if kind == "churn" else TRACE_SUFFIXES
        for suffix in suffixes:
            candidate = LIBRARY / kind / f"{ref}{suffix}"
            if candidate.is_file():
                return candidate
    try:
        return (base / ref).resolve()
    except (ValueError, OSError, RuntimeError) as exc:
        raise TraceError(f"not a usable path ({exc}): {ref!r}") from None


def resolve_trace(spec: LinkTraceSpec, base: Path) -> tuple[LinkTraceSpec, LinkTrace]:
    """``spec`` with its file made absolute, and the trace it names, checked (a looped trace
    must last: its last row's time is its lap)."""
    path = library_or_path(spec.file, "traces", base)
    trace = load_trace(path)
    if spec.loop and (len(trace.points) < 2 or trace.lap_s <= 0):
        raise TraceError(f"{path}: a looped trace needs two rows or more, the last after 0 s "
                         "(its time is the lap's length)")
    return attrs.evolve(spec, file=str(path)), trace


# --- churn ----------------------------------------------------------------------------------------


ChurnAction = Literal["kill", "leave", "join"]


@attrs.define
class ChurnEvent:
    """At ``at_s`` seconds into the run, ``kill`` (SIGKILL its process), ``leave`` (the leader
    releases it) or ``join`` (start its process) a fellow: by ``fellow`` name, or the fellow
    that holds the cell ``replica`` x ``stage`` at that moment. ``restart_after_s`` starts a
    killed or departed fellow again that long after."""

    at_s: float = attrs.field(validator=_finite_non_negative)
    action: ChurnAction
    fellow: str | None = None
    replica: int | None = None
    stage: int = 0
    restart_after_s: float | None = attrs.field(default=None,
                                                validator=_finite_non_negative)

    def __attrs_post_init__(self) -> None:
        if (self.fellow is None) == (self.replica is None):
            raise FieldError("give exactly one of fellow or replica", "fellow")
        if self.action == "join" and self.fellow is None:
            raise FieldError("a join names the fellow to start", "fellow")
        if self.action == "join" and self.restart_after_s is not None:
            raise FieldError("only a kill or a leave is restarted", "restart_after_s")
        if (self.replica is not None and self.replica < 0) or self.stage < 0:
            raise FieldError("replica and stage must be >= 0", "replica")


@attrs.define
class ChurnGenerator:
    """A kill (or leave) every ``every_s`` seconds from ``first_s`` (default: ``every_s``),
    each moved by a uniform draw in +-``jitter_s`` (at most half of ``every_s``, so they stay
    in order), cycling over the cells of replicas 1.. (replica-major: replica 1, 2, .. of
    stage 0, then of stage 1); until ``until_s`` or the run's end. ``seed`` null: the run's."""

    every_s: float = attrs.field(validator=_finite_non_negative)
    first_s: float | None = attrs.field(default=None, validator=_finite_non_negative)
    jitter_s: float = attrs.field(default=0.0, validator=_finite_non_negative)
    restart_after_s: float | None = attrs.field(default=None,
                                                validator=_finite_non_negative)
    until_s: float | None = attrs.field(default=None, validator=_finite_non_negative)
    action: Literal["kill", "leave"] = "kill"
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.every_s > 0:
            raise FieldError(f"must be > 0, got {self.every_s}", "every_s")
        if self.jitter_s > self.every_s / 2:
            raise FieldError(f"must be at most every_s / 2 ({self.every_s / 2:g}), got "
                             f"{self.jitter_s}", "jitter_s")


@attrs.define
class SpotTrace:
    """Preemption times from a file (CSV or NDJSON: ``t_s``, and optionally ``fellow`` or
    ``replica``); each a kill, restarted after ``restart_after_s``. A row without a target
    takes the generator's cycle of cells."""

    file: str
    restart_after_s: float | None = attrs.field(default=None,
                                                validator=_finite_non_negative)


@attrs.define
class ChurnScript:
    """Fellows that leave, die and join while a run trains: exactly one of ``events``,
    ``generator``, ``spot_trace``. ``source`` / ``description`` say where its numbers come
    from."""

    name: str
    description: str = ""
    source: str = ""
    events: list[ChurnEvent] | None = None
    generator: ChurnGenerator | None = None
    spot_trace: SpotTrace | None = None

    def __attrs_post_init__(self) -> None:
        if not _LIBRARY_NAME.fullmatch(self.name):
            raise FieldError(f"must be 1-64 of letters, digits, '_', '.', '-', got "
                             f"{self.name!r}", "name")
        given = [k for k in ("events", "generator", "spot_trace") if getattr(self, k)]
        if len(given) != 1:
            raise FieldError("give exactly one of events, generator, spot_trace"
                             + (f" (got {', '.join(given)})" if given else ""), "events")
        times = [e.at_s for e in self.events or []]
        if times != sorted(times):
            raise FieldError("events must be in time order (at_s not monotone)", "events")

    @property
    def kills(self) -> bool:
        """Whether it needs the fellows' processes (a kill or a join), not only the leader."""
        if self.events is not None:
            return any(e.action != "leave" or e.restart_after_s is not None
                       for e in self.events)
        if self.generator is not None:
            return self.generator.action == "kill" or self.generator.restart_after_s is not None
        return True


@attrs.frozen
class PlannedEvent:
    """One event of a churn timeline; a restart's ``of_event`` is the index of the kill or
    leave whose fellow it starts again."""

    at_s: float
    action: ChurnAction
    fellow: str | None = None
    replica: int | None = None
    stage: int = 0
    of_event: int | None = None
    restart_after_s: float | None = None  # (a kill or leave whose fellow comes back)

    @property
    def target(self) -> str:
        if self.fellow is not None:
            return f"fellow {self.fellow}"
        if self.of_event is not None:
            return f"the fellow of event {self.of_event}"
        return f"replica {self.replica} stage {self.stage}"


@attrs.frozen
class SpotRow:
    at_s: float
    fellow: str | None = None
    replica: int | None = None


def load_churn(path: Path) -> ChurnScript:
    """A churn script, checked whole (its spot trace made absolute and read)."""
    try:
        data = jsonio.loads(_read_text(path))
    except jsonio.JSONDecodeError as exc:
        raise TraceError(f"{path}: not valid JSON: {exc}") from None
    try:
        script: ChurnScript = structure(data, ChurnScript)
    except SchemaError as exc:
        raise TraceError(f"{path}: {exc}") from None
    if script.spot_trace is not None:
        spot = library_or_path(script.spot_trace.file, "traces", path.parent)
        load_spot_trace(spot)
        script = attrs.evolve(script, spot_trace=attrs.evolve(script.spot_trace,
                                                              file=str(spot)))
    return script


def load_spot_trace(path: Path) -> list[SpotRow]:
    out = []
    for n, row in _rows(path, ("t_s", "fellow", "replica")):
        replica = row.get("replica")
        if replica is not None:
            r = _number(replica, "replica", f"{path}: line {n}")
            if r is None or r < 0 or r != int(r):
                raise TraceError(f"{path}: line {n}: replica must be an integer >= 0, "
                                 f"got {replica!r}")
            replica = int(r)
        fellow = row.get("fellow")
        if fellow is not None and replica is not None:
            raise TraceError(f"{path}: line {n}: give fellow or replica, not both")
        out.append(SpotRow(row["t_s"], None if fellow is None else str(fellow), replica))
    return out


def churn_timeline(script: ChurnScript, seed: int, replicas: int,
                   stages: int) -> Iterator[PlannedEvent]:
    """The planned events in time order (endless for a generator without ``until_s``): a
    function of the script, the seed and the job's shape alone, so the same seed plans the
    same timeline. TraceError where the shape cannot take it (no replica but the first)."""
    primary: Iterator[tuple[PlannedEvent, float | None]]
    if script.events is not None:
        primary = ((PlannedEvent(e.at_s, e.action, e.fellow, e.replica, e.stage),
                    e.restart_after_s) for e in script.events)
        if any(e.replica is not None and (e.replica >= replicas or e.stage >= stages)
               for e in script.events):
            raise TraceError(f"churn script {script.name}: an event names a cell the run's "
                             f"{stages}x{replicas} grid lacks")
    elif script.generator is not None:
        primary = _generated(script.generator, seed, _cells(script, replicas, stages))
    else:
        assert script.spot_trace is not None
        rows = load_spot_trace(Path(script.spot_trace.file))
        primary = _spot(rows, script.spot_trace.restart_after_s,
                        _cells(script, replicas, stages)
                        if any(r.fellow is None and r.replica is None for r in rows) else [])
        if any(r.replica is not None and r.replica >= replicas for r in rows):
            raise TraceError(f"churn script {script.name}: a spot-trace row names a replica "
                             f"the run's {replicas} lack")
    return _merged(primary)


def _cells(script: ChurnScript, replicas: int, stages: int) -> list[tuple[int, int]]:
    if replicas < 2:
        raise TraceError(f"churn script {script.name} cycles over the replicas other than "
                         "the first, and the run has 1 replica")
    return [(r, s) for s in range(stages) for r in range(1, replicas)]


def _generated(g: ChurnGenerator, seed: int, cells: list[tuple[int, int]]
               ) -> Iterator[tuple[PlannedEvent, float | None]]:
    rng = random.Random(seed if g.seed is None else g.seed)
    first = g.every_s if g.first_s is None else g.first_s
    for k in range(MAX_EVENTS):
        at = first + k * g.every_s
        if g.jitter_s:
            at = max(0.0, at + rng.uniform(-g.jitter_s, g.jitter_s))
        if g.until_s is not None and at > g.until_s:
            return
        replica, stage = cells[k % len(cells)]
        yield PlannedEvent(round(at, 3), g.action, None, replica, stage), g.restart_after_s


def _spot(rows: list[SpotRow], restart: float | None, cells: list[tuple[int, int]]
          ) -> Iterator[tuple[PlannedEvent, float | None]]:
    turn = 0
    for row in rows:
        if row.fellow is None and row.replica is None:
            replica, stage = cells[turn % len(cells)]
            turn += 1
            yield PlannedEvent(row.at_s, "kill", None, replica, stage), restart
        else:
            yield PlannedEvent(row.at_s, "kill", row.fellow, row.replica, 0), restart


def _merged(primary: Iterator[tuple[PlannedEvent, float | None]]) -> Iterator[PlannedEvent]:
    """The primary events with the restarts they ask for, in time order (a restart at the
    same time as a primary event comes first: it was asked for earlier)."""
    pending: list[tuple[float, int, PlannedEvent]] = []
    index = 0
    for event, restart in primary:
        while pending and pending[0][0] <= event.at_s:
            yield heapq.heappop(pending)[2]
            index += 1
        yield attrs.evolve(event, restart_after_s=restart)
        if restart is not None:
            heapq.heappush(pending, (event.at_s + restart, index, PlannedEvent(
                round(event.at_s + restart, 3), "join", event.fellow, of_event=index)))
        index += 1
    while pending:
        yield heapq.heappop(pending)[2]
