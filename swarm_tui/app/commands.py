"""Command palette entries (ctrl+p), named "group: action"."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from textual.command import DiscoveryHit, Hit, Hits, Provider

from swarm_tui.app.cells import SORTABLE_FELLOW_COLUMNS

if TYPE_CHECKING:
    from swarm_tui.app.app import SwarmApp

Command = tuple[str, Callable[[], object], str]


class SwarmCommands(Provider):
    @property
    def swarm(self) -> SwarmApp:
        return self.app  # type: ignore[return-value]

    def commands(self) -> list[Command]:
        from swarm_tui.app.screens.fellows import FellowDetailScreen, FellowsScreen
        from swarm_tui.app.screens.jobs import JobsScreen, JobWatchScreen

        app = self.swarm
        screen = self.screen
        out: list[Command] = [
            ("view: fellows", partial(app.switch_view, "fellows"), "the live fellow table"),
            ("view: jobs", partial(app.switch_view, "jobs"), "the queue and finished jobs"),
            ("view: launch", partial(app.switch_view, "launch"), "launch a training job"),
            ("app: help", app.action_help, "every key of every view"),
            ("app: refresh now", app.refresh_now, "fetch fellows and jobs from the leader"),
            ("app: quit", app.action_ask_quit, "leave the console"),
        ]
        if isinstance(screen, FellowsScreen):
            out += [
                ("fellows: set speed", screen.action_set_speed,
                 "link limits of the marked fellows (or the one under the cursor)"),
                ("fellows: release", screen.action_release,
                 "release the marked fellows (or the one under the cursor)"),
                ("fellows: release all", screen.action_release_all, "release every fellow"),
                ("fellows: filter", screen.action_filter, "filter rows by a regex"),
                ("fellows: clear filter and marks", screen.action_clear, ""),
                ("fellows: reverse sort", screen.action_sort_reverse, ""),
                ("fellows: watch job", screen.action_watch, "the job of the selected fellow"),
                ("fellows: export view", screen.action_export,
                 "the rows as shown to a .csv or .json file"),
            ]
            out += [(f"fellows: sort by {c.label}", partial(screen.sort_by, c.key), c.help)
                    for c in SORTABLE_FELLOW_COLUMNS]
        elif isinstance(screen, FellowDetailScreen):
            out += [
                ("fellow: set speed", screen.action_set_speed, ""),
                ("fellow: release", screen.action_release, ""),
                ("fellow: watch job", screen.action_watch, ""),
            ]
        elif isinstance(screen, JobsScreen):
            out += [
                ("jobs: watch", screen.action_watch, "follow the selected job live"),
                ("jobs: cancel", screen.action_cancel_job, "cancel the selected job"),
                ("jobs: filter", screen.action_filter, ""),
                ("jobs: export view", screen.action_export,
                 "the rows as shown to a .csv or .json file"),
            ]
        elif isinstance(screen, JobWatchScreen):
            out += [("job: cancel", screen.action_cancel_job, ""),
                    ("job: export view", screen.action_export,
                     "per-fellow rows to a .csv or .json file")]
        return out

    async def discover(self) -> Hits:
        for name, run, help_text in self.commands():
            yield DiscoveryHit(name, run, help=help_text or None)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, run, help_text in self.commands():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), run, help=help_text or None)
