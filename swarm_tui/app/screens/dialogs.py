"""Modal dialogs: set-speed, confirmation, export, help."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, SelectionList, Static
from textual.widgets.selection_list import Selection

from swarm_core.protocol import SetSpeedRequest
from swarm_tui.app.export import ExportError, default_name, write_view
from swarm_tui.app.forms import FormError, fmt_input, parse_speed
from swarm_tui.app.widgets.field import Field
from swarm_tui.app.widgets.footer import SwarmFooter

T = TypeVar("T")


def field_keys(view: str) -> list[Binding]:
    """tab / shift+tab between a form's fields, as priority bindings: the app runs them as it
    reads the key, so keys typed behind a tab (a burst over SSH, ``5 Tab 6``) reach the field
    it moved to. (Textual's own tab binding runs only once the key has passed through the
    focused field's queue, after the keys behind it were already handed to that field.)"""
    return [
        Binding("tab", "app.focus_next", "Next field", show=False, priority=True,
                id=f"{view}.next_field"),
        Binding("shift+tab", "app.focus_previous", "Previous field", show=False,
                priority=True, id=f"{view}.previous_field"),
    ]


class FormDialog(ModalScreen[T]):
    """A dialog of a few inputs: enter or Apply runs ``action_apply``, which shows an error
    here (and does nothing) or dismisses with a result; escape or Cancel dismisses with None."""

    def buttons(self, apply: str) -> ComposeResult:
        yield Label("", id="error", classes="dialog-error")
        with Horizontal(classes="buttons"):
            yield Button(f"{apply} (enter)", variant="primary", compact=True, id="apply")
            yield Button("Cancel (esc)", compact=True, id="cancel")

    def show_error(self, message: str) -> None:
        error = self.query_one("#error", Label)
        error.update(message)
        error.add_class("-shown")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.action_cancel()

    def action_apply(self) -> None:
        raise NotImplementedError

    def action_cancel(self) -> None:
        self.dismiss(None)


class SetSpeedDialog(FormDialog[SetSpeedRequest | None]):
    """Link limits for one or more fellows. Bad input shows an error here and sends nothing."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="dialog.cancel"),
        Binding("ctrl+s", "apply", "Apply", id="dialog.apply"),
        *field_keys("dialog"),
    ]

    def __init__(self, targets: Sequence[tuple[int, str]], tx: float | None = None,
                 rx: float | None = None, latency_ms: float = 0.0) -> None:
        super().__init__()
        self.targets = list(targets)
        self.initial = (fmt_input(tx), fmt_input(rx), fmt_input(latency_ms or 0.0))
        # Whether the request sets the link, as it was dismissed (read by the caller).
        self.link_given = True

    def compose(self) -> ComposeResult:
        who = ", ".join(f"{fid} {name}" for fid, name in self.targets[:4])
        if len(self.targets) > 4:
            who += f" and {len(self.targets) - 4} more"
        with Vertical(id="dialog", classes="dialog"):
            yield Label(f"Set link speed: {who}", classes="dialog-title")
            yield Label("Rates in Mbit/s (empty = unlimited); added one-way latency in ms; "
                        "slowdown emulates a slower peer (empty = unchanged).",
                        classes="dialog-help")
            with Horizontal(classes="field"):
                yield Label("tx Mbit/s", classes="field-label")
                yield Field(self.initial[0], placeholder="unlimited", compact=True, id="tx")
            with Horizontal(classes="field"):
                yield Label("rx Mbit/s", classes="field-label")
                yield Field(self.initial[1], placeholder="unlimited", compact=True, id="rx")
            with Horizontal(classes="field"):
                yield Label("latency ms", classes="field-label")
                yield Field(self.initial[2], placeholder="0", compact=True, id="latency")
            with Horizontal(classes="field"):  # (emulated: pads the compute; see pace.py)
                yield Label("slowdown x", classes="field-label")
                yield Field("", placeholder="unchanged", compact=True, id="slowdown")
            yield from self.buttons("Apply")
        yield SwarmFooter()  # (the dialog's keys, not those of the view under it)

    def on_mount(self) -> None:
        self.query_one("#tx", Input).focus()

    def action_apply(self) -> None:
        try:
            req = parse_speed(self.query_one("#tx", Input).value,
                              self.query_one("#rx", Input).value,
                              self.query_one("#latency", Input).value,
                              self.query_one("#slowdown", Input).value)
        except FormError as exc:
            self.show_error(str(exc))
            target = {"tx_mbps": "#tx", "rx_mbps": "#rx", "latency_ms": "#latency",
                      "slowdown": "#slowdown"}
            field = self.query_one(target[exc.field], Input) if exc.field in target else None
            if field is not None and not field.has_focus:
                field.focus()  # (re-focusing the focused input would eat the next keys)
            return
        # A slowdown over the link fields as they were filled in is a slowdown alone: the
        # leader refuses a link set on a torch job's fellow (its links are unshaped), and
        # the prefill (the first fellow's link) must not overwrite the other fellows' links.
        typed = tuple(self.query_one(f"#{f}", Input).value.strip()
                      for f in ("tx", "rx", "latency"))
        self.link_given = req.slowdown is None or typed != self.initial
        self.dismiss(req)


class ConfirmDialog(ModalScreen[bool]):
    """Yes or no for a destructive action; focus starts on the safe answer."""

    BINDINGS = [
        Binding("y", "confirm", "Yes", id="confirm.yes"),
        Binding("n", "cancel", "No", id="confirm.no"),
        Binding("escape", "cancel", "No", show=False, id="confirm.escape"),
    ]

    def __init__(self, title: str, body: str | Text, confirm_label: str = "Yes",
                 deny_label: str = "Cancel") -> None:
        super().__init__()
        self.title_text, self.body = title, body
        self.confirm_label, self.deny_label = confirm_label, deny_label

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield Static(self.body, classes="dialog-body")
            with Horizontal(classes="buttons"):
                yield Button(f"{self.confirm_label} (y)", variant="error", compact=True,
                             id="yes")
                yield Button(f"{self.deny_label} (n/esc)", compact=True, id="no")
        yield SwarmFooter()

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)


HelpSection = tuple[str, Sequence[Binding]]


def key_label(key: str) -> str:
    names = {"question_mark": "?", "slash": "/", "escape": "esc", "up": "↑", "down": "↓",
             "pageup": "pgup", "pagedown": "pgdn"}
    return " ".join(names.get(k.strip(), k.strip()) for k in key.split(","))


class ExportDialog(FormDialog[Path | None]):
    """Where to write the view (its rows as they were when ``e`` was pressed); the extension
    picks the format. A bad name or an unwritable place shows here and writes nothing."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="export.cancel"),
        Binding("ctrl+s", "apply", "Write", id="export.apply"),
        *field_keys("export"),
    ]

    def __init__(self, view: str, columns: list[str], rows: list[dict[str, Any]]) -> None:
        super().__init__()
        self.view, self.columns, self.rows = view, columns, rows

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog"):
            yield Label(f"Export {self.view}: {len(self.rows)} rows as shown",
                        classes="dialog-title")
            yield Label("A file name ending in .csv or .json (relative to where the console "
                        "started).", classes="dialog-help")
            with Horizontal(classes="field"):
                yield Label("file", classes="field-label")
                yield Field(default_name(self.view), compact=True, id="path")
            yield from self.buttons("Write")
        yield SwarmFooter()

    def on_mount(self) -> None:
        self.query_one("#path", Input).focus()

    def action_apply(self) -> None:
        try:
            path = write_view(self.query_one("#path", Input).value, self.columns, self.rows)
        except ExportError as exc:
            self.show_error(str(exc))
            return
        self.dismiss(path)


