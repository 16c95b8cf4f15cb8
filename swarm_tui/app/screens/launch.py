"""The launcher: pick what to run, preview the job bodies it expands to, launch, follow it."""

from __future__ import annotations

from rich.syntax import Syntax
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Footer, Input, Label, Select, Static

from swarm_core.client import ApiError
from swarm_tui.app.launch import LaunchChoice, LaunchPlan, LaunchSource, run_body, run_summary
from swarm_tui.app.model import Change
from swarm_tui.app.screens.base import SwarmScreen
from swarm_tui.app.widgets.status import StatusBar


class LaunchScreen(SwarmScreen):
    BINDINGS = [
        Binding("ctrl+s", "launch", "Launch", id="launch.submit"),
        Binding("escape", "back", "Fellows", id="launch.back"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.plan = LaunchPlan()

    @property
    def source(self) -> LaunchSource:
        return self.swarm.launch_source

    def compose(self) -> ComposeResult:
        src = self.source
        models = src.models()
        trainings = src.trainings()
        default_model = next((m for m in models if "small" in m), models[0] if models else None)
        default_training = trainings[0] if trainings else None
        yield StatusBar("launch")
        with Horizontal(id="launch"):
            with Vertical(id="launch-form"):
                yield Label(f"source: {src.label}", classes="pane-title")
                with Horizontal(classes="form-row"):
                    yield Label("model", classes="form-label")
                    yield Select([(_short(m), m) for m in models], compact=True,
                                 value=default_model or Select.BLANK,
                                 allow_blank=default_model is None, id="model")
                with Horizontal(classes="form-row"):
                    yield Label("training", classes="form-label")
                    yield Select([(_short(t), t) for t in trainings], compact=True,
                                 value=default_training or Select.BLANK,
                                 allow_blank=default_training is None, id="training")
                with Horizontal(classes="form-row"):
                    yield Label("fellows", classes="form-label")
                    yield Input("2", compact=True, id="fellows")
                with Horizontal(classes="form-row"):
                    yield Label("steps", classes="form-label")
                    yield Input("", placeholder="as the profile says", compact=True, id="steps")
                with Horizontal(classes="form-row"):
                    yield Label("name", classes="form-label")
                    yield Input("", placeholder="the model's name", compact=True, id="name")
                yield Button("Launch (ctrl+s)", variant="primary", id="launch-button",
                             compact=True, disabled=self.swarm.read_only)
                yield Static("", id="launch-error")
            with VerticalScroll(id="launch-preview"):
                yield Label("preview", id="preview-title", classes="pane-title")
                yield Static("", id="preview")
        yield Footer()

    def on_mount(self) -> None:
        # (SwarmScreen.on_mount runs too: Textual calls the handler of every class in the MRO)
        self.update_plan()

    def sync(self, change: Change | None) -> None:
        pass

    def status_hint(self) -> str:
        return "tab moves between fields"

    def choice(self) -> LaunchChoice:
        def sel(wid: str) -> str | None:
            value = self.query_one(f"#{wid}", Select).value
            return value if isinstance(value, str) else None

        return LaunchChoice(model=sel("model"), training=sel("training"),
                            fellows=self.query_one("#fellows", Input).value,
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
        title.update(Text(f"preview: {n} run{'s' if n != 1 else ''} "
                          f"({'; '.join(self.plan.notes)}; it fills in defaults)",
                          style="bold"))
        lines = [f"{i + 1}. {run_summary(r)}" for i, r in enumerate(self.plan.runs)]
        body = Syntax(run_body(self.plan.bodies[0]), "json", theme="ansi_dark",
                      background_color="default", word_wrap=True)
        preview.update(body if n == 1 else Text("\n".join(lines)))
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

    def on_select_changed(self, _event: Select.Changed) -> None:
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
        self.update_plan()
        if not self.plan.ok:
            self.show_error("nothing to launch: " + (self.plan.error or "no runs"))
            return
        self.swarm.launch(self.plan.runs, origin=self)

    def action_back(self) -> None:
        self.swarm.switch_view("fellows")


def _short(rel: str) -> str:
    """``model/small.json`` -> ``small.json`` (the folder is the field's name already)."""
    return rel.rsplit("/", 1)[-1]
