"""Throughput per cell over the run (issue 34 point 5): each cell's tokens per second step by
step, with marks where a set-speed changed a link or a slowdown and where the membership
changed (a replica left or joined, a rebalancing move), so a slow peer's drag and what a move
bought read off one chart.

A cell's figure is its own: the tokens it trained in the step over its own step time
(``stage_seconds`` of the step's record, by the cell's label "k" or "k.r"). Its tokens are its
replica's share of the batch, or, where a record holds the micro-batches a swarm route gave
each cell (``micro_batches`` by label), that many micro-batches' windows.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import attrs

from swarm_core.contract import JobSubmit
from swarm_core.contract.membership import MembershipChange
from swarm_core.contract.metrics import MetricName
from swarm_core.contract.placement import Placement, PlacementError
from swarm_core.contract.rebalance import PeerMove
from swarm_core.experiments.summary import MetricsSummary

CELLS_TITLE = "tokens/s per cell by step"
CELLS_AXES = ("step", "tokens/s (the cell's own step time)")
MARK_COLOUR = "#888"


def _num(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


@attrs.frozen
class CellSteps:
    """What a run's records say of each cell, step by step."""

    seconds: dict[str, list[tuple[int, float]]] = attrs.field(factory=dict)
    routed: dict[str, dict[int, float]] = attrs.field(factory=dict)
    # the tokens the whole step trained, where the record tells (the last stages' tokens/s
    # times the step's seconds): for runs whose config is not beside them
    step_tokens: dict[int, float] = attrs.field(factory=dict)


def _by_label(rec: dict[str, Any], key: str) -> dict[str, float]:
    got = rec.get(key)
    if not isinstance(got, dict):
        return {}
    return {str(k): float(v) for k, v in got.items() if _num(v) and v >= 0}


def cell_steps(records: list[dict[str, Any]]) -> CellSteps:
    """Each cell's own seconds per step (entries that are not numbers are passed over: the
    chart is a view, and the records' checked fields carry the run)."""
    out = CellSteps()
    for rec in records:
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for label, s in _by_label(rec, MetricName.STAGE_SECONDS).items():
            out.seconds.setdefault(label, []).append((step, s))
        for label, m in _by_label(rec, MetricName.MICRO_BATCHES).items():
            out.routed.setdefault(label, {})[step] = m
        tps, secs = rec.get("tokens_per_s"), rec.get("step_seconds")
        if _num(tps) and _num(secs) and tps > 0 and secs > 0:
            out.step_tokens[step] = tps * secs
    return out


def throughput_by_cell(cells: CellSteps, job: JobSubmit | None, replicas: int
                       ) -> dict[str, list[tuple[int, float]]]:
    """Each cell's tokens/s by step, its label's order ("0", "1" or "0.0", "0.1", ...)."""
    tokens_of: Callable[[str, int], float | None]
    if job is not None and job.train is not None and job.model is not None:
        t, seq = job.train, job.model.seq_len
        local = t.batch_size // max(1, job.topology.replicas)
        per_mb = local // t.micro_batches

        def tokens_of(label: str, step: int) -> float | None:
            routed = cells.routed.get(label, {}).get(step)
            return (local if routed is None else routed * per_mb) * seq
    else:
        def tokens_of(label: str, step: int) -> float | None:
            total = cells.step_tokens.get(step)
            return None if total is None else total / max(1, replicas)

    out: dict[str, list[tuple[int, float]]] = {}
    for label in sorted(cells.seconds, key=_label_key):
        series = []
        for step, secs in cells.seconds[label]:
            tokens = tokens_of(label, step)
            if tokens is not None and secs > 0:
                series.append((step, tokens / secs))
        if series:
            out[label] = sorted(series)
    return out


def _label_key(label: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in label.split("."))
    except ValueError:
        return (1 << 30,)


@attrs.frozen
class Mark:
    step: int
    text: str


def move_mark(move: PeerMove) -> str:
    """A peer's move between stages (a layout's rebalancing), its old cell to its new:
    "0.1->1.2"."""
    return move.cells("->")


def movers(placement: Placement | None, membership: Sequence[MembershipChange]
           ) -> dict[int, int]:
    """Of each move in ``membership`` (by its index there), the fellow that moved: its new
    cell's in the placement just after the move (``placement``, the job's last, with the
    later moves undone: a move undone is the move back). A move the placement does not fit
    (a record cut short) names none, nor do those before it."""
    out: dict[int, int] = {}
    p = placement
    for i in reversed(range(len(membership))):
        m = membership[i].moved
        if m is None or p is None or m.new_id is None:
            continue
        try:
            out[i] = p.cell(m.target, m.new_id).fellow_id
            p = m.undo(p)
        except PlacementError:
            p = None
    return out


def marks(summary: MetricsSummary, placement: Placement | None = None) -> list[Mark]:
    """The run's changes by the step they took effect: set-speeds (a link, a slowdown) and
    membership changes (left, joined; a peer moved between stages, "f2 0.1->1.2": the
    fellow where ``placement``, the run's last, names it)."""
    out = []
    fellows = movers(placement, summary.membership or [])
    for c in summary.link_changes or []:
        what = [] if c.link is None else ["link"]
        if c.slowdown is not None:
            what.append(f"slowdown x{c.slowdown:g}")
        to = "" if c.to_fellow is None else f"->f{c.to_fellow}"
        out.append(Mark(c.at_step, f"f{c.fellow_id}{to} {' '.join(what) or 'set-speed'}"))
    for i, m in enumerate(summary.membership or []):
        who = f"f{fellows[i]} " if i in fellows else ""
        moved = [who + move_mark(m.moved)] if m.moved is not None else []
        moved += [f"r{','.join(map(str, m.left))} left"] if m.left else []
        moved += [f"c{m.cells_text()} left"] if m.cells_left else []
        moved += [f"r{','.join(map(str, m.joined))} joined"] if m.joined else []
        reason = f" ({m.reason})" if m.reason else ""
        out.append(Mark(m.step, "; ".join(moved or ["membership"]) + reason))
    return sorted(out, key=lambda x: x.step)


