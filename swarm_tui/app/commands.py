"""Command palette entries (ctrl+p), named "group: action", each with its key.

Every action a key runs in a view is an entry too (the tables' movement keys and the forms'
tab aside): the views' actions from anywhere (they go to their view first), those of the
screen the palette was opened over (a fellow's detail, a job's watch, a record, a log). An
entry names the binding it stands for, so the palette shows its keys as remapped (the test
that every binding has an entry reads them too).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.content import Content

from swarm_tui.app.cells import SORTABLE_FELLOW_COLUMNS

if TYPE_CHECKING:
    from swarm_tui.app.app import SwarmApp


@attrs.frozen
class Command:
    name: str
    run: Callable[[], object]
    help: str = ""
    # The class whose binding runs this action, and the binding's action: its keys are shown.
    key_of: tuple[type, str] | None = None


def keys_of(app: SwarmApp, owner: type, action: str) -> str:
    """The keys of ``owner``'s bindings of ``action`` as the footer names them (remapped)."""
    from swarm_tui.app.screens.dialogs import key_label

    keys = [key_label(app.keymap.get(b.id or "", b.key))
            for b in getattr(owner, "BINDINGS", ()) if isinstance(b, Binding)
            and b.action == action]
    return " ".join(keys)


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
        from swarm_tui.app.app import SwarmApp
        from swarm_tui.app.screens.fellows import FellowDetailScreen, FellowsScreen
        from swarm_tui.app.screens.jobs import JobsScreen, JobWatchScreen
        from swarm_tui.app.screens.launch import LaunchScreen
        from swarm_tui.app.screens.record import DescribeScreen, FellowLogScreen

        app = self.swarm
        screen = self.screen
        groups: dict[type, str] = {FellowsScreen: "fellows", JobsScreen: "jobs",
                                   LaunchScreen: "launch"}

        def view(name: str, owner: type, action: str, help_text: str = "",
                 *args: Any, key: str | None = None) -> Command:
            """``group: name``: ``action_<action>`` of the view ``group`` (its key's)."""
            group = groups[owner]
            return Command(f"{group}: {name}", self.in_view(group, f"action_{action}", *args),
                           help_text, (owner, key or action))

        def here(group: str, name: str, action: str, help_text: str = "") -> Command:
            """An action of the screen the palette was opened over."""
            return Command(f"{group}: {name}", getattr(screen, f"action_{action}"), help_text,
                           (type(screen), action))

        out: list[Command] = [
            Command("view: fellows", partial(app.switch_view, "fellows"), "the live fellow table",
                    (SwarmApp, "view('fellows')")),
            Command("view: jobs", partial(app.switch_view, "jobs"), "the queue and finished jobs",
                    (SwarmApp, "view('jobs')")),
            Command("view: launch", partial(app.switch_view, "launch"), "launch a training job",
                    (SwarmApp, "view('launch')")),
            Command("app: help", app.action_help, "every key of every view", (SwarmApp, "help")),
            Command("app: refresh now", app.refresh_now, "fetch fellows and jobs from the leader",
                    (SwarmApp, "refresh")),
            Command("app: quit", app.action_ask_quit, "leave the console (asks first when it "
                    "started a local cluster)", (SwarmApp, "ask_quit")),
            Command("app: quit now", app.exit, "leave the console without asking",
                    (SwarmApp, "quit")),
            # Every view's actions, from anywhere (they go to their view first).
            view("set speed", FellowsScreen, "set_speed",
                 "link limits of the marked fellows (or the one under the cursor)"),
            view("release", FellowsScreen, "release",
                 "release the marked fellows (or the one under the cursor)"),
            view("release all", FellowsScreen, "release_all", "release every fellow"),
            view("forget", FellowsScreen, "forget",
                 "drop the leader's records of the marked gone fellows (or the one under "
                 "the cursor)"),
            view("show gone fellows", FellowsScreen, "toggle_gone",
                 "list the fellows gone a while (stale, offline, left) too, or hide them"),
            view("mark", FellowsScreen, "mark", "mark the fellow under the cursor (or unmark)"),
            view("filter", FellowsScreen, "filter", "filter rows by a regex"),
            view("clear filter and marks", FellowsScreen, "clear"),
            view("sort by the next column", FellowsScreen, "sort_next"),
            view("reverse sort", FellowsScreen, "sort_reverse"),
            view("open detail", FellowsScreen, "detail", "the fellow under the cursor's plots"),
            view("watch job", FellowsScreen, "watch", "the job of the selected fellow"),
            view("export view", FellowsScreen, "export",
                 "the rows as shown to a .csv or .json file"),
            view("describe", FellowsScreen, "describe",
                 "the selected fellow's whole record, as JSON"),
            view("log", FellowsScreen, "log", "what the selected fellow did"),
            view("choose columns", FellowsScreen, "columns", "which columns show"),
            # (no key of their own: o cycles through them, a click on a header picks one)
            *(Command(f"fellows: sort by {c.label}", self.in_view("fellows", "sort_by", c.key),
                      c.help) for c in SORTABLE_FELLOW_COLUMNS),
            view("watch", JobsScreen, "watch", "follow the selected job live"),
            view("cancel", JobsScreen, "cancel_job", "cancel the selected job"),
            view("filter", JobsScreen, "filter", "filter rows by a regex"),
            view("clear filter", JobsScreen, "clear"),
            view("sort by the next column", JobsScreen, "sort_next"),
            view("reverse sort", JobsScreen, "sort_reverse"),
            view("choose columns", JobsScreen, "columns", "which columns show"),
            view("describe", JobsScreen, "describe", "the selected job's whole record, as JSON"),
            view("export view", JobsScreen, "export",
                 "the rows as shown to a .csv or .json file"),
            view("launch", LaunchScreen, "launch", "the form's runs, after a question"),
            view("back to fellows", LaunchScreen, "back"),
        ]
        if isinstance(screen, FellowDetailScreen):
            out += [
                here("fellow", "set speed", "set_speed"),
                here("fellow", "release", "release"),
                here("fellow", "watch job", "watch"),
                here("fellow", "describe", "describe", "its whole record, as JSON"),
                here("fellow", "log", "log", "what it did"),
                here("fellow", "back", "back"),
            ]
        elif isinstance(screen, JobWatchScreen):
            out += [
                here("job", "cancel", "cancel_job"),
                here("job", "set speed", "set_speed",
                     "link limits of the fellow of the cell under the cursor"),
                here("job", "set stage group speed", "set_speed_group",
                     "link limits of every replica of the cursor's stage"),
                here("job", "set replica chain speed", "set_speed_chain",
                     "link limits of every stage of the cursor's replica"),
                here("job", "log y", "log_y", "the loss plot on a log y axis (or linear)"),
                here("job", "zoom steps", "zoom",
                     "the loss plot from 10%, 50%, 90% of the steps, then the whole run"),
                here("job", "export view", "export", "per-fellow rows to a .csv or .json file"),
                here("job", "describe", "describe", "its whole record, as JSON"),
                here("job", "back", "back"),
            ]
        elif isinstance(screen, DescribeScreen):
            out += [
                here("record", "fetch again", "reload"),
                here("record", "search", "search", "find text in the record"),
                here("record", "next match", "next_match"),
                here("record", "previous match", "previous_match"),
                here("record", "back", "back"),
            ]
        elif isinstance(screen, FellowLogScreen):
            out += [here("log", "back", "back")]
        return out

    def hint(self, command: Command) -> str:
        return keys_of(self.swarm, *command.key_of) if command.key_of else ""

    def display(self, name: Content, command: Command) -> Content:
        """The entry's name, then its keys."""
        keys = self.hint(command)
        return name.append_text("  " + keys, "bold dim") if keys else name

    async def discover(self) -> Hits:
        for command in self.commands():
            yield DiscoveryHit(self.display(Content(command.name), command), command.run,
                               text=command.name, help=command.help or None)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for command in self.commands():
            score = matcher.match(command.name)
            if score > 0:
                yield Hit(score, self.display(matcher.highlight(command.name), command),
                          command.run, text=command.name, help=command.help or None)
