"""The queue (PENDING, RUNNING and finished jobs) and the live watch view of one job."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.widgets import DataTable, Input, Label, Static

from swarm_core.contract import perplexity
from swarm_core.validators import printable
from swarm_tui.app.cells import (
    JOB_COLUMNS,
    JOB_STATE_STYLE,
    Cell,
    job_age_cell,
    job_cells,
    job_haystack,
    progress_bar,
    watch_cells,
    watch_columns,
)
from swarm_tui.app.model import Change, JobView
from swarm_tui.app.screens.base import FilterBar, SwarmScreen, opens_field
from swarm_tui.app.screens.record import DescribeScreen
from swarm_tui.app.widgets.footer import SwarmFooter
from swarm_tui.app.widgets.live_table import LiveTable
from swarm_tui.app.widgets.plot import MetricPlot, PlotSpec
from swarm_tui.app.widgets.status import StatusBar
from swarm_tui.fmt import describe_link_changes, fmt_age, fmt_loss
from swarm_tui.grid import move_fellows, move_text


class JobsScreen(SwarmScreen):
    AUTO_FOCUS = "LiveTable"
    EXPORT_NAME = "jobs"
    BINDINGS = [
        Binding("w", "watch", "Watch", id="jobs.watch"),
        Binding("enter", "watch", "Watch", show=False, id="jobs.open"),
        Binding("c", "cancel_job", "Cancel job", id="jobs.cancel"),
        Binding("slash", "filter", "Filter", priority=True, id="jobs.filter"),
        Binding("o", "sort_next", "Sort", id="jobs.sort_next"),
        Binding("O", "sort_reverse", "Reverse sort", show=False, id="jobs.sort_reverse"),
        Binding("escape", "clear", "Clear filter", show=False, id="jobs.clear"),
        Binding("e", "export", "Export view", show=False, id="jobs.export"),
        Binding("d", "describe", "Describe", show=False, id="jobs.describe"),
        Binding("C", "columns", "Columns", show=False, id="jobs.columns"),
    ]

    _select_later: str | None = None

    def compose(self) -> ComposeResult:
        yield StatusBar("jobs")
        yield FilterBar()
        yield LiveTable(JOB_COLUMNS, self._cells, self._haystack, sort_column="state",
                        id="jobs-table")
        yield SwarmFooter()

    @property
    def table(self) -> LiveTable:
        return self.query_one(LiveTable)

    def _cells(self, key: str) -> dict[str, Cell]:
        return job_cells(self.swarm.model, self.swarm.model.jobs[key])

    def _haystack(self, key: str) -> str:
        return job_haystack(self.swarm.model.jobs[key])

    def sync(self, change: Change | None) -> None:
        jobs = self.swarm.model.jobs
        if change is None or change.job_rows:
            self.table.rebuild(list(jobs))
            self._apply_selection()
            return
        keys = [j for j in change.jobs if j in jobs]
        if keys:
            self.table.update_rows(keys)
        if change.ages:
            self.table.update_column("age", lambda k: job_age_cell(self.swarm.model, jobs[k]),
                                     skip=keys)

    def status_hint(self) -> str:
        try:
            table = self.table
        except Exception:
            return ""
        label = next(c.label for c in JOB_COLUMNS if c.key == table.sort_column)
        hint = f"sort {label}{'▼' if table.sort_reverse else '▲'}"
        if table.filter_text:
            hint += f"  /{table.filter_text}/"
        left_out = sum(self.swarm.model.jobs_left_out.values())
        if left_out:  # (a window of the queue and the latest finished: `swarm jobs` has all)
            hint += f"  +{left_out} not shown"
        return hint

    def select_job(self, job_id: str) -> None:
        """Put the cursor on a job: now, or once the screen and the job's row exist (a job
        just submitted reaches the table with the next event or refresh)."""
        self._select_later = job_id
        self._apply_selection()

    def _apply_selection(self) -> None:
        want = self._select_later
        if want is None:
            return
        try:
            table = self.table
        except NoMatches:  # not composed yet: sync() calls again
            return
        if want in table.shown_keys:
            table.move_cursor(row=table.get_row_index(want))
            self._select_later = None
        elif want in self.swarm.model.jobs and not table.matches(want):
            self._select_later = None  # filtered out: do not jump there later

    @property
    def selected_job(self) -> str | None:
        return self.table.cursor_key

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_watch()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        if event.column_key.value:
            self.table.set_sort(event.column_key.value)
            self.query_one(StatusBar).update_status()

    def action_watch(self) -> None:
        job = self.selected_job
        if job is not None:
            self.swarm.watch_job(job)

    def action_describe(self) -> None:
        job = self.selected_job
        if job is not None:
            self.app.push_screen(DescribeScreen("job", job))

    def action_cancel_job(self) -> None:
        job = self.selected_job
        if job is None:
            self.notify("no job selected", severity="warning")
            return
        self.swarm.ask_cancel(job)

    def action_filter(self) -> None:
        opens_field(self)
        bar = self.query_one(FilterBar)
        bar.add_class("-open")
        self.set_focus(bar.input)  # now, not after the keys already queued behind "/"

    def action_clear(self) -> None:
        bar = self.query_one(FilterBar)
        bar.input.value = ""
        bar.remove_class("-open")
        bar.show_error(None)
        self.table.set_filter("", list(self.swarm.model.jobs))
        self.table.focus()
        self.query_one(StatusBar).update_status()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter-input":
            error = self.table.set_filter(event.value, list(self.swarm.model.jobs))
            self.query_one(FilterBar).show_error(error)
            self.query_one(StatusBar).update_status()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter-input":
            event.stop()
            self.table.focus()

    def action_sort_next(self) -> None:
        keys = [c.key for c in JOB_COLUMNS]
        i = keys.index(self.table.sort_column)
        self.table.set_sort(keys[(i + 1) % len(keys)], reverse=False)
        self.query_one(StatusBar).update_status()

    def action_sort_reverse(self) -> None:
        self.table.set_sort(self.table.sort_column, reverse=not self.table.sort_reverse)
        self.query_one(StatusBar).update_status()


class JobWatchScreen(SwarmScreen):
    """One job, live: its loss curve and, per cell (stage, and replica when it has them),
    its fellow, step, loss, throughput, waits and sync."""

    AUTO_FOCUS = "LiveTable"

    EXPORT_NAME = "job"  # with the job id: export_label
    BINDINGS = [
        Binding("escape", "back", "Back", id="watch.back"),
        Binding("c", "cancel_job", "Cancel job", id="watch.cancel"),
        # Shape the links of the running job's cells, as `swarm set-speed --stage/--replica`:
        # the cell under the cursor, its stage group (every replica), its replica's chain.
        Binding("s", "set_speed", "Set speed", id="watch.set_speed"),
        Binding("S", "set_speed_group", "Stage group speed", show=False,
                id="watch.set_speed_group"),
        Binding("P", "set_speed_chain", "Replica chain speed", show=False,
                id="watch.set_speed_chain"),
        Binding("e", "export", "Export view", show=False, id="watch.export"),
        Binding("d", "describe", "Describe", show=False, id="watch.describe"),
        # The loss plot: a log y axis, and from a later step (a spike at step 1 flattens
        # the tail on a linear axis over the whole run).
        Binding("L", "log_y", "Log y", show=False, id="watch.log_y"),
        Binding("z", "zoom", "Zoom steps", show=False, id="watch.zoom"),
    ]
    # The zoom steps through these: the curve from the step this share of the way in.
    ZOOMS = (0.0, 0.1, 0.5, 0.9)
    CURVE_MIN = 9  # rows of the loss plot at 80x24 (five of data); more as the terminal grows

    def __init__(self, job_id: str) -> None:
        super().__init__()
        self.job_id = job_id
        self.log_y = False
        self.zoom = 0  # an index into ZOOMS

    def export_label(self) -> str:
        return self.job_id

    def compose(self) -> ComposeResult:
        yield StatusBar(self.job_id)
        with Vertical(id="watch"):
            yield Static(id="job-summary", classes="summary")
            yield Label(id="curve-label", classes="pane-title")
            yield MetricPlot(id="curve", classes="curve")
            yield LiveTable(watch_columns(self.view), self._cells, lambda key: key,
                            sort_column="stage", id="watch-table")
        yield SwarmFooter()

    REFETCH_S = 5.0  # a fetch that failed or was overtaken is tried again after this
    _fetched_at: float | None = None
    _plot_key: tuple[object, ...] | None = None

    def on_mount(self) -> None:
        # (SwarmScreen.on_mount runs too: Textual calls the handler of every class in the MRO)
        self._fetch()

    def _fetch(self) -> None:
        """The job with its whole loss history (the curve), loaded on open."""
        self._fetched_at = time.monotonic()
        self.swarm.fetch_job(self.job_id)

    @property
    def view(self) -> JobView | None:
        return self.swarm.model.jobs.get(self.job_id)

    def _cells(self, key: str) -> dict[str, Cell]:
        view = self.view
        assert view is not None
        return watch_cells(self.swarm.model, view, int(key))

    def _stage_keys(self, view: JobView) -> list[str]:
        # One row per cell, by its index in the placement (a fellow with several slots holds
        # several; with replicas, replica r of stage k is r x stages + k; under a layout, the
        # placement's cells id by id: JobView.cell_of).
        cells = range(len(view.info.fellows)) if view.info.fellows else sorted(view.per_stage)
        return [str(s) for s in cells]

    def sync(self, change: Change | None) -> None:
        view = self.view
        summary = self.query_one("#job-summary", Static)
        table = self.query_one(LiveTable)
        if view is None:
            summary.update(f"{self.job_id}: not known to the leader (yet)")
            table.rebuild([])  # no rows of a job that is gone (nor an export of them)
            return
        if change is not None and self.job_id not in change.jobs and not (
                change.fellows & set(view.info.fellows)) and not change.fellow_rows and \
                not change.ages:
            return
        info = view.info
        text = Text()
        text.append(f"{info.job_id} ", style="bold")
        text.append(f"{info.name} ({info.kind or '?'})  ")
        text.append(info.state, style=JOB_STATE_STYLE.get(info.state, ""))
        text.append(f"  {progress_bar(info.last_step, view.total_steps, 12)}")
        text.append(f"  loss {fmt_loss(info.last_loss)}")
        if info.started_at is not None:
            end = info.finished_at if info.finished_at is not None else \
                self.swarm.model.leader_now()
            text.append(f"  ran {fmt_age(end - info.started_at)}")
        ev = info.metrics.eval_loss
        if ev is not None:
            text.append(f"  eval {ev:.4f} (perplexity {perplexity(ev):.2f})")
        why = printable(info.waiting_for if info.state == "PENDING" else info.reason)
        if why:
            text.append(f"\n{why}", style="italic")
        if info.link_changes:
            text.append("\n" + describe_link_changes(info.link_changes,
                                                     total=info.link_changes_total), style="yellow")
        movers = move_fellows(info)
        for i in range(max(0, len(info.membership) - 3), len(info.membership)):
            ch = info.membership[i]  # (the newest: a loss curve is read against them)
            moved = []
            if ch.moved is not None:  # (a peer moved between stages: a layout's rebalancing)
                moved.append(move_text(ch.moved, movers.get(i)))
            if ch.departed:
                moved.append(ch.left_text())
            if ch.joined:
                moved.append(f"replica(s) {','.join(map(str, ch.joined))} joined")
            why = f" ({printable(ch.reason)})" if ch.reason else ""
            text.append(f"\n@{ch.step}: {', '.join(moved)}{why}", style="yellow")
        summary.update(text)
        if not view.history_loaded and (self._fetched_at is None or
                                        time.monotonic() - self._fetched_at > self.REFETCH_S):
            self._fetch()  # (events were missed meanwhile, or the last fetch failed)
        self._draw_curve(view)
        table.set_columns(watch_columns(view))  # (the job's record may come after the screen)
        table.rebuild(self._stage_keys(view))
        self.call_after_refresh(self._fit_curve)

    def _draw_curve(self, view: JobView, force: bool = False) -> None:
        # (heartbeats of its fellows redraw this view too: a long run's curve is rebuilt
        # only when it changed)
        info = view.info
        hist = info.loss_history
        key = (len(hist), tuple(hist[-1]) if hist else None, len(info.eval_history),
               len(info.link_changes), info.link_changes_total, len(info.membership),
               self.log_y, self.zoom, view.history_loaded)
        if key != self._plot_key or force:
            self._plot_key = key
            self.query_one("#curve-label", Label).update(
                curve_caption(view, self.from_step(view), self.log_y))
            self.query_one("#curve", MetricPlot).show(
                loss_plot(view, from_step=self.from_step(view), log_y=self.log_y))

    def from_step(self, view: JobView) -> int:
        """The first step the curve shows (the zoom's share of the steps recorded)."""
        share = self.ZOOMS[self.zoom]
        hist = view.info.loss_history
        if not share or not hist:
            return 0
        first, last = int(hist[0][0]), int(hist[-1][0])
        return first + int(share * (last - first))

    def on_resize(self) -> None:
        self.call_after_refresh(self._fit_curve)

    def _fit_curve(self) -> None:
        """The loss plot takes the rows the table does not need: 9 at 80x24 (five of data),
        more as the terminal grows; odd, so that the middle tick has a row of its own."""
        try:
            curve = self.query_one("#curve", MetricPlot)
            table = self.query_one(LiveTable)
            summary = self.query_one("#job-summary", Static)
        except NoMatches:
            return
        # status bar, footer, the curve's caption, the table's header and a spare row
        fixed = 1 + 1 + 1 + 2 + summary.outer_size.height
        rows = max(2, min(table.row_count, 12))
        height = max(self.CURVE_MIN, self.app.size.height - fixed - rows)
        if height % 2 == 0:
            height -= 1
        height = max(self.CURVE_MIN, height)
        if curve.styles.height is None or curve.styles.height.value != height:
            curve.styles.height = height

    def action_log_y(self) -> None:
        self.log_y = not self.log_y
        if self.view is not None:
            self._draw_curve(self.view)
        self.notify("loss plot: log y" if self.log_y else "loss plot: linear y")

    def action_zoom(self) -> None:
        self.zoom = (self.zoom + 1) % len(self.ZOOMS)
        view = self.view
        if view is not None:
            self._draw_curve(view)
            frm = self.from_step(view)
            self.notify(f"loss plot from step {frm}" if frm else "loss plot: the whole run")

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_describe(self) -> None:
        self.app.push_screen(DescribeScreen("job", self.job_id))

    def action_cancel_job(self) -> None:
        self.swarm.ask_cancel(self.job_id)

    def action_set_speed(self) -> None:
        self._set_speed(group=False, chain=False)

    def action_set_speed_group(self) -> None:
        self._set_speed(group=True, chain=False)

    def action_set_speed_chain(self) -> None:
        self._set_speed(group=False, chain=True)

    def _set_speed(self, *, group: bool, chain: bool) -> None:
        """Ask for link limits for the fellows of the cursor's cell, of its stage group
        (``group``) or of its replica's chain (``chain``)."""
        view, key = self.view, self.query_one(LiveTable).cursor_key
        if view is None or key is None:
            self.notify("no cell selected", severity="warning")
            return
        placement = view.info.placement
        if view.info.state != "RUNNING" or placement is None:
            self.notify(f"set-speed here shapes the cells of a running job; {self.job_id} is "
                        f"{view.info.state}", severity="warning")
            return
        stage, replica = view.cell_of(int(key))
        members = view.info.members
        if not group and members is not None and replica not in members:
            self.notify(f"replica {replica} has left {self.job_id}", severity="warning")
            return
        # (a replica that left holds nothing of the job: its fellow is not shaped)
        self.swarm.ask_set_speed(placement.fellows_of(None if chain else stage,
                                                      None if group else replica, members))


def _points(rows: list[list[float]]) -> list[tuple[float, float]]:
    return [(float(p[0]), float(p[1])) for p in rows if len(p) >= 2]


def curve_caption(view: JobView, from_step: int = 0, log_y: bool = False) -> str:
    """The loss plot's title: what it holds (the key to its marks is under it), and how it
    is zoomed (``z``: from a step; ``L``: log y)."""
    losses = [y for _x, y in _points(view.info.loss_history)]
    if not losses:
        return ("loss curve: loading the job's history…" if not view.history_loaded
                else "loss curve: no losses reported yet")
    zoom = (f"  from step {from_step} (z)" if from_step else "") + \
        ("  log y (L)" if log_y else "")
    return (f"loss curve: {len(losses)} points, first {fmt_loss(losses[0])}, "
            f"min {fmt_loss(min(losses))}, last {fmt_loss(losses[-1])}{zoom}")


def loss_plot(view: JobView, *, from_step: int = 0, log_y: bool = False) -> PlotSpec:
    """The job's loss by step (from ``from_step``), its eval losses marked, a vertical mark
    at each step from which a set-speed changed one of its links or a peer moved between
    stages, and (▼, ▲) where replicas left and joined."""
    pts = [p for p in _points(view.info.loss_history) if p[0] >= from_step]
    if log_y:
        pts = [p for p in pts if p[1] > 0]

    def shown(x: float) -> bool:
        return x >= from_step

    return PlotSpec(xs=tuple(x for x, _ in pts), ys=tuple(y for _, y in pts), x_label="step",
                    unit="loss", empty="", whole_x=True, log_y=log_y,
                    points=tuple(p for p in _points(view.info.eval_history)
                                 if shown(p[0]) and (p[1] > 0 or not log_y)),
                    marks=tuple(sorted({float(c.at_step) for c in view.info.link_changes
                                        if shown(c.at_step)}
                                       | {float(c.step) for c in view.info.membership
                                          if c.moved is not None and shown(c.step)})),
                    left=tuple(float(c.step) for c in view.info.membership
                               if c.departed and shown(c.step)),
                    joined=tuple(float(c.step) for c in view.info.membership
                                 if c.joined and shown(c.step)))
