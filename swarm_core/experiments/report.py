"""Reports over run directories: loss by step, by wall time and by bytes sent, and eval loss by
wall time and by bytes sent (the pipeline's and the replicas' sync together), one line per run
drawn in its sync mode's style, plus a summary table; and the compression figure: final eval
loss against wire bytes per step, one point per compression spec, and step time against link
rate, one line per spec, the runs of each setting (seeds, repeats) pooled into a mean with
min-max bars, and final eval loss against wall time, one point per spec and network; its table
adds each spec's planned boundary bytes forward and backward, the ratio to ``none`` and the
codec errors; each run's tokens/s per cell by step with its set-speeds and membership changes
marked (report_cells); and, in the HTML, the predictor's step for each run beside the measured
one (report_predict). HTML is self-contained (inline SVG, no scripts); PNG uses matplotlib."""

from __future__ import annotations

import html
import io
import logging
import math
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeGuard

import attrs

from swarm_core import jsonio
from swarm_core.contract import JobSubmit, link_changes_in_all
from swarm_core.contract.placement import Placement
from swarm_core.experiments import report_predict
from swarm_core.experiments.report_cells import (
    CELLS_TITLE,
    CellSteps,
    cell_steps,
    marks,
    move_mark,
    png_cells,
    svg_cells,
    throughput_by_cell,
)
from swarm_core.experiments.summary import (
    FIELDS,
    MetricsSummary,
    as_summary,
    parse_summary,
)
from swarm_core.experiments.summary import shown as _shown
from swarm_core.paths import atomic_write
from swarm_core.schema import structure

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
           "#e377c2", "#7f7f7f", "#bcbd22"]


class ReportError(ValueError):
    pass


# A line's dash by its run's sync mode (SVG stroke-dasharray, matplotlib linestyle): colour tells
# runs apart, the dash tells modes apart, so every sync mode compares on one chart.
Dash = tuple[str, str | tuple[int, tuple[int, ...]]]
MODE_DASH: dict[str, Dash] = {
    "none": ("", "-"), "dp": ("7,3", "--"), "diloco": ("2,2", ":"),
    "sparseloco": ("7,3,2,3", "-."), "demo": ("1,3", (0, (1, 3)))}


def mode_dash(mode: str) -> Dash:
    """A mode's dash; solid for one without its own (a mode registered since: its runs still
    chart, told apart by colour)."""
    return MODE_DASH.get(mode, MODE_DASH["none"])


@attrs.define
class RunData:
    run_dir: Path
    label: str
    summary: MetricsSummary = attrs.field(converter=as_summary)
    steps: list[float]
    losses: list[float]
    wall: list[float]
    bytes_sent: list[float]  # by each loss: what the pipeline and the sync had sent so far
    # the steps that evaluated: wall time and bytes sent (as above) at each
    eval_losses: list[float] = attrs.field(factory=list)
    eval_wall: list[float] = attrs.field(factory=list)
    eval_bytes: list[float] = attrs.field(factory=list)
    # (step, the last stage's seconds of it) of each step that reported them, in step order
    step_times: list[tuple[int, float]] = attrs.field(factory=list)
    # the steps among those that also evaluated (their time may hold the evaluation's pause)
    eval_steps: set[int] = attrs.field(factory=set)
    # config_resolved.json, for runs whose summary predates a field the figure reads ({} when
    # it is missing or unreadable: it only fills gaps, and its damage hides no run)
    resolved: dict[str, Any] = attrs.field(factory=dict)
    # The fields its summary file did not hold (a run from before them)
    summary_absent: frozenset[str] = frozenset()
    # each cell's own step times (and routed micro-batches), for the per-cell chart
    cells: CellSteps = attrs.field(factory=CellSteps)
    # A swarm job's layout, as it gave it (per stage, its cells' ids; None: a grid)
    layout: Any = None
    # Of a run whose peers moved between stages: its last placement (topology_snapshot.json's
    # ``actual``), which names the fellow of each move; None otherwise or where unreadable
    placement: Placement | None = None

    @property
    def sync_mode(self) -> str:
        """``none`` (one replica; a run from before replicas), else its ``sync.mode``."""
        return self.summary.sync_mode or "none"

    def _setting(self, value: str | None, *resolved_path: str) -> str | None:
        """A text of its setting: from its summary, else (a summary older than the field)
        from its resolved config; None where neither says."""
        if value is None:
            found = _dig(self.resolved, *resolved_path)
            value = found if isinstance(found, str) else None
        return value

    @property
    def compression(self) -> str | None:
        """The boundary spec it ran."""
        return self._setting(self.summary.compression, "job", "model", "compression")

    @property
    def model(self) -> str | None:
        """Its model profile's name."""
        return self._setting(self.summary.model, "job", "model", "name")

    @property
    def network(self) -> str | None:
        """Its network profile's name."""
        return self._setting(self.summary.network_profile, "network_profile", "name")

    @property
    def link_mbps(self) -> float | None:
        """The rate its links were held to: a number of Mbit/s, ``math.inf`` unshaped, None
        when unknown (a summary from before the field, with no readable config beside it)."""
        if FIELDS.link_mbps.name not in self.summary_absent:
            rate = self.summary.link_mbps
        elif isinstance(self.resolved.get("network_profile"), dict):
            rate = link_mbps(self.resolved["network_profile"])
        else:
            return None
        return math.inf if rate is None else float(rate)

    @property
    def mean_step_seconds(self) -> float | None:
        """Mean seconds a step took, leaving out the first (it waits for the neighbours to
        start) and the steps that evaluated, unless nothing else is left."""
        steps = [t for s, t in self.step_times[1:] if s not in self.eval_steps] \
            or [t for _, t in self.step_times]
        return sum(steps) / len(steps) if steps else None


