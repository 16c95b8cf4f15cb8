"""Full-screen text views of one fellow or job: its whole record (``d``, describe) and a
fellow's log (``l``)."""

from __future__ import annotations

from pathlib import Path

from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Static

from swarm_core import jsonio
from swarm_core.client import ClientError
from swarm_core.contract import FellowLog
from swarm_core.contract.fellow_log import MAX_LINE_CHARS
from swarm_core.schema import unstructure
from swarm_core.validators import log_line
from swarm_tui.app.model import Change
from swarm_tui.app.screens.base import SwarmScreen
from swarm_tui.app.widgets.footer import SwarmFooter
from swarm_tui.app.widgets.status import StatusBar
from swarm_tui.fmt import fmt_age

LOG_LINES = 200  # of a local fellow's log file, or of a remote one's through the leader
LOG_REFRESH_S = 1.5  # a remote fellow's tail, fetched again (it sends each second while read)
TAIL_BYTES = 64 * 1024


class DescribeScreen(SwarmScreen):
    """The leader's whole record of a fellow (``GET /fellows/{id}``) or a job
    (``GET /jobs/{id}``, with its loss history), as formatted JSON, fetched on open; ``r``
    fetches it again."""

    BINDINGS = [
        Binding("escape", "back", "Back", id="describe.back"),
        Binding("ctrl+r", "reload", "Fetch again", id="describe.reload"),
    ]

    def __init__(self, kind: str, ident: str | int) -> None:
        super().__init__()
        self.kind, self.ident = kind, ident  # "fellow" | "job"
        self.text = ""  # what is shown (tests read it)

    def compose(self) -> ComposeResult:
        yield StatusBar(f"{self.kind} {self.ident}")
        with VerticalScroll(id="record"):
            yield Static(f"fetching {self.kind} {self.ident}…", id="record-text")
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
        self.text = jsonio.dumps(unstructure(record), pretty=True).decode()
        self.query_one("#record-text", Static).update(
            Syntax(self.text, "json", word_wrap=True, background_color="default"))

    def action_back(self) -> None:
        self.app.pop_screen()


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
    from swarm_core.local_cluster import ClusterError, read_record

    try:
        record = read_record()
    except ClusterError:
        return None
    if record is None or record.leader_url.rstrip("/") != leader_url.rstrip("/"):
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
