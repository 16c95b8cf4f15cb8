"""What every view of the console shares: the app, model updates, a filter bar."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.screen import Screen
from textual.widgets import Input, Label

from swarm_tui.app.model import Change
from swarm_tui.app.widgets.field import Field

if TYPE_CHECKING:
    from swarm_tui.app.app import SwarmApp


# Keys that open a text field (``/``: a filter, a search). Priority bindings: the app runs
# them as it reads the key, so that the keys typed behind them in a burst (over SSH, a paste)
# reach the field they open; not priority, they ran once the key had come back from the
# table, and the keys behind it had gone to the table (and were lost). While a text field has
# the focus the key is typed there (Textual drops the bindings of a key that the focused input
# takes; ``opens_field`` checks again). The keymap lets them be remapped to plain keys.
FIELD_OPENERS = frozenset({"fellows.filter", "jobs.filter", "describe.search"})


def opens_field(screen: Screen[Any]) -> None:
    """In a field-opening action: stand aside (the key is typed) while a text field has the
    focus."""
    if isinstance(screen.focused, Input):
        raise SkipAction()


class SwarmScreen(Screen[None]):
    """A view that redraws from the app's model whenever it changes."""

    EXPORT_NAME: ClassVar[str] = ""  # views with a table name their export files with it

    @property
    def swarm(self) -> SwarmApp:
        # textual types .app as the base App; this console only ever runs in a SwarmApp.
        return self.app  # type: ignore[return-value]

    def on_mount(self) -> None:
        self.swarm.model_changed.subscribe(self, self._model_changed, immediate=True)
        self.sync(None)

    def on_screen_resume(self) -> None:
        self.sync(None)

    def _model_changed(self, change: Change) -> None:
        if self.is_attached and self.is_mounted:
            self.sync(change)

    def sync(self, change: Change | None) -> None:
        """Redraw what ``change`` touched (everything when None)."""

    def status_hint(self) -> str:
        return ""

    def action_export(self) -> None:
        """``e``: the table's rows as shown (filter, sort) to a CSV or JSON file."""
        from swarm_tui.app.screens.dialogs import ExportDialog
        from swarm_tui.app.widgets.live_table import LiveTable

        name = self.export_label()
        if not name:
            return
        columns, rows = self.query_one(LiveTable).export_rows()

        def done(path: Path | None) -> None:
            if path is not None:
                self.notify(f"exported {len(rows)} rows to {path}")

        self.app.push_screen(ExportDialog(name, columns, rows), done)

    def export_label(self) -> str:
        return self.EXPORT_NAME

    def action_columns(self) -> None:
        """``C``: choose the table's columns (k9s's column chooser)."""
        from swarm_tui.app.screens.dialogs import ColumnsDialog
        from swarm_tui.app.widgets.live_table import LiveTable

        table = self.query_one(LiveTable)

        def done(keys: tuple[str, ...] | None) -> None:
            if keys is None:
                return
            # (the mark column is no datum to choose: it stays wherever the table has one)
            marks = ("sel",) if any(c.key == "sel" for c in table.spec) else ()
            table.choose((*marks, *keys) if keys else None)
            shown = "by the terminal's width" if not keys else ", ".join(keys)
            self.notify(f"columns: {shown}", timeout=3)

        self.app.push_screen(ColumnsDialog(self.export_label() or "the table",
                                           [c for c in table.spec if c.key != "sel"],
                                           table.visible, table.chosen is not None), done)


class FilterBar(Horizontal):
    """``/`` opens it; what is typed filters the table live (a regex, case-insensitive)."""

    DEFAULT_CSS = """
    FilterBar { height: 1; display: none; }
    FilterBar.-open { display: block; }
    FilterBar > Label { width: auto; padding: 0 1; }
    FilterBar > Input { width: 1fr; }
    FilterBar > #filter-error { color: $error; width: auto; max-width: 50%; }
    """

    def compose(self) -> ComposeResult:
        yield Label("filter /", id="filter-label")
        yield Field(placeholder="regex over id, name, node, status, job", compact=True,
                    id="filter-input")
        yield Label("", id="filter-error")

    @property
    def input(self) -> Input:
        return self.query_one("#filter-input", Input)

    def show_error(self, message: str | None) -> None:
        self.query_one("#filter-error", Label).update(message or "")
        self.input.set_class(bool(message), "-invalid")