def _dig(obj: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def link_mbps(network: dict[str, Any]) -> float | None:
    """A network profile's (as a sweep's config holds it) link rate in Mbit/s: the narrower of
    its tx and rx limits, else its kernel shaping's rate; None when nothing holds it back."""
    given = [network.get(k) for k in ("tx_mbps", "rx_mbps")]
    rates = [r for r in given if _number(r) and r > 0]
    if rates:
        return float(min(rates))
    tc = network.get("tc_profile")
    rate = tc.get("rate_mbit") if isinstance(tc, dict) else None
    return float(rate) if _number(rate) and rate > 0 else None


def _number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


# The leader keeps steps, times and byte counts as int64, and training computes losses in
# float32 at the widest: a number beyond these came from no run (and near the float limit it
# overflows the charts' arithmetic, matplotlib's included).
_INT64_MAX = 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38


def _counter(v: Any) -> bool:
    return _number(v) and 0 <= v <= _INT64_MAX


def _loss(v: Any) -> bool:
    return _number(v) and abs(v) <= _FLOAT32_MAX


# What the report reads from each train_progress.ndjson record, where it is not null.
_RECORD_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (_counter, "a number from 0 to 2**63-1"),
    "loss": (_loss, "a number within float32's range"),
    "ts": (_counter, "a number from 0 to 2**63-1"),
    "wire_bytes": (_counter, "a number from 0 to 2**63-1"),
    "sync_bytes": (_counter, "a number from 0 to 2**63-1"),
    "step_seconds": (_counter, "a number from 0 to 2**63-1"),
    "eval_loss": (_loss, "a number within float32's range"),
}


def _wrong_field(obj: dict[str, Any], fields: dict[str, tuple[Callable[[Any], bool], str]]
                 ) -> str | None:
    """The first field of ``obj`` that is not what ``fields`` says, as "x is 1, not a y"."""
    for key, (ok, what) in fields.items():
        v = obj.get(key)
        if v is not None and not ok(v):
            return f"{key} is {_shown(v)}, not {what}"
    return None


def read_summary(d: Path) -> MetricsSummary:
    """A run directory's ``metrics_summary.json``, read into its class: its files are input
    (half-written, hand-edited, from an older version), so ReportError names the file and what
    is wrong in it, and no damage reaches a renderer or a table as an exception of theirs.
    The sweep's and the suite's closing tables read it here too."""
    return _read_summary(d)[0]


def _read_summary(d: Path) -> tuple[MetricsSummary, frozenset[str]]:
    """As read_summary, with the fields the file did not hold."""
    try:
        raw = (d / "metrics_summary.json").read_bytes()
    except FileNotFoundError:
        raise ReportError(f"{d}: not a finished run directory (missing "
                          "metrics_summary.json)") from None
    except NotADirectoryError:
        raise ReportError(f"{d}: not a directory (give run directories, or a folder of "
                          "them)") from None
    except OSError as exc:
        raise ReportError(f"{exc.filename}: cannot read: {exc.strerror}") from None
    try:
        summary = jsonio.loads(raw)
    except jsonio.JSONDecodeError as exc:
        raise ReportError(f"{d}/metrics_summary.json is not valid JSON: {exc}") from None
    if not isinstance(summary, dict):
        raise ReportError(f"{d}/metrics_summary.json holds {_shown(summary)}, not a JSON "
                          "object")
    try:
        return parse_summary(summary)
    except ValueError as exc:
        raise ReportError(f"{d}/metrics_summary.json: {exc}") from None


def read_records(d: Path) -> list[dict[str, Any]]:
    """A run directory's ``train_progress.ndjson`` as records, each field read checked."""
    try:
        lines = (d / "train_progress.ndjson").read_bytes().splitlines()
    except FileNotFoundError:
        raise ReportError(f"{d}: not a finished run directory (missing "
                          "train_progress.ndjson)") from None
    except OSError as exc:
        raise ReportError(f"{exc.filename}: cannot read: {exc.strerror}") from None
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{d}/train_progress.ndjson line {i + 1}"
        try:
            rec = jsonio.loads(line)
        except jsonio.JSONDecodeError:
            raise ReportError(f"{where} is not JSON") from None
        if not isinstance(rec, dict):
            raise ReportError(f"{where} holds {_shown(rec)}, not a JSON object")
        wrong = _wrong_field(rec, _RECORD_FIELDS)
        if wrong:
            raise ReportError(f"{where}: {wrong}")
        if rec.get("loss") is not None and rec.get("step") is None:
            raise ReportError(f"{where} has a loss but no step")
        records.append(rec)
    return records


def load_run(d: Path) -> RunData:
    """One run directory's summary and loss curves (ReportError for damage, as above)."""
    summary, absent = _read_summary(d)
    records = read_records(d)
    steps, losses, wall, sent = [], [], [], []
    evals: tuple[list[float], list[float], list[float]] = ([], [], [])
    times: list[tuple[int, float]] = []
    eval_steps: set[int] = set()
    total = 0.0
    t0 = None
    for rec in records:
        # (what the link carried: the pipeline's frames and the stage groups' sync alike)
        total += (rec.get("wire_bytes") or 0) + (rec.get("sync_bytes") or 0)
        ts = rec.get("ts") or 0.0
        if rec.get("loss") is not None:
            t0 = ts if t0 is None else t0
            steps.append(rec["step"])
            losses.append(rec["loss"])
            wall.append(ts - t0)
            sent.append(total)
        if rec.get("eval_loss") is not None:
            t0 = ts if t0 is None else t0
            for series, v in zip(evals, (rec["eval_loss"], ts - t0, total), strict=True):
                series.append(v)
            if rec.get("step") is not None:
                eval_steps.add(rec["step"])
        if rec.get("step_seconds") is not None and rec.get("step") is not None:
            times.append((rec["step"], float(rec["step_seconds"])))
    label = summary.run_id or d.name or d.resolve().name
    parts = label.split("-")
    if len(parts) > 4:  # <stamp>-<experiment>-<index>-<run name>: keep what tells runs apart
        label = "-".join(parts[3:])
    return RunData(d, label, summary, steps, losses, wall, sent, *evals, step_times=times,
                   eval_steps=eval_steps, resolved=_read_resolved(d, absent),
                   summary_absent=absent, cells=cell_steps(records),
                   layout=_read_layout(d) if summary.wiring == "swarm" else None,
                   placement=_read_placement(d) if any(
                       c.moved is not None for c in summary.membership or []) else None)


