"""Reports over run directories: loss by step, by wall time and by bytes sent, and eval loss by
wall time and by bytes sent (the pipeline's and the replicas' sync together), one line per run
drawn in its sync mode's style, plus a summary table. HTML is self-contained (inline SVG, no
scripts); PNG uses matplotlib."""

from __future__ import annotations

import html
import io
import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from swarm_core import jsonio
from swarm_core.contract import link_changes_in_all
from swarm_core.paths import atomic_write

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
           "#e377c2", "#7f7f7f", "#bcbd22"]


class ReportError(ValueError):
    pass


SYNC_MODES = ("none", "dp", "diloco")
# A line's dash by its run's sync mode (SVG stroke-dasharray, matplotlib linestyle): colour tells
# runs apart, the dash tells modes apart, so dp and diloco compare on one chart.
MODE_DASH = {"none": ("", "-"), "dp": ("7,3", "--"), "diloco": ("2,2", ":")}


@attrs.define
class RunData:
    run_dir: Path
    label: str
    summary: dict[str, Any]
    steps: list[float]
    losses: list[float]
    wall: list[float]
    bytes_sent: list[float]  # by each loss: what the pipeline and the sync had sent so far
    # the steps that evaluated: wall time and bytes sent (as above) at each
    eval_losses: list[float] = attrs.field(factory=list)
    eval_wall: list[float] = attrs.field(factory=list)
    eval_bytes: list[float] = attrs.field(factory=list)

    @property
    def sync_mode(self) -> str:
        """``none`` (one replica; a run from before replicas), ``dp`` or ``diloco``."""
        mode = self.summary.get("sync_mode")
        return mode if mode in SYNC_MODES else "none"


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _boolean(v: Any) -> bool:
    return isinstance(v, bool)


def _string(v: Any) -> bool:
    return isinstance(v, str)


def _list_of(item: Callable[[Any], bool]) -> Callable[[Any], bool]:
    # A list by stage holds null for a stage that never reported; null is no damage in any.
    return lambda v: isinstance(v, list) and all(e is None or item(e) for e in v)


def _codec_errors(v: Any) -> bool:
    # null: a diverged run's error (NaN, which JSON cannot hold) is a finding, not damage.
    return isinstance(v, dict) and all(e is None or _number(e) for e in v.values())


def _link_change(v: Any) -> bool:
    return isinstance(v, dict) and _integer(v.get("at_step"))


# What the report reads from metrics_summary.json, and what each must be where it is not null
# (null, or absent as in runs from older versions, shows as "-").
_SUMMARY_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "run_id": (_string, "a string"),
    "status": (_string, "a string"),
    "final_loss": (_number, "a number"),
    "eval_loss": (_number, "a number"),
    "tokens_per_s": (_number, "a number"),
    "wire_bytes_per_step": (_number, "a number"),
    "compression_ratio": (_number, "a number"),
    "codec_error_by_stage": (_list_of(_codec_errors), "a list of {act, grad} numbers by stage"),
    "wait_fraction_by_stage": (_list_of(_number), "a list of numbers by stage"),
    "link_changes": (_list_of(_link_change), "a list of objects with an integer at_step"),
    "link_changes_total": (_integer, "an integer"),
    "thresholds_met": (_boolean, "true or false"),
    "stages": (_integer, "an integer"),
    "replicas": (_integer, "an integer"),
    "sync_mode": (lambda v: v in SYNC_MODES, "one of none, dp, diloco"),
    "sync_compression": (_string, "a string"),
    "inner_steps": (_integer, "an integer"),
    "sync_bytes_per_step": (_number, "a number"),
    "total_bytes": (_number, "a number"),
}

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


def _shown(v: Any) -> str:
    text = jsonio.dumps(v).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def _wrong_field(obj: dict[str, Any], fields: dict[str, tuple[Callable[[Any], bool], str]]
                 ) -> str | None:
    """The first field of ``obj`` that is not what ``fields`` says, as "x is 1, not a y"."""
    for key, (ok, what) in fields.items():
        v = obj.get(key)
        if v is not None and not ok(v):
            return f"{key} is {_shown(v)}, not {what}"
    return None


def read_summary(d: Path) -> dict[str, Any]:
    """A run directory's ``metrics_summary.json``, each field the report reads checked: its
    files are input (half-written, hand-edited, from an older version), so ReportError names
    the file and what is wrong in it, and no damage reaches a renderer or a table as an
    exception of theirs. The sweep's and the suite's closing tables read it here too."""
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
    wrong = _wrong_field(summary, _SUMMARY_FIELDS)
    if wrong:
        raise ReportError(f"{d}/metrics_summary.json: {wrong}")
    return summary


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
    summary = read_summary(d)
    records = read_records(d)
    steps, losses, wall, sent = [], [], [], []
    evals: tuple[list[float], list[float], list[float]] = ([], [], [])
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
    label = summary.get("run_id") or d.name or d.resolve().name
    parts = label.split("-")
    if len(parts) > 4:  # <stamp>-<experiment>-<index>-<run name>: keep what tells runs apart
        label = "-".join(parts[3:])
    return RunData(d, label, summary, steps, losses, wall, sent, *evals)


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
        rows.append([r.label, str(s.get("status", "-")), _grid(s), _sync(r),
                     _fmt(s.get("inner_steps"), "d"), _fmt(s.get("final_loss"), ".4f"),
                     _fmt(s.get("eval_loss"), ".4f"), _fmt(s.get("tokens_per_s"), ".0f"),
                     _fmt(s.get("wire_bytes_per_step"), ",.0f"),
                     _fmt(s.get("sync_bytes_per_step"), ",.0f"),
                     _fmt(s.get("compression_ratio"), ".1f"), _codec_error(s),
                     _most_waiting(s), _link_set(s)])
    return rows


