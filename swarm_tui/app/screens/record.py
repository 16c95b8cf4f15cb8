"""Full-screen text views of one fellow or job: its whole record (``d``, describe) and a
fellow's log (``l``)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Input, Label, Static

from swarm_core import jsonio
from swarm_core.client import ClientError
from swarm_core.contract import FellowLog
from swarm_core.contract.fellow_log import MAX_LINE_CHARS
from swarm_core.schema import unstructure
from swarm_core.validators import log_line
from swarm_tui.app.model import Change
from swarm_tui.app.screens.base import SwarmScreen, opens_field
from swarm_tui.app.widgets.field import Field
from swarm_tui.app.widgets.footer import SwarmFooter
from swarm_tui.app.widgets.status import StatusBar
from swarm_tui.fmt import fmt_age

LOG_LINES = 200  # of a local fellow's log file, or of a remote one's through the leader
LOG_REFRESH_S = 1.5  # a remote fellow's tail, fetched again (it sends each second while read)
TAIL_BYTES = 64 * 1024


class DescribeScreen(SwarmScreen):
    """The leader's whole record of a fellow (``GET /fellows/{id}``) or a job
    (``GET /jobs/{id}``, with its loss history), as formatted JSON with its times as times,
    fetched on open (``ctrl+r`` fetches it again). It scrolls as the tables move (``j``/``k``,
    ``g``/``G``) and ``/`` searches it (``n``/``N``: the next and previous match)."""

    AUTO_FOCUS = "#record"
    BINDINGS = [
        Binding("escape", "back", "Back", id="describe.back"),
        Binding("ctrl+r", "reload", "Fetch again", id="describe.reload"),
        Binding("slash", "search", "Search", priority=True, id="describe.search"),
        Binding("n", "next_match", "Next match", show=False, id="describe.next_match"),
        Binding("N", "previous_match", "Previous match", show=False,
                id="describe.previous_match"),
        Binding("j", "scroll('down')", "Down", show=False, id="describe.down"),
        Binding("k", "scroll('up')", "Up", show=False, id="describe.up"),
        Binding("g", "scroll('top')", "Top", show=False, id="describe.top"),
        Binding("G", "scroll('bottom')", "Bottom", show=False, id="describe.bottom"),
    ]
    DEFAULT_CSS = """
    DescribeScreen > #record { height: 1fr; }
    #record-search { height: 1; display: none; }
    #record-search.-open { display: block; }
    #record-search > Label { width: auto; padding: 0 1; }
    #record-search > Input { width: 1fr; }
    #record-search > #search-status { color: $text-muted; }
    """

    def __init__(self, kind: str, ident: str | int) -> None:
        super().__init__()
        self.kind, self.ident = kind, ident  # "fellow" | "job"
        self.text = ""  # what is shown (tests read it)
        self.matches: list[int] = []  # the lines the search finds
        self.match = -1  # the one it is on

    def compose(self) -> ComposeResult:
        yield StatusBar(f"{self.kind} {self.ident}")
        with VerticalScroll(id="record"):
            yield Static(f"fetching {self.kind} {self.ident}…", id="record-text")
        with Horizontal(id="record-search"):
            yield Label("search /")
            yield Field(placeholder="text in the record (n / N: next, previous)",
                        compact=True, id="search-input")
            yield Label("", id="search-status")
        yield SwarmFooter()

    def on_mount(self) -> None:
        self.action_reload()

    def action_reload(self) -> None:
        self.run_worker(self._fetch(), exclusive=True, group="describe",
                        description=f"describe {self.kind}")

    async def _fetch(self) -> None:
        client = self.swarm.client
        try:
            record = await (client.fellow(int(self.ident)) if self.kind == "fellow"
                            else client.job(str(self.ident)))
        except ClientError as exc:
            self.query_one("#record-text", Static).update(
                Text(f"{self.kind} {self.ident}: {exc}", style="bold red"))
            return
        self.text = jsonio.dumps(with_times(unstructure(record)), pretty=True).decode()
        self._find(self.query_one("#search-input", Input).value, jump=False)

    @property
    def scroller(self) -> VerticalScroll:
        return self.query_one("#record", VerticalScroll)

    def action_scroll(self, where: str) -> None:
        scroll = self.scroller
        {"down": lambda: scroll.scroll_down(animate=False),
         "up": lambda: scroll.scroll_up(animate=False),
         "top": lambda: scroll.scroll_home(animate=False),
         "bottom": lambda: scroll.scroll_end(animate=False)}[where]()

    # search -----------------------------------------------------------------------------------
    def action_search(self) -> None:
        opens_field(self)
        bar = self.query_one("#record-search")
        bar.add_class("-open")
        self.set_focus(self.query_one("#search-input", Input))  # (now: the keys behind "/")

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "search-input":
            self._find(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "search-input":
            event.stop()
            if not event.value:
                self.query_one("#record-search").remove_class("-open")
            self.scroller.focus()  # (n / N go on from here)

    def action_next_match(self) -> None:
        self._step(1)

    def action_previous_match(self) -> None:
        self._step(-1)

    def _find(self, query: str, jump: bool = True) -> None:
        """The lines holding ``query`` (any case); to the first at or below the top line."""
        needle = query.strip().lower()
        lines = self.text.splitlines()
        self.matches = [i for i, line in enumerate(lines) if needle and needle in line.lower()]
        top = self._line_at(self.scroller.scroll_y)
        self.match = next((n for n, i in enumerate(self.matches) if i >= top),
                          0 if self.matches else -1)
        self._show(needle, jump)

    def _step(self, by: int) -> None:
        if not self.matches:
            self.notify("no match" if self.query_one("#search-input", Input).value
                        else "nothing searched: / searches", timeout=2)
            return
        self.match = (self.match + by) % len(self.matches)
        self._show(self.query_one("#search-input", Input).value.strip().lower(), True)

    def _show(self, needle: str, jump: bool) -> None:
        status = self.query_one("#search-status", Label)
        if needle:
            status.update(f"{self.match + 1}/{len(self.matches)}" if self.matches
                          else "no match")
        else:
            status.update("")
        if not self.text:
            return
        syntax = Syntax(self.text, "json", word_wrap=True, background_color="default")
        lines = self.text.splitlines()
        for n, i in enumerate(self.matches):
            low = lines[i].lower()
            at = low.find(needle)
            while at >= 0:
                syntax.stylize_range("bold black on yellow" if n == self.match else "reverse",
                                     (i + 1, at), (i + 1, at + len(needle)))
                at = low.find(needle, at + len(needle))
        self.query_one("#record-text", Static).update(syntax)
        if jump and self.matches:
            y = self._y_of(self.matches[self.match])
            self.scroller.call_after_refresh(self.scroller.scroll_to, y=max(0, y - 2),
                                             animate=False)

    def _wrapped(self) -> list[int]:
        """The rows each line of the record takes at the view's width (long ones wrap)."""
        width = max(1, self.query_one("#record-text", Static).size.width
                    or self.app.size.width - 2)
        console = self.app.console
        return [1 if cell_len(line) <= width else len(Text(line).wrap(console, width))
                for line in self.text.splitlines()]

    def _y_of(self, line: int) -> int:
        return sum(self._wrapped()[:line])

    def _line_at(self, y: float) -> int:
        row = 0
        for i, rows in enumerate(self._wrapped()):
            if row + rows > y:
                return i
            row += rows
        return 0

    def action_back(self) -> None:
        bar = self.query_one("#record-search")
        if bar.has_class("-open"):  # (esc closes the search first)
            bar.remove_class("-open")
            self.query_one("#search-input", Input).value = ""
            self.scroller.focus()
            return
        self.app.pop_screen()


