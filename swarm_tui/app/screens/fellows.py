"""The home view (a live table of fellows) and the detail view of one fellow."""

from __future__ import annotations

import math
from collections.abc import Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.widgets import DataTable, Input, Label, Static

from swarm_core.protocol import PeerLinkState
from swarm_tui.app.cells import (
    FELLOW_COLUMNS,
    FELLOW_GRID_COLUMNS,
    SORTABLE_FELLOW_COLUMNS,
    STATUS_STYLE,
    Cell,
    fellow_age_cell,
    fellow_cells,
    fellow_haystack,
    fellow_job,
    grid_running,
    shown_status,
)
from swarm_tui.app.model import GONE_HIDDEN_S, Change, ClusterModel, FellowState
from swarm_tui.app.screens.base import FilterBar, SwarmScreen, opens_field
from swarm_tui.app.screens.record import DescribeScreen, FellowLogScreen
from swarm_tui.app.widgets.footer import SwarmFooter
from swarm_tui.app.widgets.graph import graph_top
from swarm_tui.app.widgets.live_table import LiveTable
from swarm_tui.app.widgets.plot import MetricPlot, PlotSpec, nice_top
from swarm_tui.app.widgets.status import StatusBar
from swarm_tui.fmt import (
    describe_link,
    fmt_age,
    fmt_bytes,
    fmt_devices,
    fmt_limit,
    fmt_loss,
    fmt_rate,
    fmt_tps,
)


