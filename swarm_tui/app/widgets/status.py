"""The one-line bar at the top of every view: where we are, the leader's state, the counts."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual.widgets import Static

from swarm_tui.app.model import LEFT

TIERS = 8  # top-bar lines from the richest to the barest (see update_status)

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
        # textual types .app as the base App; this console only ever runs in a SwarmApp.
        return self.app  # type: ignore[return-value]

    def on_mount(self) -> None:
        self.swarm.model_changed.subscribe(self, self._on_model, immediate=True)
        self.watch(self.swarm, "connection", self._on_connection, init=False)
        self.update_status()

    def _on_model(self, _change: Any) -> None:
        self.update_status()

    def _on_connection(self, _value: str) -> None:
        self.update_status()

    def on_resize(self) -> None:
        self.update_status()

    def update_status(self) -> None:
        """The richest line that fits: the leader's address and its state always show
        (an 80-column SSH terminal cut them off), the counts and the view's hint give way
        first."""
        width = self.size.width or self.app.size.width
        lines = [self._line(tier) for tier in range(TIERS)]
        fits = next((line for line in lines if line.cell_len <= width), lines[-1])
        self.update(fits)

    def _line(self, tier: int) -> Text:
        """``tier`` 0 is everything; each one after gives up one more thing: the view's hint,
        the busy count (and "jobs"), the queued count, the connection's asides, its detail,
        the fellow counts, and last the running count (a job's watch, whose name is longer,
        lost it at 80 columns)."""
        app = self.swarm
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f" {self.view} ", style="bold reverse")
        if app.read_only:
            line.append(" READ-ONLY " if tier < 4 else " RO ", style="bold black on yellow")
        line.append(" ")
        state, detail = app.connection, app.connection_detail
        # The connection in full, without its asides (tier 4), or in a word (5 on).
        full, brief = tier < 4, tier >= 5
        if state == "live":
            line.append("● live", style="bold green")
        elif state == "polling":
            line.append("◐ polling", style="yellow")
            if full:
                line.append(f" ({detail})", style="yellow")
        elif state == "lost":
            when = detail.partition(": ")[0] if detail.startswith("next try") else ""
            line.append("✖ leader lost, retrying" + (f"… {detail}" if full else
                                                      f" ({when})" if when and not brief
                                                      else ""), style="bold red")
        elif state == "refused":
            line.append(f"✖ {detail} (retrying)" if full else "✖ leader refused (retrying)"
                        if brief else f"✖ {_without_asides(detail)}", style="bold red")
        else:
            line.append("◌ connecting…", style="yellow")
        if tier < 6:
            # (of the rows the fellows view lists, by the status they show: they agree)
            counts = app.model.counts(gone_too=app.show_gone)
            present = sum(n for status, n in counts.items()
                          if status not in LEFT and status not in ("left", "hidden"))
            line.append(f"  {present} fellow{'' if present == 1 else 's'}", style="bold")
            if counts.get("busy") and tier < 2:
                line.append(f" · {counts['busy']} busy")
            stale = counts.get("stale", 0) + counts.get("offline", 0)
            if stale:
                line.append(f" · {stale} stale", style="bold red")
            if counts.get("hidden") and tier < 2:  # (gone a while: the fellows view's H)
                line.append(f" +{counts['hidden']} gone", style="dim")
        if tier < 7:
            jobs = app.model.job_counts()
            line.append("  jobs " if tier < 2 else "  ")
            line.append(f"{jobs.get('RUNNING', 0)} running")
            if tier < 3:
                line.append(f" · {jobs.get('PENDING', 0)} queued")
        hint = getattr(self.screen, "status_hint", None)
        if tier < 1 and callable(hint):
            extra = hint()
            if extra:
                line.append("  " + extra, style="italic")
        line.append(f"  @ {app.leader_url.split('://', 1)[-1]}", style="dim")
        return line


def _without_asides(text: str) -> str:
    """``missing or wrong bearer token (see SWARM_TOKEN or --token)`` -> without the
    parenthesis."""
    return re.sub(r"\s*\([^()]*\)", "", text).strip()