# What the compression figure reads of a run's setting; a summary lacking one is older than it
_SETTING_FIELDS = frozenset(f.name for f in (FIELDS.compression, FIELDS.network_profile,
                                             FIELDS.model, FIELDS.link_mbps))


def _read_resolved(d: Path, absent: frozenset[str]) -> dict[str, Any]:
    """The run's ``config_resolved.json`` where its summary lacks a field of the figure's, so
    runs written before the summary held them still take their place on it; {} when it is not
    needed, missing or damaged (it fills gaps only: such a run is left off the figure, and
    stays in every other chart and the table)."""
    if not _SETTING_FIELDS & absent:
        return {}
    try:
        resolved = jsonio.loads((d / "config_resolved.json").read_bytes())
    except (OSError, jsonio.JSONDecodeError):
        return {}
    return resolved if isinstance(resolved, dict) else {}


def _read_layout(d: Path) -> Any:
    """The layout a swarm run's job gave (``config_resolved.json``'s
    ``job.topology.layout``); None for a grid, or where the file is missing or damaged."""
    try:
        resolved = jsonio.loads((d / "config_resolved.json").read_bytes())
    except (OSError, jsonio.JSONDecodeError):
        return None
    return _dig(resolved, "job", "topology", "layout")


def _read_placement(d: Path) -> Placement | None:
    """The run's last placement (``topology_snapshot.json``'s ``actual``); None where the
    file is missing or damaged (the marks then name no fellow)."""
    try:
        actual = _dig(jsonio.loads((d / "topology_snapshot.json").read_bytes()), "actual")
        return None if actual is None else structure(actual, Placement)
    except (OSError, ValueError):
        return None


def find_run_dirs(paths: list[Path]) -> list[Path]:
    """The run directories the command line names: each path itself, or, for a folder that is
    not one, the finished runs in it (a sweep's runs_dir). ReportError for a path that is not
    there or not a directory: a mistyped argument, not a damaged run."""
    dirs: list[Path] = []
    for p in paths:
        try:
            if not p.is_dir():
                what = "not a directory" if p.exists() else "no such directory"
                raise ReportError(f"{p}: {what} (give run directories, or a folder of them)")
            found = [] if (p / "metrics_summary.json").exists() else \
                sorted(s.parent for s in p.glob("*/metrics_summary.json"))
        except OSError as exc:
            raise ReportError(f"{p}: cannot read: {exc.strerror}") from None
        # A folder with no finished run in it stays, for load_run to say what it lacks.
        dirs += found or [p]
    return dirs


def load_runs(dirs: list[Path]) -> tuple[list[RunData], list[tuple[Path, str]]]:
    """The runs that could be read, and each other with why it could not: one damaged run in
    a sweep should not keep the others out of the report."""
    runs: list[RunData] = []
    unreadable: list[tuple[Path, str]] = []
    for d in dirs:
        try:
            runs.append(load_run(d))
        except ReportError as exc:
            unreadable.append((d, str(exc)))
    return runs, unreadable


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def summary_rows(runs: list[RunData]) -> list[list[str]]:
    rows = []
    for r in runs:
        s = r.summary
        rows.append([r.label, s.status or "-", _grid(s, _layout(r)), _sync(r),
                     _fmt(s.inner_steps, "d"), _fmt(s.final_loss, ".4f"),
                     _fmt(s.eval_loss, ".4f"), _fmt(s.tokens_per_s, ".0f"),
                     _fmt(s.wire_bytes_per_step, ",.0f"), _fmt(s.sync_bytes_per_step, ",.0f"),
                     _fmt(s.compression_ratio, ".1f"), _codec_error(s), _most_waiting(s),
                     _link_set(s)])
    return rows


def _grid(summary: MetricsSummary | Mapping[str, Any], layout: Any = None) -> str:
    """``stages x replicas`` ("2x2"; routed, "2x2 swarm" or "2x2 swarm measured"); a swarm
    layout's (``layout``: per stage, its cells' ids, as the job gave it) "2 stages, cells
    1+3"; then who left or joined (replicas "r1 left @5", a swarm job's cells "c1.1 left
    @5"), and the peers that moved between stages ("0.1->1.2 @6"); "-" for a run from
    before the summary said."""
    s = as_summary(summary)
    if s.stages is None or s.replicas is None:
        return "-"
    changes = s.membership or []
    moved = [f"r{','.join(map(str, c.left))} left @{c.step}" for c in changes if c.left]
    moved += [f"c{c.cells_text()} left @{c.step}" for c in changes if c.cells_left]
    moved += [f"r{','.join(map(str, c.joined))} joined @{c.step}" for c in changes if c.joined]
    moved += [f"{move_mark(c.moved)} @{c.step}" for c in changes if c.moved is not None]
    shape = f"{s.stages}x{s.replicas}"
    if s.wiring == "swarm":  # (a sweep's wiring axis: chain and swarm runs of one grid apart)
        shape += " swarm" + (" measured" if s.routing == "measured" else "")
    if isinstance(layout, list) and layout and all(isinstance(ids, list) for ids in layout):
        shape = f"{len(layout)} stages, cells {'+'.join(str(len(ids)) for ids in layout)}"
    return shape + (f" ({'; '.join(moved)})" if moved else "")


def _layout(run: RunData) -> Any:
    """The layout the run's job gave, or None: a grid."""
    return run.layout


def _sync(run: RunData, period: bool = False) -> str:
    """The sync mode and what a sweep varies of it: SparseLoCo's density ("sparseloco
    d=0.02"), DeMo's top-k, the codec where it codes ("dp int8"), fragments, DiLoCo's overlap
    ("diloco overlap 5"), an inner optimizer other than AdamW ("sparseloco d=1 muon");
    with ``period``, a periodic mode's inner steps after the mode ("diloco H=10", which the
    table gives a column of its own)."""
    return " ".join(_sync_items(run, period))