# A record's fields that hold a time (the leader's clock, seconds since the epoch).
_TIME_KEY = re.compile(r"(^|_)(at|ts|time)$|^last_heartbeat$")


def with_times(value: Any, key: str = "") -> Any:
    """The record with each time field as a time (``2023-11-14 22:13:20.5 UTC``, the
    console's time zone) rather than seconds since 1970."""
    if isinstance(value, dict):
        return {k: with_times(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [with_times(v) for v in value]
    if _TIME_KEY.search(key) and isinstance(value, int | float) and not isinstance(value, bool):
        return fmt_time(float(value))
    return value


def fmt_time(ts: float) -> str:
    try:
        when = time.localtime(ts)
    except (OverflowError, OSError, ValueError):
        return repr(ts)
    tenths = f"{ts % 1:.1f}"[1:] if ts % 1 >= 0.05 else ""
    return time.strftime("%Y-%m-%d %H:%M:%S", when) + tenths + time.strftime(" %Z", when)


class FellowLogScreen(SwarmScreen):
    """A fellow's log: what the console saw of it (registrations, status changes, jobs,
    set-speeds), then its own log: the tail of its log file for a fellow of this console's
    local cluster, else the tail the fellow sends the leader while someone reads it
    (``GET /fellows/{id}/log``), fetched again every ``LOG_REFRESH_S``."""

    BINDINGS = [Binding("escape", "back", "Back", id="log.back")]

    def __init__(self, fellow_id: int) -> None:
        super().__init__()
        self.fellow_id = fellow_id
        self.text = ""
        # The leader's answer (or why there is none), for a fellow not of the local cluster.
        self.remote: FellowLog | str | None = None
        self._fetching = False

    def compose(self) -> ComposeResult:
        yield StatusBar(f"fellow {self.fellow_id} log")
        with VerticalScroll(id="log"):
            yield Static(id="log-text")
        yield SwarmFooter()

    def on_mount(self) -> None:  # (SwarmScreen's on_mount runs too: Textual calls each)
        self._poll()
        # (also while the fellow is local: it may be a remote one by the next refresh, after
        # a restart-cluster; then the leader's tail is already being fetched)
        self.set_interval(LOG_REFRESH_S, self._poll)

    def _poll(self) -> None:
        # (one fetch at a time: a slow leader's answer is waited for, not cancelled by the
        # next refresh)
        if self.is_current and not self._fetching and self._local_fellow() is None:
            self._fetching = True
            self.run_worker(self._fetch_remote(), group="fellow-log", description="fellow log")

    async def _fetch_remote(self) -> None:
        try:
            self.remote = await self.swarm.client.fellow_log(self.fellow_id, LOG_LINES)
        except ClientError as exc:  # (shown in place: a notice every refresh would pile up)
            self.remote = f"not reachable through the leader: {exc}"
        finally:
            self._fetching = False
        if self.is_attached:
            self.sync(None)

    def _local_fellow(self) -> tuple[str, str] | None:
        st = self.swarm.model.fellows.get(self.fellow_id)
        return None if st is None else local_log(st.name, self.swarm.leader_url)

    def sync(self, change: Change | None) -> None:
        if change is not None and self.fellow_id not in change.fellows and not change.ages:
            return
        st = self.swarm.model.fellows.get(self.fellow_id)
        if st is None:
            self.text = f"fellow {self.fellow_id} is no longer known to the leader"
        else:
            now = self.swarm.model.leader_now()
            lines = [f"{fmt_age(now - ts):>5} ago  {text}" for ts, text in st.events]
            self.text = (f"{st.fellow_id} {st.name}: what the console saw, newest last\n"
                         + ("\n".join(lines) or "nothing yet"))
            own = local_log(st.name, self.swarm.leader_url)
            if own is not None:
                self.text += f"\n\n{own[0]} (last {LOG_LINES} lines)\n{own[1]}"
            else:
                self.text += "\n\n" + remote_text(self.remote)
        scroll = self.query_one("#log", VerticalScroll)
        at_end = scroll.scroll_y >= scroll.max_scroll_y  # (tail -f: follow unless scrolled up)
        self.query_one("#log-text", Static).update(Text(self.text))
        if at_end:
            scroll.call_after_refresh(scroll.scroll_end, animate=False)

    def action_back(self) -> None:
        self.app.pop_screen()


def remote_text(got: FellowLog | str | None) -> str:
    """The part of the log view that the leader relays: its own log, or why it is missing."""
    title = "its own log, through the leader"
    if got is None:
        return f"{title}: fetching…"
    if isinstance(got, str):
        return f"{title}: {got}"
    if got.received_at is None:
        return f"{title}: {got.message}"
    # (seconds with a tenth while fresh: a tail that keeps coming reads as such)
    age = "?" if got.age_s is None else (
        f"{got.age_s:.1f}s" if got.age_s < 10 else fmt_age(got.age_s))
    note = f"; {got.message}" if got.message else ""
    return f"{title} (last {len(got.lines)} lines, as of {age} ago{note})\n" + \
        "\n".join(got.lines)


def local_log(name: str, leader_url: str) -> tuple[str, str] | None:
    """The path and tail of a local-cluster fellow's log file, by its name in the record,
    when the record's leader is the console's (a remote leader's fellow may share a name)."""
    from swarm_core.local_cluster import record_of

    record = record_of(leader_url)
    if record is None:
        return None
    entry = next((f for f in record.fellows if f.name == name), None)
    if entry is None:
        return None
    try:
        with Path(entry.log).open("rb") as f:  # (the tail only: a log grows for days)
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            data = f.read()
    except OSError:
        return None
    # (the file holds whatever the fellow's process wrote: shown, never obeyed by the terminal)
    lines = [log_line(ln, MAX_LINE_CHARS) for ln in data.decode(errors="replace").splitlines()]
    return entry.log, "\n".join(lines[-LOG_LINES:])
