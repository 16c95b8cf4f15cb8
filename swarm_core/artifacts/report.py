"""Reports over run directories: loss by step, by wall time and by bytes sent, one line per run,
plus a summary table. HTML is self-contained (inline SVG, no scripts); PNG uses matplotlib."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import attrs

from swarm_core import jsonio

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b",
           "#e377c2", "#7f7f7f", "#bcbd22"]


class ReportError(ValueError):
    pass


@attrs.define
class RunData:
    run_dir: Path
    label: str
    summary: dict[str, Any]
    steps: list[float]
    losses: list[float]
    wall: list[float]
    bytes_sent: list[float]


def load_run(d: Path) -> RunData:
    try:
        summary = jsonio.loads((d / "metrics_summary.json").read_bytes())
        lines = (d / "train_progress.ndjson").read_bytes().splitlines()
    except FileNotFoundError as exc:
        raise ReportError(f"{d}: not a finished run directory (missing "
                          f"{Path(exc.filename).name})") from None
    except NotADirectoryError:
        raise ReportError(f"{d}: not a directory (give run directories, or a folder of "
                          "them)") from None
    except OSError as exc:
        raise ReportError(f"{d}: cannot read: {exc.strerror}") from None
    except jsonio.JSONDecodeError as exc:
        raise ReportError(f"{d}: metrics_summary.json is not valid JSON: {exc}") from None
    steps, losses, wall, sent = [], [], [], []
    total = 0.0
    t0 = None
    for i, line in enumerate(lines):
        try:
            rec = jsonio.loads(line)
        except jsonio.JSONDecodeError:
            raise ReportError(f"{d}/train_progress.ndjson line {i + 1} is not JSON") from None
        total += rec.get("wire_bytes") or 0
        if rec.get("loss") is None:
            continue
        ts = rec.get("ts") or 0.0
        t0 = ts if t0 is None else t0
        steps.append(rec["step"])
        losses.append(rec["loss"])
        wall.append(ts - t0)
        sent.append(total)
    label = summary.get("run_id", d.name)
    parts = label.split("-")
    if len(parts) > 4:  # <stamp>-<experiment>-<index>-<run name>: keep what tells runs apart
        label = "-".join(parts[3:])
    return RunData(d, label, summary, steps, losses, wall, sent)


def _fmt(v: Any, spec: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def summary_rows(runs: list[RunData]) -> list[list[str]]:
    rows = []
    for r in runs:
        s = r.summary
        rows.append([r.label, str(s.get("status", "-")), _fmt(s.get("final_loss"), ".4f"),
                     _fmt(s.get("eval_loss"), ".4f"), _fmt(s.get("tokens_per_s"), ".0f"),
                     _fmt(s.get("wire_bytes_per_step"), ",.0f"),
                     _fmt(s.get("compression_ratio"), ".1f"), _codec_error(s),
                     _most_waiting(s), _link_set(s)])
    return rows


def _link_set(summary: dict[str, Any], shown: int = 3) -> str:
    """The steps at which a set-speed changed a fellow's link mid-run ("@12 @30"): such a run
    did not run on its network profile throughout."""
    steps = [c.get("at_step") for c in summary.get("link_changes") or [] if isinstance(c, dict)]
    if not steps:
        return "-"
    total = summary.get("link_changes_total")
    total = max(total, len(steps)) if isinstance(total, int) else len(steps)
    more = f" +{total - shown}" if total > shown else ""
    return " ".join(f"@{s}" for s in steps[:shown]) + more


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


HEADERS = ["run", "status", "final loss", "eval loss", "tokens/s", "bytes/step",
           "compression", "act error", "link wait", "link set"]


def _svg_chart(title: str, xlabel: str, runs: list[RunData], xs_of: str) -> str:
    w, h, ml, mr, mt, mb = 520, 300, 60, 15, 30, 45
    series = [(getattr(r, xs_of), r.losses) for r in runs]
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
               "text-anchor='middle'>loss</text>")
    for i, (xs, ys) in enumerate(series):
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
        out.append(f"<polyline fill='none' stroke='{PALETTE[i % len(PALETTE)]}' "
                   f"stroke-width='1.5' points='{pts}'/>")
    out.append("</svg>")
    return "".join(out)


def _short(v: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.1f}"


def render_html(runs: list[RunData]) -> str:
    legend = "".join(
        f"<li><span style='color:{PALETTE[i % len(PALETTE)]}'>&#9632;</span> "
        f"{html.escape(r.label)}</li>" for i, r in enumerate(runs))
    table = "<tr>" + "".join(f"<th>{h}</th>" for h in HEADERS) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
        for row in summary_rows(runs))
    charts = "".join(_svg_chart(t, xl, runs, attr) for t, xl, attr in (
        ("loss by step", "step", "steps"), ("loss by wall time", "seconds", "wall"),
        ("loss by bytes sent", "bytes on the wire", "bytes_sent")))
    return ("<!doctype html><html><head><meta charset='utf-8'><title>SilentSwarm report"
            "</title><style>body{font-family:sans-serif;margin:2em}table{border-collapse:"
            "collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
            "td:first-child{text-align:left}ul{list-style:none;padding:0}</style></head><body>"
            f"<h1>SilentSwarm report: {len(runs)} run(s)</h1><div>{charts}</div>"
            f"<ul>{legend}</ul><table>{table}</table>"
            f"<p>Sources: {', '.join(html.escape(str(r.run_dir)) for r in runs)}</p>"
            "</body></html>\n")


def render_png(runs: list[RunData], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReportError("PNG reports need matplotlib: pip install 'silentswarm[report]' "
                          "(or write .html)") from None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (title, xl, attr) in zip(axes, (
            ("loss by step", "step", "steps"), ("loss by wall time", "seconds", "wall"),
            ("loss by bytes sent", "bytes on the wire", "bytes_sent")), strict=True):
        for i, r in enumerate(runs):
            ax.plot(getattr(r, attr), r.losses, color=PALETTE[i % len(PALETTE)],
                    label=r.label, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