def _sync_items(run: RunData, period: bool = False) -> tuple[str, ...]:
    """:func:`_sync`'s items ("4 fragments" is one)."""
    s = run.summary
    words = [run.sync_mode]
    if period and s.inner_steps:
        words.append(f"H={s.inner_steps}")
    if s.sync_density is not None:
        words.append(f"d={s.sync_density:g}")
    if s.sync_topk is not None:
        words.append(f"top{s.sync_topk}")
    if s.sync_compression not in (None, "none"):
        words.append(str(s.sync_compression))
    if s.sync_fragments is not None and s.sync_fragments > 1:
        words.append(f"{s.sync_fragments} fragments")
    if s.overlap_steps:
        words.append(f"overlap {s.overlap_steps}")
    if s.optimizer not in (None, "adamw"):
        words.append(str(s.optimizer))
    return tuple(words)


def _link_set(summary: MetricsSummary, shown: int = 3) -> str:
    """The steps at which a set-speed changed a fellow's link mid-run ("@12 @30"; past
    ``shown``, the first and the last of them and how many: "@12 … @95 (40 in all)"): such a
    run did not run on its network profile throughout. (The record keeps the first and the
    newest, so only those two ends are sure to be there.)"""
    steps = [c.at_step for c in summary.link_changes or []]
    if not steps:
        return "-"
    total = link_changes_in_all(steps, summary.link_changes_total)
    if total <= shown:
        return " ".join(f"@{s}" for s in steps)
    return f"@{steps[0]} … @{steps[-1]} ({total} in all)"


def _codec_error(summary: MetricsSummary) -> str:
    """The largest mean relative error a stage's wire codec put on the activations it sent."""
    errors = [e.act for e in summary.codec_error_by_stage or []
              if e is not None and e.act is not None]
    return f"{max(errors):.2%}" if errors else "-"


def _most_waiting(summary: MetricsSummary) -> str:
    """The stage that sat blocked on its links the longest: "38% (s1)"."""
    shares = [(w, k) for k, w in enumerate(summary.wait_fraction_by_stage or [])
              if w is not None]
    if not shares:
        return "-"
    w, k = max(shares)
    return f"{w:.0%} (s{k})"


HEADERS = ["run", "status", "grid", "sync", "inner steps", "final loss", "eval loss",
           "tokens/s", "bytes/step", "sync bytes/step", "compression", "act error",
           "link wait", "link set"]

# (title, x label, x series, y series, y label) of each chart, in both renderings. The eval
# charts answer the question replicas raise: which sync mode reaches a loss sooner, and with
# fewer bytes on the link (a point per evaluation: with eval_every 0, one, at the end).
CHARTS = [
    ("loss by step", "step", "steps", "losses", "loss"),
    ("loss by wall time", "seconds", "wall", "losses", "loss"),
    ("loss by bytes sent", "bytes on the wire (pipeline + sync)", "bytes_sent", "losses",
     "loss"),
    ("eval loss by wall time", "seconds", "eval_wall", "eval_losses", "eval loss"),
    ("eval loss by bytes sent", "bytes on the wire (pipeline + sync)", "eval_bytes",
     "eval_losses", "eval loss"),
]


# --- the compression figure --------------------------------------------------------------------
# (title, x label, y label) of its two charts, in both renderings.
FIGURE_LOSS = ("eval loss by wire bytes per step", "bytes on the wire per step (pipeline + "
               "sync), log scale", "final eval loss")
FIGURE_STEP = ("step time by link rate", "link rate (Mbit/s), log scale", "seconds per step")
# The frontier's other axis: what a spec's loss costs in time on its links (one point per
# setting and network profile).
FIGURE_WALL = ("eval loss by wall time", "run wall time (s), log scale", "final eval loss")
UNSHAPED = "unshaped"


@attrs.frozen
class FigurePoint:
    """One point of the figure: the runs of one setting pooled (seeds and repeats; for the
    loss chart, network profiles too, which change how long a step takes but not what it
    computes): their mean and the extremes of ``y``, as error bars."""

    series: str  # the setting's label: its spec, and what else varies among the settings
    x: float  # mean; for the step-time chart the link rate, math.inf unshaped
    y: float  # mean
    y_min: float
    y_max: float
    runs: int
    network: str | None = None  # the step-time chart's points: the profile they ran on


# model, spec, grid, sync items (with the inner steps), variant, start
Setting = tuple[str, str, str, tuple[str, ...], str, str]


def _setting(run: RunData) -> Setting:
    """What a figure series stands for: model, spec, grid, sync (with its inner steps: H=10
    and H=50 are two settings), the sweep's variant, the weights it started from (a warm
    start's and a scratch run's are two settings); not seed, repeat or network."""
    warm = run.summary.warm_start
    return (run.model or "-", run.compression or "-", _grid(run.summary, _layout(run)),
            _sync_items(run, period=True), run.summary.variant or "-",
            "scratch" if warm is None else f"from {warm}")


def _series_labels(settings: list[Setting]) -> dict[Setting, str]:
    """Each setting named by its spec, then by whichever of variant, start, model, grid and
    sync differ among the settings: a plain compression sweep reads "fixed_int8", not "m
    fixed_int8 2x1 none". Of the sync, what the variant's name says already is left out
    ("dp-muon", not "dp-muon dp muon"), unless that makes two labels one."""
    varies = [len({s[i] for s in settings}) > 1 for i in range(6)]

    def label(s: Setting, brief: bool) -> str:
        said = set(re.split(r"[-_]", s[4])) if brief and varies[4] else set()
        words = [s[1]]
        if varies[4]:
            words.append(s[4])
        words += [part for i, part in ((5, s[5]), (0, s[0]), (2, s[2])) if varies[i]]
        if varies[3]:
            words += [w for w in s[3] if w not in said]
        return " ".join(words)

    labels = {s: label(s, brief=True) for s in settings}
    if len(set(labels.values())) < len(labels):
        labels = {s: label(s, brief=False) for s in settings}
    return labels


