"""Columns of the console's tables and the cells written into them (Rich, no Textual).

A :class:`Cell` is a Rich ``Text`` that also carries the value it sorts by, so sorting a column
of numbers sorts numbers; ``None`` sorts last. Columns have fixed widths: values that change
every second never make the table re-measure or jump.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

import attrs
from rich.cells import cell_len
from rich.console import JustifyMethod
from rich.text import Text

from swarm_core.config.schemas import TrainingConfig
from swarm_core.contract import StageMetrics
from swarm_core.validators import printable
from swarm_tui.app.model import LEFT, ClusterModel, FellowState, JobView
from swarm_tui.fmt import (
    fmt_age,
    fmt_bytes,
    fmt_cell,
    fmt_devices,
    fmt_limit,
    fmt_loss,
    fmt_rate,
    fmt_tps,
)

STATUS_STYLE = {
    "ready": "green",
    "busy": "bold cyan",
    "stale": "bold red",
    "offline": "red",
    "released": "dim",
    "leaving": "dim",
    "left": "dim",
    "joining": "yellow",
}
JOB_STATE_STYLE = {
    "PENDING": "yellow",
    "RUNNING": "bold cyan",
    "COMPLETED": "green",
    "FAILED": "bold red",
    "CANCELLED": "dim",
}
STALE_ROW_STYLE = "red"
MARK = "●"


class Cell(Text):
    """Text that sorts by ``sort_key`` (a tuple; a missing value sorts after every value)."""

    def __init__(self, text: str, value: Any = None, *, key: Any = 0, style: str = "",
                 justify: JustifyMethod = "left", export: Any = NotImplemented) -> None:
        super().__init__(text, style=style, justify=justify, no_wrap=True,
                         overflow="ellipsis", end="")
        self.sort_key = (1, 0, key) if value is None else (0, value, key)
        # What an export writes when the sort value is not the datum (NotImplemented: derive
        # it from the sort value; see export.cell_value).
        self.export = export

    @property
    def signature(self) -> tuple[str, str]:
        return self.plain, str(self.style)

    def shown_as(self, text: str) -> Cell:
        """The same cell (sort value, export, style) showing ``text``."""
        out = Cell(text, justify=self.justify or "left")
        out.style, out.sort_key, out.export = self.style, self.sort_key, self.export
        return out


def cut_middle(text: str, width: int) -> str:
    """``small_non…-wan_80-s1-r0``: a long name's start and end, which tell runs of a sweep
    apart (cut at the end, four runs read alike)."""
    if len(text) <= width or width < 3 or cell_len(text) != len(text):
        return text  # (fits; too narrow; wide characters: the end is cut as before)
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


@attrs.define(frozen=True)
class Column:
    key: str
    label: str
    width: int
    justify: JustifyMethod = "left"
    help: str = ""
    # Which columns a narrow terminal keeps: 0 always, then 1, 2… while they fit.
    priority: int = 0
    frozen: bool = False  # stays on the left when the table scrolls sideways
    stretch: bool = False  # takes the width left over (``width`` is its least)
    # An export names the column with its unit (``tx_mbps``, not the screen's "tx Mb/s") and
    # rounds its numbers to what the screen shows (an age of 81.00346779823303 s is 81.0).
    export: str = ""
    digits: int | None = None
    # How a value too long for the column is shortened (its text, the width): None is Rich's
    # ellipsis at the end; names are cut in the middle.
    fit: Callable[[str, int], str] | None = None

    @property
    def export_name(self) -> str:
        return self.export or self.key


FELLOW_COLUMNS: tuple[Column, ...] = (
    Column("sel", " ", 1, help="marked (space)", frozen=True),
    Column("id", "id", 3, "right", "fellow id", frozen=True),
    Column("name", "name", 10, frozen=True, fit=cut_middle),
    Column("status", "status", 8, help="! marks a note (see the detail view)"),
    Column("hb", "hb", 4, "right", "seconds since the last heartbeat",
           priority=2, export="hb_age_s", digits=1),
    Column("job", "job/stage", 12, priority=1),
    Column("step", "step", 6, "right", priority=1),
    Column("loss", "loss", 6, "right", "last loss", priority=2, digits=4),
    Column("tps", "tok/s", 6, "right", "tokens per second",
           priority=3, export="tokens_per_s", digits=1),
    Column("tx_rate", "tx Mb/s", 7, "right", "data-plane send rate",
           priority=1, export="tx_mbps", digits=3),
    Column("rx_rate", "rx Mb/s", 7, "right", "data-plane receive rate",
           priority=1, export="rx_mbps", digits=3),
    Column("tx_lim", "tx lim", 6, "right", "send limit, Mbit/s",
           priority=3, export="tx_limit_mbps"),
    Column("rx_lim", "rx lim", 6, "right", "receive limit, Mbit/s",
           priority=3, export="rx_limit_mbps"),
    Column("lat", "lat ms", 6, "right", "added one-way latency, ms",
           priority=3, export="latency_ms"),
    Column("tx_bytes", "tx bytes", 8, "right", "data-plane bytes sent", priority=4),
    Column("rx_bytes", "rx bytes", 8, "right", "data-plane bytes received", priority=4),
    Column("node", "node", 10, help="host", priority=4),
    Column("dev", "slots", 8, help="device slots", priority=5, export="slots"),
)
SORTABLE_FELLOW_COLUMNS = tuple(c for c in FELLOW_COLUMNS if c.key != "sel")
# While a job with replicas runs, its fellows' job column names their cell, "job-000003
# s1/r0": four characters wider (at 80 columns the heartbeat age makes room for it).
FELLOW_GRID_COLUMNS: tuple[Column, ...] = tuple(
    attrs.evolve(c, label="job/cell", width=16, help="job, then stage/replica")
    if c.key == "job" else c for c in FELLOW_COLUMNS)

JOB_COLUMNS: tuple[Column, ...] = (
    Column("id", "job", 10, frozen=True),
    Column("name", "name", 20, help="the run (model, compression, network, seed), then its "
           "sweep and time", frozen=True, fit=lambda text, width: fit_job_label(text, width)),
    Column("kind", "kind", 5, priority=4),
    Column("state", "state", 9),
    Column("progress", "progress", 18, help="steps done of the steps asked", priority=1),
    Column("loss", "loss", 6, "right", priority=2, digits=4),
    Column("fellows", "fellows", 8, priority=3),
    Column("age", "age", 5, "right", "since submitted", priority=2, export="age_s", digits=0),
    Column("info", "why / reason", 12, priority=1, stretch=True),
)


# A sweep run's job name: <stamp>-<experiment>-<NN>-<run> (swarm_core.experiments.runner)
_RUN_NAME = re.compile(r"^(?P<stamp>\d{8}T\d{6})-(?P<exp>.+?)-(?P<index>\d{2,})-(?P<run>.+)$")


def job_label(name: str) -> str:
    """A job's name as the table shows it: a sweep run by its run (model, compression,
    network, seed) before its sweep and timestamp, which at 80 columns were all that showed
    (``20261201T2301…``); any other name as it is."""
    m = _RUN_NAME.match(name)
    if m is None:
        return name
    return f"{m['run']} · {m['exp']} #{int(m['index'])} {m['stamp']}"


_LABEL = re.compile(r"^(?P<run>.+) · .+ #\d+ \d{8}T\d{6}$")


def fit_job_label(label: str, width: int) -> str:
    """A job's label (:func:`job_label`) in ``width`` columns: a sweep run's run whole with
    as much of its sweep as fits (Rich cuts the end), else the run cut in the middle; any
    other name cut in the middle."""
    m = _LABEL.match(label)
    if m is not None and cell_len(m["run"]) <= width:
        return label
    return cut_middle(m["run"] if m is not None else label, width)


def progress_bar(done: int, total: int | None, width: int = 8) -> str:
    if not total:
        return f"{'':{width}} {done}"
    frac = max(0.0, min(1.0, done / total))
    full = int(frac * width)
    return "█" * full + "░" * (width - full) + f" {done}/{total}"


# --- rows ---------------------------------------------------------------------------------------


def _fellow_row_style(st: FellowState) -> str:
    return STALE_ROW_STYLE if st.stale else "dim" if st.status in LEFT else ""


def fellow_age_cell(model: ClusterModel, st: FellowState) -> Cell:
    """The heartbeat age alone: the one cell that changes every second by itself."""
    age = model.heartbeat_age(st)
    style = _fellow_row_style(st) or ("yellow" if age is not None and age >= 3 else "")
    return Cell(fmt_age(age), age, key=st.fellow_id, style=style, justify="right")


def shown_status(model: ClusterModel, st: FellowState) -> str:
    """The status as shown (``ClusterModel.shown_status``: a silent "leaving" has left)."""
    return model.shown_status(st)


def fellow_cells(model: ClusterModel, st: FellowState, marked: bool) -> dict[str, Cell]:
    fid = st.fellow_id
    row_style = _fellow_row_style(st)
    live = not st.stale  # rates of a silent fellow are history, not news

    def cell(text: str, value: Any = None, style: str = "",
             justify: JustifyMethod = "left") -> Cell:
        return Cell(text, value, key=fid, style=style or row_style, justify=justify)

    def num(text: str, value: Any) -> Cell:
        return cell(text, value, justify="right")

    job, job_key = fellow_job(model, st)
    # A gone fellow's job that is over (or forgotten) is history: not "its" job, nor figures.
    view = model.jobs.get(st.job_id) if st.job_id is not None else None
    in_job = st.job_id is not None and not (model.gone(st) and (view is None or view.terminal))
    if not in_job:
        job, job_key = "-", None
    tx_bytes, rx_bytes = st.counters.get("data_tx"), st.counters.get("data_rx")
    tx_rate = st.tx_mbps if live else None
    rx_rate = st.rx_mbps if live else None
    return {
        "sel": cell(MARK if marked else " ", int(marked), style="bold magenta"),
        "id": num(str(fid), fid),
        "name": cell(st.name, st.name),
        "status": cell(shown_status(model, st) + ("!" if st.note else ""), st.status,
                       style="yellow" if st.note and not st.stale else
                       STATUS_STYLE.get(st.status, "")),
        "hb": fellow_age_cell(model, st),
        "job": cell(job, job_key),
        "step": num(str(st.step) if in_job else "-", st.step if in_job else None),
        "loss": num(fmt_loss(st.loss if in_job else None), st.loss if in_job else None),
        "tps": num(fmt_tps(st.tokens_per_s) if in_job else "-",
                   st.tokens_per_s if in_job else None),
        "tx_rate": num(fmt_rate(tx_rate), tx_rate),
        "rx_rate": num(fmt_rate(rx_rate), rx_rate),
        "tx_lim": num(fmt_limit(st.tx_limit), st.tx_limit if st.tx_limit is not None
                      else float("inf")),
        "rx_lim": num(fmt_limit(st.rx_limit), st.rx_limit if st.rx_limit is not None
                      else float("inf")),
        "lat": Cell(f"{st.latency_ms:g}" if st.latency_ms else "-", st.latency_ms, key=fid,
                    style=row_style, justify="right", export=st.latency_ms),
        "tx_bytes": num(fmt_bytes(tx_bytes, compact=True), tx_bytes),
        "rx_bytes": num(fmt_bytes(rx_bytes, compact=True), rx_bytes),
        "node": cell(st.host or "-", st.host),
        "dev": Cell(fmt_devices(st.devices), len(st.devices), key=fid, style=row_style,
                    export=",".join(st.devices)),
    }


def fellow_job(model: ClusterModel, st: FellowState) -> tuple[str, Any]:
    """The job column of a fellow, and its sort value: ``job-000002/1`` (its stage) in a
    chain, ``job-000003 s1/r0`` (its cell, from the job's placement; ``+1`` when it runs one
    more) in a job with replicas, ``-`` in none."""
    if st.job_id is None:
        return "-", None
    view = model.jobs.get(st.job_id)
    p = view.info.placement if view is not None else None
    if p is None or view is None or not view.grid:
        return st.job_id + ("" if st.stage is None else f"/{st.stage}"), \
            (st.job_id, st.stage or 0, 0)
    mine = sorted((c.stage, c.replica) for c in p.stages if c.fellow_id == st.fellow_id)
    if not mine:
        return st.job_id, (st.job_id, 0, 0)
    more = f"+{len(mine) - 1}" if len(mine) > 1 else ""
    return f"{st.job_id} {fmt_cell(*mine[0])}{more}", (st.job_id, *mine[0])


def grid_running(model: ClusterModel) -> bool:
    """Whether a job with replicas runs (the fellows table then names cells)."""
    return any(v.info.state == "RUNNING" and v.grid for v in model.jobs.values())


def fellow_haystack(st: FellowState) -> str:
    """What ``/`` filters match against."""
    return " ".join([str(st.fellow_id), st.name, st.host, st.status, st.job_id or "",
                     *st.devices, st.note])


JOB_STATE_ORDER = {"RUNNING": 0, "PENDING": 1, "FAILED": 2, "CANCELLED": 2, "COMPLETED": 2}


def job_cells(model: ClusterModel, view: JobView) -> dict[str, Cell]:
    info = view.info
    jid = info.job_id
    # By state: running, then the queue oldest first, then the history newest first.
    group = JOB_STATE_ORDER.get(info.state, 3)
    created = info.created_at if group < 2 else -info.created_at

    def cell(text: str, value: Any = None, style: str = "",
             justify: JustifyMethod = "left") -> Cell:
        return Cell(text, value, key=jid, style=style, justify=justify)

    total = view.total_steps
    why = printable(info.waiting_for if info.state == "PENDING" else info.reason)
    return {
        "id": cell(jid, jid),
        "name": Cell(job_label(info.name), job_label(info.name), key=jid, export=info.name),
        "kind": cell(info.kind or "-", info.kind),
        # The default order is the state column's: running, the queue, the history.
        "state": cell(info.state, (group, created), style=JOB_STATE_STYLE.get(info.state, "")),
        "progress": Cell(progress_bar(info.last_step, total),
                         info.last_step / total if total else info.last_step, key=jid,
                         export=f"{info.last_step}/{total}" if total else info.last_step),
        "loss": cell(fmt_loss(info.last_loss), info.last_loss, justify="right"),
        "fellows": Cell(",".join(map(str, info.fellows)) or f"({info.topology.fellows})",
                        len(info.fellows), key=jid, export=",".join(map(str, info.fellows))),
        "age": job_age_cell(model, view),
        "info": cell(why or "", why or None),
    }


def job_age_cell(model: ClusterModel, view: JobView) -> Cell:
    created = view.info.created_at
    age = None if created is None else max(0.0, model.leader_now() - created)
    return Cell(fmt_age(age), age, key=view.job_id, justify="right")


def job_haystack(view: JobView) -> str:
    info = view.info
    return " ".join([info.job_id, info.name, info.kind, info.state, info.reason])


WATCH_COLUMNS: tuple[Column, ...] = (
    Column("id", "fellow", 6, "right", frozen=True, export="fellow"),
    Column("name", "name", 10, frozen=True, fit=cut_middle),
    Column("stage", "stage", 5, "right"),
    Column("status", "status", 8),
    Column("step", "step", 6, "right"),
    Column("loss", "loss", 6, "right", digits=4),
    Column("tps", "tok/s", 6, "right", priority=2, export="tokens_per_s", digits=1),
    Column("tx_rate", "tx Mb/s", 7, "right", priority=1, export="tx_mbps", digits=3),
    Column("rx_rate", "rx Mb/s", 7, "right", priority=1, export="rx_mbps", digits=3),
    Column("act", "act mem", 7, "right", "activations held for backward, peak of the last step",
           priority=2, export="activation_bytes"),
    Column("wait", "wait", 5, "right",
           "share of the last step spent blocked on links (neighbours, network, bubble)",
           priority=1, export="wait_fraction", digits=3),
    Column("hb", "hb", 4, "right", priority=3, export="hb_age_s", digits=1),
)

_SYNC_COLUMNS = (
    Column("sync", "sync", 6, "right", "what the stage group's synchronisation sent in the "
           "last step", priority=1, export="sync_bytes"),
    Column("sync_wait", "swait", 5, "right", "share of the last step the stage group's "
           "synchronisation took", priority=1, export="sync_fraction", digits=3),
)
_GRID_PRIORITY = {"status": 2, "loss": 2, "tps": 1, "tx_rate": 3, "rx_rate": 3, "act": 3}
GRID_STEP_WIDTH = 9  # "left @123", "left@1234": a cell of a replica that left


def _grid_watch_columns() -> tuple[Column, ...]:
    """A job with replicas: one row per cell, its replica beside its stage, and its group's
    sync bytes and share beside its link wait. At 80 columns what it ran and how it waits
    come first: the status and loss give way (a stale row is red all the same; the loss is
    the last stage's)."""
    out: list[Column] = []
    for c in WATCH_COLUMNS:
        c = attrs.evolve(c, priority=_GRID_PRIORITY.get(c.key, c.priority))
        out.append(attrs.evolve(c, width=GRID_STEP_WIDTH) if c.key == "step" else c)
        if c.key == "stage":
            out.append(Column("replica", "rep", 3, "right", "replica of its stage"))
        if c.key == "wait":
            out += _SYNC_COLUMNS
    return tuple(out)


GRID_WATCH_COLUMNS = _grid_watch_columns()
# Swarm wiring: each cell's share of the step's micro-batches (its route's deal), after its
# throughput, which it explains.
ROUTED_WATCH_COLUMNS = tuple(itertools.chain.from_iterable(
    (c, Column("share", "share", 5, "right", "share of the step's micro-batches its route "
               "gave it (swarm wiring)", priority=1, export="micro_batch_share", digits=3))
    if c.key == "tps" else (c,) for c in GRID_WATCH_COLUMNS))


def watch_columns(view: JobView | None) -> tuple[Column, ...]:
    if view is None or not view.grid:
        return WATCH_COLUMNS
    return ROUTED_WATCH_COLUMNS if view.info.topology.wiring == "swarm" \
        else GRID_WATCH_COLUMNS


def fit_left(text: str, width: int) -> str:
    """``left @1234`` in ``width`` columns: without its space when that makes it fit."""
    return text if len(text) <= width else text.replace(" ", "")


def watch_cells(model: ClusterModel, view: JobView, index: int) -> dict[str, Cell]:
    """One cell of a job (its index in the placement: the stage, for one replica): what it
    last reported (metric events, else the leader's newest figures of it), and what its
    fellow is doing now."""
    fp = view.per_stage.get(index)
    fellows = view.info.fellows
    stage, replica = view.cell_of(index)
    grid = view.grid
    fid = fellows[index] if 0 <= index < len(fellows) else (fp.fellow_id if fp else None)
    st = model.fellows.get(fid) if fid is not None else None
    in_job = st is not None and st.job_id == view.job_id
    # The leader's figures of the cell: what a console opened mid-run has before any event.
    label = view.label(stage, replica)
    known = view.info.metrics.stage(label)
    # A cell another fellow took over (a spare joined as a replica that left): what the
    # fellow before it reported is not the new one's; blank until the new one reports.
    if fp is not None and fid is not None and fp.fellow_id is not None \
            and fp.fellow_id != fid:
        fp = None
    if known.fellow_id is not None and fid is not None and known.fellow_id != fid:
        known = StageMetrics()
    members = view.info.members
    left = grid and members is not None and replica not in members
    left_at = view.left_at(replica) if left else None
    # A spare joining as a replica that left (the group takes it in at a synchronisation):
    # its fellow runs the cell, and what the cell reported is its own, of a step from then.
    mine = fp if fp is not None else known if known.fellow_id == fid else None
    joining = left and st is not None and in_job and not st.stale and (
        mine is None or mine.step is None or mine.step >= (left_at or 0))
    if left and not joining:
        # (a replica that left keeps its row, marked; its figures are history, not shown)
        fp, known, in_job = None, StageMetrics(), False
    # A fellow's heartbeat speaks for one of its cells: only fall back on it for that one
    # (a heartbeat names a stage, not a replica: in a grid, only a fellow of one cell).
    own = in_job and st is not None and fid is not None and (
        fellows.count(fid) == 1 if grid else (st.stage is None or st.stage == stage))
    if joining and fp is None:
        own = False  # (blank until it reports: its heartbeat's figures are not the cell's)
    step = fp.step if fp is not None else (
        known.step if known.step is not None else (st.step if own and st is not None else None))
    loss = fp.loss if fp is not None and fp.loss is not None else (
        st.loss if own and st is not None else None)
    tps = fp.tokens_per_s if fp is not None and fp.tokens_per_s is not None else (
        known.tokens_per_s if known.tokens_per_s is not None else (
            st.tokens_per_s if own and st is not None else None))
    act = fp.activation_bytes if fp is not None else None
    wait = fp.wait_fraction if fp is not None and fp.wait_fraction is not None else (
        known.wait_share if grid else None)
    routed = known.micro_batches if fp is None or fp.micro_batches is None \
        else fp.micro_batches
    training = view.info.training
    share_of = None if routed is None or not isinstance(training, TrainingConfig) \
        else routed / (view.replicas * training.micro_batches)
    sync = fp.sync_bytes if fp is not None and fp.sync_bytes is not None else known.sync_bytes
    sync_wait = fp.sync_fraction if fp is not None and fp.sync_fraction is not None else \
        known.sync_share
    status = "joining" if joining else "left" if left else \
        st.status if st is not None else "gone"
    gone = "left" if left_at is None else f"left @{left_at}"
    row_style = STALE_ROW_STYLE if (left and not joining) or st is None or st.stale else ""
    age = model.heartbeat_age(st) if st is not None else None
    tx = st.tx_mbps if st is not None and in_job else None
    rx = st.rx_mbps if st is not None and in_job else None

    def cell(text: str, value: Any = None, style: str = "",
             justify: JustifyMethod = "left") -> Cell:
        return Cell(text, value, key=index, style=style or row_style, justify=justify)

    def share(value: float | None) -> Cell:
        return cell("-" if value is None else f"{value:.0%}", value, justify="right")

    return {
        "id": cell("-" if fid is None else str(fid), fid, justify="right"),
        "name": cell(st.name if st is not None else "?", st.name if st is not None else None),
        # (by stage, then replica: the key is the cell's index, replica-major)
        "stage": Cell(str(stage), stage, key=(replica, index), style=row_style,
                      justify="right"),
        "replica": cell(str(replica), replica, justify="right"),
        "status": cell(gone if status == "left" else status, status,
                       style=STATUS_STYLE.get(status, row_style)),
        # (a cell of a replica that left says so where its step was: at 80 columns the
        # status gives way, the step stays)
        "step": cell(fit_left(gone, GRID_STEP_WIDTH), -1, justify="right")
        if status == "left" else cell("-" if step is None else str(step), step,
                                      justify="right"),
        "loss": cell(fmt_loss(loss), loss, justify="right"),
        "tps": cell(fmt_tps(tps), tps, justify="right"),
        "act": cell(fmt_bytes(act, compact=True), act, justify="right"),
        "wait": share(wait),
        "share": share(share_of),
        "sync": cell(fmt_bytes(None if sync is None else int(sync), compact=True), sync,
                     justify="right"),
        "sync_wait": share(sync_wait),
        "tx_rate": cell(fmt_rate(tx), tx, justify="right"),
        "rx_rate": cell(fmt_rate(rx), rx, justify="right"),
        "hb": cell(fmt_age(age), age, justify="right"),
    }
