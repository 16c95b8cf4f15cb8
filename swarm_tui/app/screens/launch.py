"""The launcher: pick what to run, preview the job bodies it expands to, launch, follow it."""

from __future__ import annotations

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Button, Input, Label, Select, Static

from swarm_core.client import ApiError
from swarm_tui.app.cells import cut_middle
from swarm_tui.app.launch import (
    LaunchChoice,
    LaunchPlan,
    LaunchSource,
    launch_summary,
    run_body,
    run_summary,
)
from swarm_tui.app.model import Change
from swarm_tui.app.screens.base import SwarmScreen
from swarm_tui.app.screens.dialogs import ConfirmDialog, field_keys
from swarm_tui.app.widgets.field import Field
from swarm_tui.app.widgets.footer import SwarmFooter
from swarm_tui.app.widgets.status import StatusBar


class LaunchScreen(SwarmScreen):
    BINDINGS = [
        Binding("ctrl+s", "launch", "Launch", id="launch.submit"),
        Binding("escape", "back", "Fellows", id="launch.back"),
        *field_keys("launch"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.plan = LaunchPlan()

    @property
    def sources(self) -> list[LaunchSource]:
        return self.swarm.launch_sources

    @property
    def source(self) -> LaunchSource:
        value = self.query_one("#source", Select).value
        return next((src for src in self.sources if src.key == value), self.sources[0])

    def compose(self) -> ComposeResult:
        sources = self.sources
        yield StatusBar("launch")
        with Horizontal(id="launch"):
            # (it scrolls on a short terminal: the button stays reachable)
            with VerticalScroll(id="launch-form"):
                yield Label("launch", classes="pane-title")
                with Horizontal(classes="form-row"):
                    yield Label("source", classes="form-label")
                    yield Select([(src.label, src.key) for src in sources], compact=True,
                                 value=sources[0].key, allow_blank=False, id="source")
                for field in FIELD_ORDER:
                    with Horizontal(classes="form-row", id=f"row-{field}"):
                        yield Label(LABELS.get(field, field), classes="form-label")
                        if field in TEXT_FIELDS:
                            value, placeholder = TEXT_FIELDS[field]
                            yield Field(value, placeholder=placeholder, compact=True, id=field)
                            continue
                        options = next((src.options(field) for src in sources
                                        if field in src.fields), [])
                        blank = BLANK_PICKS.get(field)
                        default = None if blank else next(
                            (o for o in options if PICK_FIELDS[field] in o),
                            options[0] if options else None)
                        yield Select([(_short(o), o) for o in options], compact=True,
                                     value=default if default is not None else Select.NULL,
                                     allow_blank=default is None, prompt=blank or "Select",
                                     id=field)
                yield Button("Launch (ctrl+s)", variant="primary", id="launch-button",
                             compact=True, disabled=self.swarm.read_only)
                yield Static("", id="launch-error")
            with VerticalScroll(id="launch-preview"):
                yield Label("preview", id="preview-title", classes="pane-title")
                yield Static("", id="preview")
        yield SwarmFooter()

    def on_mount(self) -> None:
        # (SwarmScreen.on_mount runs too: Textual calls the handler of every class in the MRO)
        self.show_fields()
        self.update_plan()

    def show_fields(self) -> None:
        wanted = self.source.fields
        for field in FIELD_ORDER:
            self.query_one(f"#row-{field}").display = field in wanted

    def sync(self, change: Change | None) -> None:
        pass

    def status_hint(self) -> str:
        return "tab moves between fields"

    def choice(self) -> LaunchChoice:
        def sel(wid: str) -> str | None:
            value = self.query_one(f"#{wid}", Select).value
            return value if isinstance(value, str) else None

        return LaunchChoice(model=sel("model"), training=sel("training"), config=sel("config"),
                            stages=self.query_one("#stages", Input).value,
                            replicas=self.query_one("#replicas", Input).value,
                            sync=sel("sync"),
                            inner_steps=self.query_one("#inner_steps", Input).value,
                            overlap_steps=self.query_one("#overlap_steps", Input).value,
                            density=self.query_one("#density", Input).value,
                            transport=sel("transport"), wiring=sel("wiring"),
                            steps=self.query_one("#steps", Input).value,
                            name=self.query_one("#name", Input).value)

    def update_plan(self) -> None:
        self.plan = self.source.plan(self.choice())
        title = self.query_one("#preview-title", Label)
        preview = self.query_one("#preview", Static)
        if self.plan.error is not None:
            where = f"{self.plan.field}: " if self.plan.field else ""
            title.update(Text("preview: not valid", style="bold red"))
            preview.update(Text(f"{where}{self.plan.error}", style="red"))
            self.show_error(None)
            return
        n = len(self.plan.runs)
        title.update(Text(f"preview: {n} run{'s' if n != 1 else ''}", style="bold"))
        notes = Text("\n".join(self.plan.notes) + "; the leader fills in defaults\n",
                     style="dim")
        if n == 1:
            body = Syntax(run_body(self.plan.bodies[0]), "json", theme="ansi_dark",
                          background_color="default", word_wrap=True)
            preview.update(Group(notes, body))
        else:
            lines: list[RenderableType] = []
            for i, req in enumerate(self.plan.runs):
                name, details = run_summary(req)
                # A run's name is one long token: cut it in the middle, rather than wrap it
                # mid-word (or cut its end: the runs of a sweep differ there).
                lines.append(MiddleCut(f"{i + 1}. ", name))
                lines.append(Text(f"   {details}", style="dim"))
            preview.update(Group(notes, *lines))
        self.show_error(None)

    def show_error(self, message: str | None) -> None:
        self.query_one("#launch-error", Static).update(
            Text(message or "", style="bold red"))

    def launch_failed(self, exc: BaseException, submitted: list[str]) -> None:
        """The leader refused a run (400 naming the field) or could not be reached."""
        done = f" (submitted before it: {', '.join(submitted)})" if submitted else ""
        if isinstance(exc, ApiError):
            where = f"{exc.field}: " if exc.field else ""
            self.show_error(f"leader refused: {where}{exc.message}{done}")
        else:
            self.show_error(f"{exc}{done}")

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "source":
            self.show_fields()
        self.update_plan()

    def on_input_changed(self, _event: Input.Changed) -> None:
        self.update_plan()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_launch()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "launch-button":
            event.stop()
            self.action_launch()

    def action_launch(self) -> None:
        """``ctrl+s``, the button, or enter in a field: asks first (a stray enter queued a
        whole sweep), naming what it queues; ``y`` launches, enter or esc goes back."""
        self.update_plan()
        if not self.plan.ok:
            self.show_error("nothing to launch: " + (self.plan.error or "no runs"))
            return
        app = self.swarm
        if app.refuse_if_read_only("launch") or app.refuse_if_launching():
            return
        plan = self.plan  # (what the confirmation names, whatever is typed meanwhile)

        def confirmed(yes: bool | None) -> None:
            if yes:
                app.launch(plan, origin=self)

        n = len(plan.runs)
        app.push_screen(ConfirmDialog(f"Launch {n} run{'s' if n != 1 else ''}?",
                                      Text(launch_summary(plan)), confirm_label="Launch",
                                      deny_label="Back"), confirmed)

    def action_back(self) -> None:
        self.swarm.switch_view("fellows")


# Pick-one fields (their options come from the sources) with the option to preselect; those
# that start blank, with what blank means; free-text fields with their initial value and
# placeholder.
PICK_FIELDS = {"config": "smoke", "model": "small", "training": "", "sync": "",
               "transport": "", "wiring": ""}
# (blank writes no field: the training profile's stands; a pick overrides it)
BLANK_PICKS = {"sync": "the profile's", "transport": "the profile's",
               "wiring": "the profile's"}
TEXT_FIELDS = {"stages": ("", "the profile's, else 2"),
               "replicas": ("", "the profile's, else 1"),
               "inner_steps": ("", "diloco's H: the profile's"),
               "overlap_steps": ("", "diloco: the profile's"),
               "density": ("", "sparseloco: the profile's"),
               "steps": ("", "as the profile says"), "name": ("", "the model's name")}
# Labels that fit the form's label column (the field names the JSON uses are longer).
LABELS = {"inner_steps": "inner H", "overlap_steps": "overlap"}
FIELD_ORDER = ("config", "model", "training", "stages", "replicas", "wiring", "sync",
               "inner_steps", "overlap_steps", "density", "transport", "steps", "name")


class MiddleCut:
    """``prefix`` and ``name`` on one line, the name cut in the middle to the width given."""

    def __init__(self, prefix: str, name: str) -> None:
        self.prefix, self.name = prefix, name

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        room = options.max_width - cell_len(self.prefix)
        yield Text(self.prefix + cut_middle(self.name, room), no_wrap=True,
                   overflow="ellipsis")


def _short(rel: str) -> str:
    """``model/small.json`` -> ``small.json`` (the folder is the field's name already)."""
    return rel.rsplit("/", 1)[-1]