def _figure_runs(runs: list[RunData]) -> list[RunData]:
    # A run that failed or was cancelled stopped short: its loss and times are not the spec's.
    return [r for r in runs if r.compression is not None
            and r.summary.status in (None, "COMPLETED")]


def _final_eval(run: RunData) -> float | None:
    v = run.summary.eval_loss
    if v is None and run.eval_losses:
        v = run.eval_losses[-1]
    return float(v) if v is not None and math.isfinite(v) else None


def _bytes_per_step(run: RunData) -> float | None:
    wire = run.summary.wire_bytes_per_step
    if wire is not None:
        sync = run.summary.sync_bytes_per_step
        return float(wire) + (float(sync) if sync is not None else 0.0)
    return None


def _pooled(series: str, xs: list[float], ys: list[float], network: str | None = None
            ) -> FigurePoint:
    return FigurePoint(series, sum(xs) / len(xs), sum(ys) / len(ys), min(ys), max(ys),
                       len(ys), network)


def loss_by_bytes_points(runs: list[RunData]) -> list[FigurePoint]:
    """The loss chart's points: one per setting (in the order its first run comes), x its
    runs' mean wire bytes per step, y their final eval loss. Runs lacking either figure (or
    sending nothing: one stage, which has no boundary to compress), or whose spec is unknown,
    are left out."""
    groups: dict[Setting, tuple[list[float], list[float]]] = {}
    labels = _series_labels(list(dict.fromkeys(_setting(r) for r in _figure_runs(runs))))
    for r in _figure_runs(runs):
        x, y = _bytes_per_step(r), _final_eval(r)
        if x is None or y is None or x <= 0:
            continue
        xs, ys = groups.setdefault(_setting(r), ([], []))
        xs.append(x)
        ys.append(y)
    return [_pooled(labels[k], xs, ys) for k, (xs, ys) in groups.items()]


def loss_by_wall_points(runs: list[RunData]) -> list[FigurePoint]:
    """The wall-time chart's points: one per setting and network profile (shaping changes the
    time, not the loss), x its runs' mean wall time, y their final eval loss. Runs lacking
    either are left out."""
    groups: dict[tuple[Setting, str], tuple[list[float], list[float]]] = {}
    labels = _series_labels(list(dict.fromkeys(_setting(r) for r in _figure_runs(runs))))
    for r in _figure_runs(runs):
        x, y = r.summary.wall_time_s, _final_eval(r)
        if x is None or y is None or not x > 0 or not math.isfinite(x):
            continue
        xs, ys = groups.setdefault((_setting(r), r.network or "-"), ([], []))
        xs.append(float(x))
        ys.append(y)
    return [_pooled(labels[k], xs, ys, net) for (k, net), (xs, ys) in groups.items()]


def boundary_figures(runs: list[RunData]) -> dict[str, list[float | None]]:
    """Per figure series (its label): the boundary's planned ACT and GRAD bytes per step,
    fp32 ``none``'s over them, and the largest stage's mean codec error each way (relative
    L2 of what the receiver decoded), the means over the series' runs (None: no run said)."""
    labels = _series_labels(list(dict.fromkeys(_setting(r) for r in _figure_runs(runs))))
    values: dict[str, list[list[float]]] = {}
    for r in _figure_runs(runs):
        s = r.summary
        errors = [e for e in s.codec_error_by_stage or [] if e is not None]
        act = [e.act for e in errors if e.act is not None]
        grad = [e.grad for e in errors if e.grad is not None]
        got = (s.act_bytes_per_step, s.grad_bytes_per_step, s.boundary_ratio,
               max(act) if act else None, max(grad) if grad else None)
        cols = values.setdefault(labels[_setting(r)], [[] for _ in got])
        for col, v in zip(cols, got, strict=True):
            if v is not None and math.isfinite(v):
                col.append(float(v))
    return {k: [sum(c) / len(c) if c else None for c in cols] for k, cols in values.items()}


BOUNDARY_HEADERS = ["ACT B/step", "GRAD B/step", "none/this", "act error", "grad error"]


def step_by_link_points(runs: list[RunData]) -> list[FigurePoint]:
    """The step-time chart's points: one per setting and network profile, x the profile's
    link rate (math.inf unshaped), y its runs' mean seconds per step; each setting's points
    in rate order, so they draw as its line. Runs whose rate or step times are unknown are
    left out."""
    groups: dict[tuple[Setting, str], tuple[list[float], list[float]]] = {}
    labels = _series_labels(list(dict.fromkeys(_setting(r) for r in _figure_runs(runs))))
    for r in _figure_runs(runs):
        rate, y = r.link_mbps, r.mean_step_seconds
        if rate is None or y is None:
            continue
        xs, ys = groups.setdefault((_setting(r), r.network or "-"), ([], []))
        xs.append(rate)
        ys.append(y)
    order = {k: i for i, k in enumerate(dict.fromkeys(k for k, _ in groups))}
    points = [_pooled(labels[k], xs, ys, net) for (k, net), (xs, ys) in groups.items()]
    series_of = {labels[k]: i for k, i in order.items()}
    return sorted(points, key=lambda p: (series_of[p.series], p.x))


def _series_colours(points: list[FigurePoint]) -> dict[str, str]:
    """A colour per series, the same in both charts of the figure (the loss chart's order)."""
    names = list(dict.fromkeys(p.series for p in points))
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


def _log_positions(points: list[FigurePoint]) -> tuple[dict[float, float], list[tuple[float,
                                                                                        str]]]:
    """log10 of each x, with unshaped a decade past the fastest rate (or at 0 alone); and the
    ticks: every rate that has a point, then "unshaped"."""
    rates = sorted({p.x for p in points if math.isfinite(p.x)})
    pos = {r: math.log10(r) for r in rates}
    if any(not math.isfinite(p.x) for p in points):
        pos[math.inf] = (pos[rates[-1]] + 1) if rates else 0.0
    ticks = [(pos[r], _short(r)) for r in rates]
    if math.inf in pos:
        ticks.append((pos[math.inf], UNSHAPED))
    return pos, ticks


