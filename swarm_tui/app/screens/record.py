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
from swarm_core.schema import unstructure
from swarm_tui.app.model import Change
from swarm_tui.app.screens.base import SwarmScreen
from swarm_tui.app.widgets.footer import SwarmFooter
from swarm_tui.app.widgets.status import StatusBar
from swarm_tui.fmt import fmt_age

LOG_LINES = 200  # of a local fellow's log file
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
    set-speeds), and for a fellow of the local cluster the tail of its own log file. (The
    leader keeps no fellow's output, so a remote fellow's own log is not reachable here.)"""

    BINDINGS = [Binding("escape", "back", "Back", id="log.back")]

    def __init__(self, fellow_id: int) -> None:
        super().__init__()
        self.fellow_id = fellow_id
        self.text = ""

    def compose(self) -> ComposeResult:
        yield StatusBar(f"fellow {self.fellow_id} log")
        with VerticalScroll(id="log"):
            yield Static(id="log-text")
        yield SwarmFooter()

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
            own = local_log(st.name)
            if own is not None:
                self.text += f"\n\n{own[0]} (last {LOG_LINES} lines)\n{own[1]}"
        self.query_one("#log-text", Static).update(Text(self.text))

    def action_back(self) -> None:
        self.app.pop_screen()


def local_log(name: str) -> tuple[str, str] | None:
    """The path and tail of a local-cluster fellow's log file, by its name in the record."""
    from swarm_core.local_cluster import ClusterError, read_record

    try:
        record = read_record()
    except ClusterError:
        return None
    entry = next((f for f in record.fellows if f.name == name), None) if record else None
    if entry is None:
        return None
    try:
        with Path(entry.log).open("rb") as f:  # (the tail only: a log grows for days)
            f.seek(0, 2)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            data = f.read()
    except OSError:
        return None
    lines = data.decode(errors="replace").splitlines()
    return entry.log, "\n".join(lines[-LOG_LINES:])