def svg_cells(title: str, series: dict[str, list[tuple[int, float]]], changes: list[Mark],
              palette: list[str], box: tuple[int, int, int, int, int, int]) -> str:
    """One run's chart: a line per cell, a dashed vertical line per change."""
    w, h, ml, mr, mt, mb = box
    if not series:
        return (f"<svg width='{w}' height='{h}'><text x='10' y='20'>"
                f"{html.escape(title)}: no per-cell step times</text></svg>")
    xs = [s for pts in series.values() for s, _ in pts] + [c.step for c in changes]
    ys = [y for pts in series.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    x1 = x1 if x1 > x0 else x0 + 1
    y0, y1 = 0.0, max(ys) * 1.08 or 1.0

    def px(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * (w - ml - mr)

    def py(y: float) -> float:
        return mt + (1 - (y - y0) / (y1 - y0)) * (h - mt - mb)

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' class='cells' width='{w}' height='{h}' "
           "font-family='sans-serif' font-size='11'>",
           f"<text x='{w / 2}' y='16' text-anchor='middle' font-size='13'>"
           f"{html.escape(title)}</text>",
           f"<rect x='{ml}' y='{mt}' width='{w - ml - mr}' height='{h - mt - mb}' "
           "fill='none' stroke='#999'/>"]
    for i in range(5):
        yv, xv = y0 + (y1 - y0) * i / 4, x0 + (x1 - x0) * i / 4
        out.append(f"<text x='{ml - 5}' y='{py(yv) + 4:.1f}' text-anchor='end'>"
                   f"{_si(yv)}</text>")
        out.append(f"<text x='{px(xv):.1f}' y='{h - mb + 15}' text-anchor='middle'>"
                   f"{xv:.0f}</text>")
    out.append(f"<text x='{w / 2}' y='{h - 8}' text-anchor='middle'>{CELLS_AXES[0]}</text>")
    out.append(f"<text x='14' y='{h / 2}' transform='rotate(-90 14 {h / 2})' "
               f"text-anchor='middle'>{CELLS_AXES[1]}</text>")
    for c in changes:
        x = px(c.step)
        out.append(f"<g class='mark' data-step='{c.step}'><title>{html.escape(c.text)} @{c.step}"
                   f"</title><line x1='{x:.1f}' y1='{mt}' x2='{x:.1f}' y2='{h - mb}' "
                   f"stroke='{MARK_COLOUR}' stroke-dasharray='4,3'/>"
                   f"<text x='{x + 2:.1f}' y='{mt + 10}' fill='{MARK_COLOUR}'>"
                   f"@{c.step}</text></g>")
    for i, (label, pts) in enumerate(series.items()):
        colour = palette[i % len(palette)]
        line = " ".join(f"{px(s):.1f},{py(y):.1f}" for s, y in pts)
        out.append(f"<polyline class='cell' data-cell='{html.escape(label)}' fill='none' "
                   f"stroke='{colour}' stroke-width='1.5' points='{line}'>"
                   f"<title>cell {html.escape(label)}</title></polyline>")
    out.append("</svg>")
    legend = " ".join(
        f"<span style='color:{palette[i % len(palette)]}'>&#9632;</span> {html.escape(label)}"
        for i, label in enumerate(series))
    notes = "".join(f"<li>@{c.step}: {html.escape(c.text)}</li>" for c in changes)
    return (f"<figure>{''.join(out)}<figcaption>cells: {legend}"
            + (f"<ul>{notes}</ul>" if notes else "") + "</figcaption></figure>")


def _si(v: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}"


def png_cells(ax: Any, panels: list[tuple[str, dict[str, list[tuple[int, float]]],
                                          list[Mark]]], palette: list[str]) -> None:
    """Every run's cells on one matplotlib panel (a line per cell, named "k.r", or
    "<run> k.r" with several runs) and each run's changes as dotted vertical lines."""
    ax.set_title(CELLS_TITLE)
    ax.set_xlabel(CELLS_AXES[0])
    ax.set_ylabel(CELLS_AXES[1])
    ax.grid(alpha=0.3)
    drawn = 0
    for run, series, changes in panels:
        for label, pts in series.items():
            name = label if len(panels) == 1 else f"{run} {label}"
            ax.plot([s for s, _ in pts], [y for _, y in pts], linewidth=1.2,
                    color=palette[drawn % len(palette)], label=name)
            drawn += 1
        for c in changes:
            ax.axvline(c.step, color=MARK_COLOUR, linestyle=":", linewidth=1)
    if not drawn:
        ax.text(0.5, 0.5, "no per-cell step times", ha="center", va="center",
                transform=ax.transAxes)
        return
    legend = ax.legend(fontsize=7)
    for text in legend.get_texts():
        text.set_parse_math(False)