def _svg_figure(title: str, xlabel: str, ylabel: str, points: list[FigurePoint],
                colours: dict[str, str], connect: bool) -> str:
    """A chart of pooled points on a log x axis, each with its min-max bar; ``connect`` joins
    each series' points in order (the step-time chart's lines)."""
    w, h, ml, mr, mt, mb = SVG_BOX
    if not points:
        return f"<svg width='{w}' height='{h}'><text x='10' y='20'>{title}: no data</text></svg>"
    if connect:
        pos, ticks = _log_positions(points)
    else:
        pos = {p.x: math.log10(p.x) for p in points}
        lo, hi = min(pos.values()), max(pos.values())
        span = hi - lo
        ticks = [(lo + span * i / 4, _short(10 ** (lo + span * i / 4))) for i in range(5)] \
            if span else [(lo, _short(10 ** lo))]
    x0, x1 = min(pos.values()), max(pos.values())
    pad_x = (x1 - x0) * 0.08 or 0.5
    x0, x1 = x0 - pad_x, x1 + pad_x
    y0, y1 = min(p.y_min for p in points), max(p.y_max for p in points)
    pad_y = (y1 - y0) * 0.08 or max(abs(y0) * 0.05, 0.05)
    y0, y1 = y0 - pad_y, y1 + pad_y

    def px(x: float) -> float:
        return ml + (pos[x] - x0) / (x1 - x0) * (w - ml - mr)

    def tx(v: float) -> float:
        return ml + (v - x0) / (x1 - x0) * (w - ml - mr)

    def py(y: float) -> float:
        return mt + (1 - (y - y0) / (y1 - y0)) * (h - mt - mb)

    out = _svg_frame(title, w, h, ml, mr, mt, mb)
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        out.append(f"<text x='{ml - 5}' y='{py(yv) + 4:.1f}' text-anchor='end'>"
                   f"{_tick(yv, y1 - y0)}</text>")
    for v, text in ticks:
        out.append(f"<text x='{tx(v):.1f}' y='{h - mb + 15}' text-anchor='middle'>"
                   f"{html.escape(text)}</text>")
    out.append(f"<text x='{w / 2}' y='{h - 8}' text-anchor='middle'>{xlabel}</text>")
    out.append(f"<text x='14' y='{h / 2}' transform='rotate(-90 14 {h / 2})' "
               f"text-anchor='middle'>{ylabel}</text>")
    for name, colour in colours.items():
        mine = [p for p in points if p.series == name]
        if connect and len(mine) > 1:
            pts = " ".join(f"{px(p.x):.1f},{py(p.y):.1f}" for p in mine)
            out.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' "
                       f"points='{pts}'/>")
        for p in mine:
            x = px(p.x)
            tip = html.escape(f"{p.series}{' on ' + p.network if p.network else ''}: "
                              f"{p.y:.4g} (min {p.y_min:.4g}, max {p.y_max:.4g}, "
                              f"{p.runs} run(s))")
            out.append(f"<g class='bar'><title>{tip}</title>"
                       f"<line x1='{x:.1f}' y1='{py(p.y_min):.1f}' x2='{x:.1f}' "
                       f"y2='{py(p.y_max):.1f}' stroke='{colour}'/>"
                       + "".join(f"<line x1='{x - 4:.1f}' y1='{py(e):.1f}' x2='{x + 4:.1f}' "
                                 f"y2='{py(e):.1f}' stroke='{colour}'/>"
                                 for e in (p.y_min, p.y_max))
                       + f"<rect x='{x - 3:.1f}' y='{py(p.y) - 3:.1f}' width='6' height='6' "
                       f"fill='{colour}'/></g>")
    out.append("</svg>")
    return "".join(out)


def _tick(v: float, span: float) -> str:
    """A y tick with the digits its chart's span needs (losses of 2.38 and 2.39 apart)."""
    digits = max(2, 1 - math.floor(math.log10(span))) if span > 0 else 2
    return f"{v:.{min(digits, 6)}f}"


def figure_rows(loss: list[FigurePoint], step: list[FigurePoint],
                boundary: Mapping[str, list[float | None]] | None = None
                ) -> tuple[list[str], list[list[str]]]:
    """The figure as a table: a row per series (runs pooled, bytes per step, eval loss with
    its min and max), and its mean seconds per step on each network profile; given
    ``boundary`` (``boundary_figures``), its planned bytes each way, the ratio to ``none``
    and the codec errors after them."""
    networks = list(dict.fromkeys(p.network or "-" for p in step))
    headers = ["series", "runs", "bytes/step", "eval loss", "eval min", "eval max",
               *(f"s/step {n}" for n in networks),
               *(BOUNDARY_HEADERS if boundary is not None else [])]
    names = list(dict.fromkeys([p.series for p in loss] + [p.series for p in step]))
    rows = []
    for name in names:
        lp = next((p for p in loss if p.series == name), None)
        times = {p.network or "-": p.y for p in step if p.series == name}
        rows.append([name, str(lp.runs) if lp else "-",
                     _fmt(lp.x if lp else None, ",.0f"), _fmt(lp.y if lp else None, ".4f"),
                     _fmt(lp.y_min if lp else None, ".4f"), _fmt(lp.y_max if lp else None,
                                                                 ".4f"),
                     *(_fmt(times.get(n), ".3f") for n in networks)])
        if boundary is not None:
            act, grad, ratio, e_act, e_grad = boundary.get(name) or [None] * 5
            rows[-1] += [_fmt(act, ",.0f"), _fmt(grad, ",.0f"), _fmt(ratio, ".1f"),
                         _fmt(e_act, ".4f"), _fmt(e_grad, ".4f")]
    return headers, rows