class FellowsScreen(SwarmScreen):
    AUTO_FOCUS = "LiveTable"
    EXPORT_NAME = "fellows"
    BINDINGS = [
        Binding("s", "set_speed", "Speed", id="fellows.set_speed"),
        Binding("r", "release", "Release", id="fellows.release"),
        Binding("R", "release_all", "Release all", show=False, id="fellows.release_all"),
        Binding("space", "mark", "Mark", id="fellows.mark"),
        Binding("slash", "filter", "Filter", priority=True, id="fellows.filter"),
        Binding("o", "sort_next", "Sort", show=False, id="fellows.sort_next"),
        Binding("O", "sort_reverse", "Reverse sort", show=False, id="fellows.sort_reverse"),
        Binding("enter", "detail", "Detail", show=False, id="fellows.detail"),
        Binding("w", "watch", "Watch job", show=False, id="fellows.watch"),
        Binding("escape", "clear", "Clear filter/marks", show=False, id="fellows.clear"),
        Binding("e", "export", "Export view", show=False, id="fellows.export"),
        Binding("d", "describe", "Describe", show=False, id="fellows.describe"),
        Binding("l", "log", "Log", show=False, id="fellows.log"),
        Binding("C", "columns", "Columns", show=False, id="fellows.columns"),
        Binding("H", "toggle_gone", "Gone fellows", show=False, id="fellows.show_gone"),
        Binding("F", "forget", "Forget", show=False, id="fellows.forget"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.marked: set[int] = set()
        self._listed: list[str] = []

    def compose(self) -> ComposeResult:
        yield StatusBar("fellows")
        yield FilterBar()
        yield LiveTable(FELLOW_COLUMNS, self._cells, self._haystack, sort_column="id",
                        id="fellows-table")
        yield SwarmFooter()

    @property
    def table(self) -> LiveTable:
        return self.query_one(LiveTable)

    def _cells(self, key: str) -> dict[str, Cell]:
        st = self.swarm.model.fellows[int(key)]
        return fellow_cells(self.swarm.model, st, st.fellow_id in self.marked)

    def _haystack(self, key: str) -> str:
        return fellow_haystack(self.swarm.model.fellows[int(key)])

    def _keys(self) -> list[str]:
        """The rows: every fellow but those gone a while (``H`` shows them too)."""
        return [str(st.fellow_id)
                for st in self.swarm.model.shown_fellows(gone_too=self.swarm.show_gone)]

    def sync(self, change: Change | None) -> None:
        table = self.table
        fellows = self.swarm.model.fellows
        # (a wider job column while a job with replicas runs: a changed set lays out anew)
        columns = FELLOW_GRID_COLUMNS if grid_running(self.swarm.model) else FELLOW_COLUMNS
        if columns != table.spec:
            table.set_columns(columns)
            change = None
        listed = self._keys()
        if change is None or change.fellow_rows or listed != self._listed:
            # (also when a gone fellow's time is up: it leaves the default rows)
            self._listed = listed
            self.marked &= {int(k) for k in listed}
            table.rebuild(listed)
            return
        rows = set(listed)
        keys = [str(f) for f in change.fellows if f in fellows and str(f) in rows]
        if keys:
            table.update_rows(keys)
        if change.ages:
            table.update_column("hb", lambda k: fellow_age_cell(self.swarm.model,
                                                                fellows[int(k)]), skip=keys)

    def status_hint(self) -> str:
        try:
            table = self.table
        except Exception:
            return ""
        label = next(c.label for c in table.spec if c.key == table.sort_column)
        hint = f"sort {label}{'▼' if table.sort_reverse else '▲'}"
        if table.filter_text:
            hint += f"  /{table.filter_text}/ {table.row_count} shown"
        if self.marked:
            hint += f"  {len(self.marked)} marked"
        hidden = self.swarm.model.counts(gone_too=self.swarm.show_gone).get("hidden", 0)
        if hidden:
            hint += f"  {self.swarm.key_hint('fellows.show_gone', 'H')} shows gone"
        return hint

    def _refresh_status(self) -> None:
        self.query_one(StatusBar).update_status()

    # selection --------------------------------------------------------------------------------
    def selected_ids(self) -> list[int]:
        """Marked fellows, else the one under the cursor."""
        fellows = self.swarm.model.fellows
        if self.marked:
            return sorted(f for f in self.marked if f in fellows)
        key = self.table.cursor_key
        return [int(key)] if key is not None and int(key) in fellows else []

    def action_mark(self) -> None:
        table = self.table
        key = table.cursor_key
        if key is None:
            return
        self.marked ^= {int(key)}
        table.update_rows([key])
        table.action_cursor_down()
        self._refresh_status()

    def action_clear(self) -> None:
        bar = self.query_one(FilterBar)
        if bar.has_class("-open") or self.table.filter_text:
            bar.input.value = ""
            bar.remove_class("-open")
            bar.show_error(None)
            self.table.set_filter("", self._keys())
            self.table.focus()
        elif self.marked:
            self.marked.clear()
            self.table.rebuild(self._keys())
        self._refresh_status()

    # filter and sort --------------------------------------------------------------------------
    def action_filter(self) -> None:
        opens_field(self)
        bar = self.query_one(FilterBar)
        bar.add_class("-open")
        self.set_focus(bar.input)  # now, not after the keys already queued behind "/"

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id != "filter-input":
            return
        error = self.table.set_filter(event.value, self._keys())
        self.query_one(FilterBar).show_error(error)
        self._refresh_status()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter-input":
            event.stop()
            if not event.value:
                self.query_one(FilterBar).remove_class("-open")
            self.table.focus()

    def action_sort_next(self) -> None:
        keys = [c.key for c in SORTABLE_FELLOW_COLUMNS]
        table = self.table
        i = keys.index(table.sort_column) if table.sort_column in keys else -1
        table.set_sort(keys[(i + 1) % len(keys)], reverse=False)
        self._refresh_status()

    def action_sort_reverse(self) -> None:
        self.table.set_sort(self.table.sort_column, reverse=not self.table.sort_reverse)
        self._refresh_status()

    def sort_by(self, column: str) -> None:
        self.table.set_sort(column, reverse=False)
        self._refresh_status()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        column = event.column_key.value
        if column and column != "sel":
            self.table.set_sort(column)
            self._refresh_status()

    # actions ----------------------------------------------------------------------------------
    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.action_detail()

    def action_detail(self) -> None:
        key = self.table.cursor_key
        if key is not None:
            self.app.push_screen(FellowDetailScreen(int(key)))

    def action_set_speed(self) -> None:
        self.swarm.ask_set_speed(self.selected_ids())

    def action_describe(self) -> None:
        key = self.table.cursor_key
        if key is not None:
            self.app.push_screen(DescribeScreen("fellow", int(key)))

    def action_log(self) -> None:
        key = self.table.cursor_key
        if key is not None:
            self.app.push_screen(FellowLogScreen(int(key)))

    def action_release(self) -> None:
        self.swarm.ask_release(self.selected_ids())

    def action_release_all(self) -> None:
        self.swarm.ask_release_all()

    def action_forget(self) -> None:
        self.swarm.ask_forget(self.selected_ids())

    def action_toggle_gone(self) -> None:
        """Show the fellows gone a while (stale, offline, left), or hide them again."""
        app = self.swarm
        app.show_gone = not app.show_gone
        hidden = sum(1 for st in app.model.fellows.values() if app.model.hidden(st))
        self.sync(None)
        self._refresh_status()
        self.notify(f"showing {hidden} gone fellow{'s' if hidden != 1 else ''} too"
                    if app.show_gone else f"hiding {hidden} gone fellow"
                    f"{'s' if hidden != 1 else ''} (silent over {GONE_HIDDEN_S:.0f}s)")

    def action_watch(self) -> None:
        ids = self.selected_ids()
        st = self.swarm.model.fellows.get(ids[0]) if ids else None
        if st is None or st.job_id is None:
            self.notify("the selected fellow has no job", severity="warning")
            return
        self.swarm.watch_job(st.job_id)


class FellowDetailScreen(SwarmScreen):
    """Metric panes of one fellow: loss, tokens/s, link rates against limits, recent events."""

    BINDINGS = [
        Binding("escape", "back", "Back", id="detail.back"),
        Binding("s", "set_speed", "Speed", id="detail.set_speed"),
        Binding("r", "release", "Release", id="detail.release"),
        Binding("w", "watch", "Watch job", id="detail.watch"),
        Binding("d", "describe", "Describe", show=False, id="detail.describe"),
        Binding("l", "log", "Log", show=False, id="detail.log"),
    ]

    PLOT_MIN = 7  # rows of each pane's plot at 80x24 (three of data); more on a taller one

    def __init__(self, fellow_id: int) -> None:
        super().__init__()
        self.fellow_id = fellow_id

    def on_resize(self) -> None:
        self.call_after_refresh(self._fit_plots)

    def _fit_plots(self) -> None:
        """The panes' plots share the rows past 24 (odd heights: the middle tick has a row
        of its own); the events stay below them, scrolled to."""
        extra = max(0, self.app.size.height - 24)
        height = self.PLOT_MIN + extra // 2
        if height % 2 == 0:
            height -= 1
        for plot in self.query(MetricPlot):
            if plot.styles.height is None or plot.styles.height.value != height:
                plot.styles.height = height

    def compose(self) -> ComposeResult:
        yield StatusBar(f"fellow {self.fellow_id}")
        with VerticalScroll(id="detail"):
            yield Static(id="summary", classes="summary")
            for row in (("loss", "tps"), ("tx", "rx")):
                with Horizontal(classes="panes"):
                    for metric in row:
                        with Vertical(classes="pane"):
                            yield Label(id=f"{metric}-label", classes="pane-title")
                            yield MetricPlot(id=f"{metric}-plot", classes="plot")
            yield Label("recent events", classes="pane-title")
            yield Static(id="events", classes="events")
        yield SwarmFooter()

    @property
    def state(self) -> FellowState | None:
        return self.swarm.model.fellows.get(self.fellow_id)

    def sync(self, change: Change | None) -> None:
        try:
            self._sync(change)
        except NoMatches:  # (the panes not mounted yet, on a quick push: draw once they are)
            self.call_after_refresh(self.sync, None)

    def _sync(self, change: Change | None) -> None:
        if change is not None and not change.fellow_rows and not change.ages and \
                self.fellow_id not in change.fellows:
            return
        st = self.state
        summary = self.query_one("#summary", Static)
        if st is None:
            summary.update(f"fellow {self.fellow_id} is no longer known to the leader")
            return
        model = self.swarm.model
        view = model.jobs.get(st.job_id) if st.job_id is not None else None
        # (of a job with replicas: its cell, as the table names it)
        where = fellow_job(model, st)[0] if view is not None and view.grid else (
            f"{st.job_id}" + ("" if st.stage is None else f" stage {st.stage}"))
        job = "no job" if st.job_id is None else (
            where + f"  step {st.step}  loss {fmt_loss(st.loss)}  "
            f"{fmt_tps(st.tokens_per_s)} tok/s")
        c = st.counters
        text = Text()
        text.append(f"{st.fellow_id} {st.name}", style="bold")
        status = shown_status(model, st)
        text.append(f"  {status}", style=STATUS_STYLE.get(status, ""))
        text.append(f"  hb {fmt_age(model.heartbeat_age(st))}  node {st.host or '-'}"
                    f"  slots {fmt_devices(st.devices)}  threads {st.threads}\n")
        if st.note:
            text.append(f"note: {st.note}\n", style="bold yellow")
        text.append(f"{job}\n")
        text.append(f"link {describe_link(st.tx_limit, st.rx_limit, st.latency_ms)}\n")
        text.append(f"bytes data tx {fmt_bytes(c.get('data_tx'), compact=True)} "
                    f"rx {fmt_bytes(c.get('data_rx'), compact=True)}"
                    f"  control tx {fmt_bytes(c.get('control_tx'), compact=True)}"
                    f" rx {fmt_bytes(c.get('control_rx'), compact=True)}")
        for line in peer_lines(st.peers):
            text.append(f"\n{line}")
        summary.update(text)
        self._fit_plots()
        now = model.leader_now()
        self.query_one("#loss-label", Label).update(loss_caption(model, st))
        self.query_one("#loss-plot", MetricPlot).show(fellow_loss_plot(model, st))
        tps = [v for _ts, v in st.tps_hist]
        self.query_one("#tps-label", Label).update(
            f"tokens/s {fmt_tps(st.tokens_per_s)}" + (f"  (max {fmt_tps(max(tps))})" if tps
                                                       else ""))
        self.query_one("#tps-plot", MetricPlot).show(
            timed_plot(st.tps_hist, now, st.speed_marks, unit="tok/s", y_min=0.0,
                       y_max=nice_top(max(tps, default=0.0) * 1.05)))
        live = not model.gone(st)
        for side, rate, limit, hist in (("tx", st.tx_mbps, st.tx_limit, st.tx_hist),
                                        ("rx", st.rx_mbps, st.rx_limit, st.rx_hist)):
            use = "" if rate is None or limit is None else f" ({100 * rate / limit:.0f}%)"
            # The added latency delays what is sent: it belongs with the tx rate.
            lat = f" +{st.latency_ms:g} ms" if side == "tx" and st.latency_ms else ""
            self.query_one(f"#{side}-label", Label).update(
                f"{side} {fmt_rate(rate)} of {fmt_limit(limit)} Mbit/s{use}{lat}")
            # On the limit's scale, from 0: an idle link is a line along the bottom.
            top = graph_top(limit, [v for _ts, v in hist])
            # (up to now: a rate is sampled when it changes, so the last one holds since,
            # while the fellow is heard from)
            self.query_one(f"#{side}-plot", MetricPlot).show(
                timed_plot(hist, now, st.speed_marks, unit="Mbit/s", y_min=0.0, y_max=top,
                           limit=limit, held=live))
        now = model.leader_now()
        lines = [f"{fmt_age(now - ts):>4} ago  {text}" for ts, text in list(st.events)[-12:]]
        self.query_one("#events", Static).update(Text("\n".join(reversed(lines)) or "none yet"))

    def action_back(self) -> None:
        self.app.pop_screen()

    def action_set_speed(self) -> None:
        self.swarm.ask_set_speed([self.fellow_id])

    def action_release(self) -> None:
        self.swarm.ask_release([self.fellow_id])

    def action_describe(self) -> None:
        self.app.push_screen(DescribeScreen("fellow", self.fellow_id))

    def action_log(self) -> None:
        self.app.push_screen(FellowLogScreen(self.fellow_id))

    def action_watch(self) -> None:
        st = self.state
        if st is None or st.job_id is None:
            self.notify("this fellow has no job", severity="warning")
            return
        self.swarm.watch_job(st.job_id)


def peer_lines(peers: Iterable[PeerLinkState]) -> list[str]:
    """One line per link a job's link matrix shapes: the cells and sites it joins, the pair's
    rate and latency, what it moved and the rate its frames left at."""
    lines = []
    for p in peers:
        jitter = f" ±{p.jitter_ms:g}" if p.jitter_ms else ""
        at = "" if p.achieved_mbps is None else f"  sent at {fmt_rate(p.achieved_mbps)} Mbit/s"
        to = "" if p.peer_fellow is None else f" (fellow {p.peer_fellow})"
        lines.append(f"pair {p.cell} -> {p.peer}{to} {p.site}->{p.peer_site}: "
                     f"{fmt_limit(p.tx_mbps)} Mbit/s +{p.latency_ms:g}{jitter} ms  "
                     f"tx {fmt_bytes(p.tx_bytes, compact=True)} "
                     f"rx {fmt_bytes(p.rx_bytes, compact=True)}{at}")
    return lines


def loss_caption(model: ClusterModel, st: FellowState) -> str:
    """The loss pane's title. Only a job's last stage computes a loss: an earlier stage's
    pane says so rather than "no steps yet" hundreds of steps in."""
    losses = [loss for _, loss in st.loss_hist]
    if losses:
        return (f"loss {fmt_loss(losses[-1])}  (min {fmt_loss(min(losses))}, "
                f"{len(losses)} steps)")
    if st.job_id is None:
        return "loss: no job"
    view = model.jobs.get(st.job_id)
    stages = view.info.topology.stages if view is not None else None
    if st.stage is not None and stages and st.stage < stages - 1:
        return f"loss: computed on the last stage ({stages - 1}), not here"
    return "loss: no steps yet" if not st.step else "loss: none reported yet"


def fellow_loss_plot(model: ClusterModel, st: FellowState) -> PlotSpec:
    """Its job's loss by step as this fellow saw it, marked where a set-speed changed its own
    link during the job."""
    view = model.jobs.get(st.job_id) if st.job_id is not None else None
    marks: tuple[float, ...] = ()
    evals: tuple[tuple[float, float], ...] = ()
    if view is not None:
        marks = tuple(sorted({float(c.at_step) for c in view.info.link_changes
                              if c.fellow_id == st.fellow_id}))
        # (the job's eval losses, on the stage that computes its loss)
        first = st.loss_hist[0][0] if st.loss_hist else math.inf
        evals = tuple((float(p[0]), float(p[1])) for p in view.info.eval_history
                      if len(p) >= 2 and p[0] >= first)
    return PlotSpec(xs=tuple(float(s) for s, _ in st.loss_hist),
                    ys=tuple(v for _, v in st.loss_hist), x_label="step", unit="loss",
                    empty="", marks=marks, points=evals, whole_x=True)


def timed_plot(hist: Iterable[tuple[float, float]], now: float, marks: Iterable[float], *,
               unit: str, y_min: float | None = None, y_max: float | None = None,
               limit: float | None = None, held: bool = False) -> PlotSpec:
    """Samples against the seconds to ``now`` (leader time: 0 is now, at the right, -30
    half a minute ago; the axis runs to now, also when the newest sample is older), a
    vertical mark at each set-speed sent meanwhile. ``held``: the newest value still holds
    (a rate sampled on change), drawn on to now."""
    samples = [(round(ts - now, 3), v) for ts, v in hist]
    if held and samples and samples[-1][0] < 0:
        samples.append((0.0, samples[-1][1]))
    return PlotSpec(xs=tuple(x for x, _ in samples),
                    ys=tuple(v for _, v in samples), x_label="seconds", unit=unit,
                    empty="no samples yet", y_min=y_min, y_max=y_max, limit=limit,
                    marks=tuple(round(ts - now, 3) for ts in marks), x_hi=0.0)
