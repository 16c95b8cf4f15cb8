"""The footer of every view and dialog: its keys, with the essential ones kept in sight.

Textual's footer lists the focused widget's and the screen's keys before the app's, so a
narrow terminal (60 columns) cut off `? Help` and `q Quit` first. Below ``NARROW`` columns
this one puts the essential keys first and packs the keys closer.
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Footer
from textual.widgets._footer import FooterKey  # Textual is pinned exactly (pyproject)

NARROW = 80
ESSENTIAL = ("app.help", "app.quit", "watch.back", "detail.back", "launch.back",
             "dialog.cancel", "dialog.apply", "export.cancel", "export.apply", "confirm.yes",
             "confirm.no", "help.close")


class SwarmFooter(Footer):
    _narrow: bool | None = None

    def on_resize(self) -> None:
        narrow = self.size.width < NARROW
        if narrow != self._narrow:
            self._narrow = narrow
            self.compact = narrow
            self.call_after_refresh(self.recompose)

    def compose(self) -> ComposeResult:
        if not self._bindings_ready:
            return
        active = self.screen.active_bindings
        seen: set[str] = set()
        keys: list[tuple[Binding, bool, str]] = []
        for _node, binding, enabled, tooltip in active.values():
            if binding.show and binding.action not in seen:  # (one entry per action)
                seen.add(binding.action)
                keys.append((binding, enabled, tooltip))
        if self._narrow:
            keys.sort(key=lambda k: k[0].id not in ESSENTIAL)  # (stable: else as they were)
        self.styles.grid_size_columns = len(keys)
        for binding, enabled, tooltip in keys:
            yield FooterKey(binding.key, self.app.get_key_display(binding),
                            binding.description, binding.action, disabled=not enabled,
                            tooltip=tooltip).data_bind(compact=Footer.compact)
        if self.show_command_palette and self.app.ENABLE_COMMAND_PALETTE:
            try:
                _node, binding, enabled, tooltip = active[self.app.COMMAND_PALETTE_BINDING]
            except KeyError:
                return
            yield FooterKey(binding.key, self.app.get_key_display(binding),
                            binding.description, binding.action, classes="-command-palette",
                            disabled=not enabled,
                            tooltip=binding.tooltip or binding.description)