def _html_figure(runs: list[RunData]) -> str:
    loss, step = loss_by_bytes_points(runs), step_by_link_points(runs)
    wall = loss_by_wall_points(runs)
    colours = _series_colours(loss + step + wall)
    charts = _svg_figure(*FIGURE_LOSS, loss, colours, connect=False) + \
        _svg_figure(*FIGURE_STEP, step, colours, connect=True) + \
        _svg_figure(*FIGURE_WALL, wall, colours, connect=False)
    legend = "".join(
        f"<li><svg width='10' height='10'><rect width='10' height='10' fill='{c}'/></svg> "
        f"{html.escape(n)}</li>" for n, c in colours.items())
    headers, rows = figure_rows(loss, step, boundary_figures(runs))
    table = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>" + \
        "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                for row in rows)
    return ("<h2>Compression figure</h2><p>One point per setting: the mean of its runs "
            "(seeds, repeats; the loss chart pools network profiles too), bars from the "
            "lowest to the highest. Step time leaves out each run's first step and its "
            "evaluations.</p>"
            f"<div>{charts}</div><ul>{legend}</ul><table>{table}</table>")


# Every SVG chart's size and margins (left, right, top, bottom), in pixels.
SVG_BOX = (520, 300, 60, 15, 30, 45)


def _svg_frame(title: str, w: int, h: int, ml: int, mr: int, mt: int, mb: int) -> list[str]:
    """An SVG chart's opening: the canvas, its title, the plot area's frame (margins left,
    right, top, bottom)."""
    return [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' "
            f"font-family='sans-serif' font-size='11'>",
            f"<text x='{w / 2}' y='16' text-anchor='middle' font-size='13'>{title}</text>",
            f"<rect x='{ml}' y='{mt}' width='{w - ml - mr}' height='{h - mt - mb}' "
            "fill='none' stroke='#999'/>"]


def _svg_chart(title: str, xlabel: str, runs: list[RunData], xs_of: str,
               ys_of: str = "losses", ylabel: str = "loss") -> str:
    w, h, ml, mr, mt, mb = SVG_BOX
    series = [(getattr(r, xs_of), getattr(r, ys_of)) for r in runs]
    points = ys_of != "losses"  # (evaluations are few: each is marked)
    all_x = [x for xs, _ in series for x in xs]
    all_y = [y for _, ys in series for y in ys]
    if not all_x:
        return f"<svg width='{w}' height='{h}'><text x='10' y='20'>{title}: no data</text></svg>"
    x0, x1 = min(all_x), max(all_x) or 1.0
    y0, y1 = min(all_y), max(all_y)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1

    def px(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * (w - ml - mr)

    def py(y: float) -> float:
        return mt + (1 - (y - y0) / (y1 - y0)) * (h - mt - mb)

    out = _svg_frame(title, w, h, ml, mr, mt, mb)
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        xv = x0 + (x1 - x0) * i / 4
        out.append(f"<text x='{ml - 5}' y='{py(yv) + 4:.1f}' text-anchor='end'>{yv:.2f}</text>")
        out.append(f"<text x='{px(xv):.1f}' y='{h - mb + 15}' text-anchor='middle'>"
                   f"{_short(xv)}</text>")
    out.append(f"<text x='{w / 2}' y='{h - 8}' text-anchor='middle'>{xlabel}</text>")
    out.append(f"<text x='14' y='{h / 2}' transform='rotate(-90 14 {h / 2})' "
               f"text-anchor='middle'>{ylabel}</text>")
    for i, ((xs, ys), run) in enumerate(zip(series, runs, strict=True)):
        color = PALETTE[i % len(PALETTE)]
        dash = mode_dash(run.sync_mode)[0]
        if len(xs) > 1 or not points:
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
            out.append(f"<polyline fill='none' stroke='{color}' stroke-width='1.5' "
                       + (f"stroke-dasharray='{dash}' " if dash else "") + f"points='{pts}'/>")
        if points:
            out += [f"<circle cx='{px(x):.1f}' cy='{py(y):.1f}' r='3' fill='{color}'/>"
                    for x, y in zip(xs, ys, strict=True)]
    out.append("</svg>")
    return "".join(out)


def _legend_entry(i: int, run: RunData) -> str:
    """A run's colour in its sync mode's dash, its name and its mode."""
    dash = mode_dash(run.sync_mode)[0]
    sample = (f"<svg width='28' height='8'><line x1='0' y1='4' x2='28' y2='4' "
              f"stroke='{PALETTE[i % len(PALETTE)]}' stroke-width='2'"
              + (f" stroke-dasharray='{dash}'" if dash else "") + "/></svg>")
    return f"<li>{sample} {html.escape(run.label)} ({run.sync_mode})</li>"


def _short(v: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.1f}"


def cell_throughput(run: RunData) -> dict[str, list[tuple[int, float]]]:
    """The run's tokens/s per cell by step (see report_cells): its tokens from its resolved
    job where the folder holds one, else from its records."""
    job: JobSubmit | None
    try:
        job = report_predict.resolved_job(report_predict.read_resolved(run.run_dir))
    except ValueError:
        job = None
    return throughput_by_cell(run.cells, job, run.summary.replicas or 1)


def _html_cells(runs: list[RunData]) -> str:
    charts = "".join(svg_cells(f"{r.label}: {CELLS_TITLE}", cell_throughput(r),
                               marks(r.summary, r.placement), PALETTE, SVG_BOX) for r in runs)
    return ("<h2 id='cells'>Throughput per cell</h2><p>Each cell's tokens per second, step "
            "by step, over its own step time; dashed lines mark the steps from which a "
            "set-speed (link, emulated slowdown) or a membership change (left, joined, "
            f"rebalanced) took effect.</p><div>{charts}</div>")


def render_html(runs: list[RunData], calibration: Path | None = None,
                calibrate: bool = False) -> str:
    """The report page. Its predictor section reads stage times from ``calibration`` (the
    machine's cache by default); ``calibrate`` measures the stages it lacks."""
    predicted = [report_predict.predict_dir(r.run_dir, r.label, r.mean_step_seconds,
                                            calibration, calibrate,
                                            r.summary.emulated_slowdown_by_cell)
                 for r in runs]
    legend = "".join(_legend_entry(i, r) for i, r in enumerate(runs))
    table = "<tr>" + "".join(f"<th>{h}</th>" for h in HEADERS) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
        for row in summary_rows(runs))
    charts = "".join(_svg_chart(t, xl, runs, xs, ys, yl) for t, xl, xs, ys, yl in CHARTS)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>SilentSwarm report"
            "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:"
            "collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
            "td:first-child{text-align:left}ul{list-style:none;padding:0}</style></head><body>"
            f"<h1>SilentSwarm report: {len(runs)} run(s)</h1><div>{charts}</div>"
            f"<ul>{legend}</ul><table>{table}</table>{_html_figure(runs)}"
            f"{_html_cells(runs)}{report_predict.html_section(predicted)}"
            f"<p>Sources: {', '.join(html.escape(str(r.run_dir)) for r in runs)}</p>"
            "</body></html>\n")


