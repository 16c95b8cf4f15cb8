"""``Field``: the console's text input, whose editing keys apply in the order they were typed.

Textual's ``Input`` inserts a printable key in its own key handler, as the key comes out of the
input's queue, but its editing keys (backspace, delete, the arrows, home/end, enter…) are
bindings, which Textual runs only after the key has bubbled up through every ancestor's queue
to the app (textual#6605; fix proposed upstream in textual PR #6631). Keys arrive over SSH in
bursts, so the characters typed behind a backspace were inserted before it ran (``55 ⌫ 0``
gave ``550``), and behind a priority tab (the forms' next-field key) the late backspace ran in
the next field. ``Field`` runs its own bindings in its key handler, as the key comes out of
its queue: in arrival order, and in the field it was typed into. What runs is the binding
Textual would have run (the focused widget is the first namespace of the binding chain, and
priority bindings ran before the key reached the field); keys it has no binding for bubble on
as before. The ``Input`` type stays (queries, CSS and messages are those of ``Input``).
"""

from __future__ import annotations

from textual import events
from textual.widgets import Input


class Field(Input):
    async def _on_key(self, event: events.Key) -> None:
        # (runs before Input._on_key: a printable key goes on to it and is inserted there)
        if event.is_printable:
            return
        if await self.run_own_binding(event.key):
            event.stop()
            event.prevent_default()  # (not Input's handler, nor a binding of the app's)

    async def run_own_binding(self, key: str) -> bool:
        """Run this field's (non-priority) binding of ``key`` now; False when it has none,
        or its action declined (then the key bubbles on, as Textual would let it)."""
        bindings = self._bindings.copy()
        if self.app._keymap:  # (the input's own bindings have no ids; a remap still applies)
            bindings.apply_keymap(self.app._keymap)
        for binding in bindings.key_to_bindings.get(key, ()):
            if not binding.priority and await self.app.run_action(binding.action, self):
                return True
        return False