class HelpScreen(ModalScreen[None]):
    """Every key of every view, from the bindings themselves (so it cannot go stale)."""

    BINDINGS = [
        Binding("escape", "close", "Close", id="help.close"),
        Binding("question_mark", "close", "Close", show=False, id="help.close_key"),
        Binding("q", "close", "Close", show=False, id="help.close_q"),
    ]

    def __init__(self, sections: Sequence[HelpSection], read_only: bool = False,
                 keymap: dict[str, str] | None = None) -> None:
        super().__init__()
        self.sections = list(sections)
        self.read_only = read_only
        self.keymap = keymap or {}

    def compose(self) -> ComposeResult:
        table = Table(show_header=True, show_edge=False, box=None, expand=True,
                      padding=(0, 1), header_style="bold")
        table.add_column("key", no_wrap=True)
        table.add_column("does")
        table.add_column("id", style="dim", no_wrap=True)
        for title, bindings in self.sections:
            table.add_row(Text(title, style="bold underline"), "", "")
            for b in bindings:
                keys = self.keymap.get(b.id or "", b.key)
                table.add_row(key_label(keys), b.description or b.action, b.id or "")
        with Vertical(id="help", classes="dialog"):
            title = "Keys  (esc closes; ctrl+p: command palette)"
            if self.read_only:
                title += "  READ-ONLY: actions that change the cluster are refused"
            yield Label(title, classes="dialog-title")
            with VerticalScroll():
                yield Static(table, id="help-table")
        yield SwarmFooter()

    def action_close(self) -> None:
        self.dismiss(None)


class ColumnsDialog(ModalScreen[tuple[str, ...] | None]):
    """Which columns a table shows, as k9s has it: ticked ones, in their order (space ticks;
    the id and name stay frozen on the left). Nothing ticked, or ``a``: by the terminal's
    width again. Dismisses with the keys (``()`` for by width), or None when cancelled."""

    BINDINGS = [
        Binding("ctrl+s", "apply", "Apply", id="columns.apply"),
        Binding("a", "auto", "By width", id="columns.auto"),
        Binding("escape", "cancel", "Cancel", id="columns.cancel"),
    ]

    def __init__(self, view: str, columns: Sequence[Any], shown: Sequence[str],
                 chosen: bool) -> None:
        super().__init__()
        self.view, self.columns, self.shown, self.chosen = view, list(columns), shown, chosen

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog"):
            how = "chosen" if self.chosen else "by the terminal's width"
            yield Label(f"Columns of {self.view} (now {how})", classes="dialog-title")
            yield SelectionList[str](
                *(Selection(f"{c.label.strip() or c.key}  {c.help}".rstrip(), c.key,
                            c.key in self.shown) for c in self.columns),
                id="columns", compact=True)
            with Horizontal(classes="buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", compact=True, id="apply")
                yield Button("By width (a)", compact=True, id="auto")
                yield Button("Cancel (esc)", compact=True, id="cancel")
        yield SwarmFooter()

    def on_mount(self) -> None:
        self.query_one(SelectionList).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        {"apply": self.action_apply, "auto": self.action_auto}.get(
            event.button.id or "", self.action_cancel)()

    def action_apply(self) -> None:
        ticked = set(self.query_one(SelectionList).selected)
        self.dismiss(tuple(c.key for c in self.columns if c.key in ticked))

    def action_auto(self) -> None:
        self.dismiss(())

    def action_cancel(self) -> None:
        self.dismiss(None)