def render_png(runs: list[RunData]) -> bytes:
    # A first import on a fresh machine says it builds a font cache (and where it cannot
    # write one): notes, not errors, and stderr is for errors.
    mpl_log = logging.getLogger("matplotlib")
    level = mpl_log.level
    mpl_log.setLevel(logging.ERROR)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("PNG reports need matplotlib: pip install 'silentswarm[report]' "
                          "(or write .html)") from None
    finally:
        mpl_log.setLevel(level)
    fig, grid = plt.subplots(2, 5, figsize=PNG_SIZE)
    axes = list(grid.flat)
    for ax, (title, xl, xs, ys, yl) in zip(axes, CHARTS, strict=False):
        for i, r in enumerate(runs):
            ax.plot(getattr(r, xs), getattr(r, ys), color=PALETTE[i % len(PALETTE)],
                    linewidth=1.2, linestyle=mode_dash(r.sync_mode)[1],
                    marker="o" if ys != "losses" else None, markersize=4)
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    _png_figure(axes[len(CHARTS)], axes[len(CHARTS) + 1], runs, axes[len(CHARTS) + 2])
    png_cells(axes[len(CHARTS) + 3],
              [(r.label, cell_throughput(r), marks(r.summary, r.placement)) for r in runs],
              PALETTE)
    for ax in axes[len(CHARTS) + 4:-1]:
        ax.axis("off")
    # The last panel holds the legend: every run, in its colour and its sync mode's dash.
    # Labels are run names, not markup: given to the legend (matplotlib hides a line's own
    # label that starts with "_"), and not read as mathtext ("$" in a name).
    axes[-1].axis("off")
    legend = axes[-1].legend(axes[0].get_lines(), [f"{r.label} ({r.sync_mode})" for r in runs],
                             fontsize=7, loc="upper left")
    for text in legend.get_texts():
        text.set_parse_math(False)
    out = io.BytesIO()
    with warnings.catch_warnings():
        # A name in a script the font lacks shows as boxes in the picture; matplotlib's
        # warning about it is noise on a swarm command's stderr.
        warnings.filterwarnings("ignore", message="Glyph .* missing from font")
        fig.tight_layout()
        fig.savefig(out, format="png", dpi=PNG_DPI)
    plt.close(fig)
    return out.getvalue()


def _png_figure(loss_ax: Any, step_ax: Any, runs: list[RunData], wall_ax: Any = None) -> None:
    """The compression figure's panels, as the HTML draws them (``wall_ax``: the wall-time
    chart's, where given)."""
    loss, step = loss_by_bytes_points(runs), step_by_link_points(runs)
    wall = loss_by_wall_points(runs)
    colours = _series_colours(loss + step + wall)
    panels = [(loss_ax, FIGURE_LOSS, loss, False), (step_ax, FIGURE_STEP, step, True)]
    if wall_ax is not None:
        panels.append((wall_ax, FIGURE_WALL, wall, False))
    for ax, (title, xl, yl), points, connect in panels:
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        if not points:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        pos, ticks = _log_positions(points) if connect else (None, None)
        ax.set_xscale("log")
        if pos is None and len({p.x for p in points}) == 1:
            # (one x, e.g. equal wall times: autoscaling it would warn; a decade around it,
            # set before plotting, so x is not autoscaled)
            ax.set_xlim(points[0].x / 3, points[0].x * 3)
        for name, colour in colours.items():
            mine = [p for p in points if p.series == name]
            if not mine:
                continue
            # (unshaped has no rate: it sits a labelled decade past the fastest one)
            ax.errorbar([10 ** pos[p.x] if pos else p.x for p in mine], [p.y for p in mine],
                        yerr=[[p.y - p.y_min for p in mine], [p.y_max - p.y for p in mine]],
                        color=colour, marker="s", markersize=4, capsize=3,
                        linestyle="-" if connect else "none", linewidth=1.2, label=name)
        if ticks is not None:
            ax.set_xticks([10 ** v for v, _ in ticks], [t for _, t in ticks])
            ax.set_xticks([], minor=True)
        legend = ax.legend(fontsize=7)
        for text in legend.get_texts():
            text.set_parse_math(False)


# The PNG's size in inches at PNG_DPI: two rows of five panels (the five run charts, the
# figure's three, the cells' throughput, the legend).
PNG_SIZE = (25.0, 8.4)
PNG_DPI = 120
OUTPUT_SUFFIXES = (".html", ".png")


def write_report(runs: list[RunData], out: Path, calibration: Path | None = None,
                 calibrate: bool = False) -> None:
    """``out`` by its suffix, .html or .png, written atomically (a failure leaves no partial
    file). Its folder is created when missing, as for ``sweep --runs-dir``, ``suite --out`` and
    ``llm-doc --output``. ``calibration`` and ``calibrate``: as render_html's (the HTML's
    predictor section)."""
    if out.suffix not in OUTPUT_SUFFIXES:
        raise ReportError(f"--output must end in .html or .png, got {out.name}")
    data = render_html(runs, calibration, calibrate).encode() if out.suffix == ".html" \
        else render_png(runs)
    try:
        atomic_write(out, data)
    except OSError as exc:
        raise ReportError(f"cannot write {out}: {exc.strerror}") from None