def _grid(summary: dict[str, Any]) -> str:
    """``stages x replicas`` ("2x2"); "-" for a run from before the summary said."""
    stages, replicas = summary.get("stages"), summary.get("replicas")
    return f"{stages}x{replicas}" if stages is not None and replicas is not None else "-"


def _sync(run: RunData) -> str:
    """The sync mode, with its codec where it codes ("dp int8")."""
    codec = run.summary.get("sync_compression")
    return run.sync_mode if codec in (None, "none") else f"{run.sync_mode} {codec}"


def _link_set(summary: dict[str, Any], shown: int = 3) -> str:
    """The steps at which a set-speed changed a fellow's link mid-run ("@12 @30"; past
    ``shown``, the first and the last of them and how many: "@12 … @95 (40 in all)"): such a
    run did not run on its network profile throughout. (The record keeps the first and the
    newest, so only those two ends are sure to be there.)"""
    steps = [c.get("at_step") for c in summary.get("link_changes") or [] if isinstance(c, dict)]
    if not steps:
        return "-"
    total = link_changes_in_all(steps, summary.get("link_changes_total"))
    if total <= shown:
        return " ".join(f"@{s}" for s in steps)
    return f"@{steps[0]} … @{steps[-1]} ({total} in all)"


def _codec_error(summary: dict[str, Any]) -> str:
    """The largest mean relative error a stage's wire codec put on the activations it sent."""
    errors = [e["act"] for e in summary.get("codec_error_by_stage") or []
              if isinstance(e, dict) and isinstance(e.get("act"), int | float)]
    return f"{max(errors):.2%}" if errors else "-"


def _most_waiting(summary: dict[str, Any]) -> str:
    """The stage that sat blocked on its links the longest: "38% (s1)"."""
    shares = [(w, k) for k, w in enumerate(summary.get("wait_fraction_by_stage") or [])
              if isinstance(w, int | float)]
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


def _svg_chart(title: str, xlabel: str, runs: list[RunData], xs_of: str,
               ys_of: str = "losses", ylabel: str = "loss") -> str:
    w, h, ml, mr, mt, mb = 520, 300, 60, 15, 30, 45
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

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' "
           f"font-family='sans-serif' font-size='11'>",
           f"<text x='{w / 2}' y='16' text-anchor='middle' font-size='13'>{title}</text>",
           f"<rect x='{ml}' y='{mt}' width='{w - ml - mr}' height='{h - mt - mb}' "
           "fill='none' stroke='#999'/>"]
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
        dash = MODE_DASH[run.sync_mode][0]
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
    dash = MODE_DASH[run.sync_mode][0]
    sample = (f"<svg width='28' height='8'><line x1='0' y1='4' x2='28' y2='4' "
              f"stroke='{PALETTE[i % len(PALETTE)]}' stroke-width='2'"
              + (f" stroke-dasharray='{dash}'" if dash else "") + "/></svg>")
    return f"<li>{sample} {html.escape(run.label)} ({run.sync_mode})</li>"


def _short(v: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.1f}"


def render_html(runs: list[RunData]) -> str:
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
            f"<ul>{legend}</ul><table>{table}</table>"
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
    fig, grid = plt.subplots(2, 3, figsize=(15, 8.4))
    axes = list(grid.flat)
    for ax, (title, xl, xs, ys, yl) in zip(axes, CHARTS, strict=False):
        for i, r in enumerate(runs):
            ax.plot(getattr(r, xs), getattr(r, ys), color=PALETTE[i % len(PALETTE)],
                    linewidth=1.2, linestyle=MODE_DASH[r.sync_mode][1],
                    marker="o" if ys != "losses" else None, markersize=4)
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    # The sixth panel holds the legend: every run, in its colour and its sync mode's dash.
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
        fig.savefig(out, format="png", dpi=120)
    plt.close(fig)
    return out.getvalue()


OUTPUT_SUFFIXES = (".html", ".png")


def write_report(runs: list[RunData], out: Path) -> None:
    """``out`` by its suffix, .html or .png, written atomically (a failure leaves no partial
    file). Its folder is created when missing, as for ``sweep --runs-dir``, ``suite --out`` and
    ``llm-doc --output``."""
    if out.suffix not in OUTPUT_SUFFIXES:
        raise ReportError(f"--output must end in .html or .png, got {out.name}")
    data = render_html(runs).encode() if out.suffix == ".html" else render_png(runs)
    try:
        atomic_write(out, data)
    except OSError as exc:
        raise ReportError(f"cannot write {out}: {exc.strerror}") from None
