"""The one-line bar at the top of every view: where we are, the leader's state, the counts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.widgets import Static

if TYPE_CHECKING:
    from swarm_tui.app.app import SwarmApp


class StatusBar(Static):
    DEFAULT_CSS = """
    StatusBar {
        dock: top;
        height: 1;
        background: $panel;
        color: $foreground;
    }
    """

    def __init__(self, view: str, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = view

    @property
    def swarm(self) -> SwarmApp:
        return self.app  # type: ignore[return-value]

    def on_mount(self) -> None:
        self.swarm.model_changed.subscribe(self, self._on_model, immediate=True)
        self.watch(self.swarm, "connection", self._on_connection, init=False)
        self.update_status()

    def _on_model(self, _change: Any) -> None:
        self.update_status()

    def _on_connection(self, _value: str) -> None:
        self.update_status()

    def update_status(self) -> None:
        app = self.swarm
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f" {self.view} ", style="bold reverse")
        if app.read_only:
            line.append(" READ-ONLY ", style="bold black on yellow")
        line.append(" ")
        state, detail = app.connection, app.connection_detail
        if state == "live":
            line.append("● live", style="bold green")
        elif state == "polling":
            line.append("◐ polling", style="yellow")
            line.append(f" ({detail})", style="yellow")
        elif state == "lost":
            line.append(f"✖ leader lost, retrying… {detail}", style="bold red")
        elif state == "refused":
            line.append(f"✖ {detail} (retrying)", style="bold red")
        else:
            line.append("◌ connecting…", style="yellow")
        counts = app.model.counts()
        line.append(f"  {sum(counts.values())} fellows", style="bold")
        if counts.get("busy"):
            line.append(f" · {counts['busy']} busy")
        stale = counts.get("stale", 0) + counts.get("offline", 0)
        if stale:
            line.append(f" · {stale} stale", style="bold red")
        jobs = app.model.job_counts()
        line.append(f"  jobs {jobs.get('RUNNING', 0)} running · {jobs.get('PENDING', 0)} queued")
        hint = getattr(self.screen, "status_hint", None)
        if callable(hint):
            extra = hint()
            if extra:
                line.append("  " + extra, style="italic")
        line.append(f"  @ {app.leader_url.split('://', 1)[-1]}", style="dim")
        self.update(line)
