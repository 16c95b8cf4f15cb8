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
        # textual types .app as the base App; this console only ever runs in a SwarmApp.
        return self.app  # type: ignore[return-value]

    def in_view(self, view: str, action: str, *args: object) -> Callable[[], None]:
        """Run a view's action from anywhere: go to the view (itself, not a screen over it),
        then run it there once it is up."""
        app = self.swarm

        def run() -> None:
            app.switch_view(view)

            def there() -> None:
                getattr(app.screen, action)(*args)

            app.call_after_refresh(there)

        return run

    def commands(self) -> list[Command]:
        from swarm_tui.app.screens.fellows import FellowDetailScreen
        from swarm_tui.app.screens.jobs import JobWatchScreen

        app = self.swarm
        screen = self.screen
        fellows, jobs = partial(self.in_view, "fellows"), partial(self.in_view, "jobs")
        out: list[Command] = [
            ("view: fellows", partial(app.switch_view, "fellows"), "the live fellow table"),
            ("view: jobs", partial(app.switch_view, "jobs"), "the queue and finished jobs"),
            ("view: launch", partial(app.switch_view, "launch"), "launch a training job"),
            ("app: help", app.action_help, "every key of every view"),
            ("app: refresh now", app.refresh_now, "fetch fellows and jobs from the leader"),
            ("app: quit", app.action_ask_quit, "leave the console"),
            # Every view's actions, from anywhere (they go to their view first).
            ("fellows: set speed", fellows("action_set_speed"),
             "link limits of the marked fellows (or the one under the cursor)"),
            ("fellows: release", fellows("action_release"),
             "release the marked fellows (or the one under the cursor)"),
            ("fellows: release all", fellows("action_release_all"), "release every fellow"),
            ("fellows: filter", fellows("action_filter"), "filter rows by a regex"),
            ("fellows: clear filter and marks", fellows("action_clear"), ""),
            ("fellows: reverse sort", fellows("action_sort_reverse"), ""),
            ("fellows: watch job", fellows("action_watch"), "the job of the selected fellow"),
            ("fellows: export view", fellows("action_export"),
             "the rows as shown to a .csv or .json file"),
            ("fellows: describe", fellows("action_describe"),
             "the selected fellow's whole record, as JSON"),
            ("fellows: log", fellows("action_log"), "what the selected fellow did"),
            ("fellows: choose columns", fellows("action_columns"), "which columns show"),
            *((f"fellows: sort by {c.label}", fellows("sort_by", c.key), c.help)
              for c in SORTABLE_FELLOW_COLUMNS),
            ("jobs: watch", jobs("action_watch"), "follow the selected job live"),
            ("jobs: cancel", jobs("action_cancel_job"), "cancel the selected job"),
            ("jobs: filter", jobs("action_filter"), ""),
            ("jobs: choose columns", jobs("action_columns"), "which columns show"),
            ("jobs: describe", jobs("action_describe"),
             "the selected job's whole record, as JSON"),
            ("jobs: export view", jobs("action_export"),
             "the rows as shown to a .csv or .json file"),
        ]
        if isinstance(screen, FellowDetailScreen):
            out += [
                ("fellow: set speed", screen.action_set_speed, ""),
                ("fellow: release", screen.action_release, ""),
                ("fellow: watch job", screen.action_watch, ""),
            ]
        elif isinstance(screen, JobWatchScreen):
            out += [("job: cancel", screen.action_cancel_job, ""),
                    ("job: set speed", screen.action_set_speed,
                     "link limits of the fellow of the cell under the cursor"),
                    ("job: set stage group speed", screen.action_set_speed_group,
                     "link limits of every replica of the cursor's stage"),
                    ("job: set replica chain speed", screen.action_set_speed_chain,
                     "link limits of every stage of the cursor's replica"),
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
