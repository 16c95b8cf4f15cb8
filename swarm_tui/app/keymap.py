"""Remapped keys: a JSON object of binding id -> keys, checked before the console starts.

Every key binding of the console has an id (``?`` lists them). A keymap file changes the keys of
any of them, e.g. ``{"fellows.release": "x", "app.quit": "ctrl+c"}``; several keys are separated
by commas as in Textual (``"x,delete"``). It is read from ``--keymap FILE``, else from
``<user config dir>/silentswarm/keymap.json`` when that exists (``SWARM_KEYMAP`` overrides the
default place; a file it names must exist). An unknown id, a key no terminal sends, a key
bound twice in one view, a
key of the tables and fields (arrows, enter, tab), a plain letter for a binding that works
even while typing (``app.quit_now``), or a file that is not such an object is a one-line error
and the console does not start.
"""

from __future__ import annotations

import difflib
import functools
import os
import string
import unicodedata
from pathlib import Path

import platformdirs
from textual._keyboard_protocol import FUNCTIONAL_KEYS
from textual.binding import Binding
from textual.keys import (  # Textual is pinned exactly (pyproject)
    Keys,
    _character_to_key,
    _get_unicode_name_from_key,
    _normalize_key_list,
)

from swarm_core import jsonio
from swarm_tui.typed import clip


class KeymapError(ValueError):
    pass


# The widgets' own keys (tables and inputs): not remappable, and nothing may be mapped onto them.
FIXED_KEYS = ("up", "down", "left", "right", "pageup", "pagedown", "home", "end", "enter",
              "tab", "shift+tab", "backspace")
_NON_PRINTING = {*FIXED_KEYS, "escape", "delete", "insert", *(f"f{i}" for i in range(1, 25))}


def default_path() -> tuple[Path, bool]:
    """Where the keymap is read from, and whether it must exist (named by SWARM_KEYMAP)."""
    env = os.environ.get("SWARM_KEYMAP")
    if env:
        return Path(env), True
    return platformdirs.user_config_path("silentswarm") / "keymap.json", False


def _types_a_character(key: str) -> bool:
    mods = key.split("+")[:-1]
    return not any(m in ("ctrl", "alt", "meta", "super") for m in mods) \
        and key.split("+")[-1] not in _NON_PRINTING


def remappable() -> dict[str, list[tuple[str, Binding]]]:
    """View name -> its (id, binding) pairs, for every binding that has an id."""
    from swarm_tui.app.app import help_sections
    from swarm_tui.app.screens.dialogs import HelpScreen

    out: dict[str, list[tuple[str, Binding]]] = {}
    for title, bindings in help_sections():
        if title == "tables and forms":  # the widgets' own keys, listed for help only
            continue
        out[title] = [(b.id, b) for b in bindings if b.id]
    out["help"] = [(b.id, b) for b in HelpScreen.BINDINGS if isinstance(b, Binding) and b.id]
    return out


MODIFIERS = ("ctrl", "alt", "shift", "meta", "super", "hyper")


@functools.cache
def _key_names() -> frozenset[str]:
    """The named keys a terminal can send Textual without modifiers (escape, f5, pageup, the
    kitty protocol's pause or f35…) and the names of printable ASCII characters (slash…)."""
    named = {k.value for k in Keys if "+" not in k.value and not k.value.startswith("<")}
    functional = set(FUNCTIONAL_KEYS.values())
    chars = {_character_to_key(c) for c in string.printable if c.isprintable()}
    return frozenset(named | functional | chars)


def _names_a_character(base: str) -> bool:
    """``pound_sign``, ``euro_sign``…: Textual's name of a printable character."""
    try:
        char = unicodedata.lookup(_get_unicode_name_from_key(base).upper().replace("_", " "))
    except KeyError:
        return False
    return len(char) == 1 and char.isprintable()


def _is_key(key: str) -> bool:
    *mods, base = key.split("+")
    return all(m in MODIFIERS for m in mods) and len(set(mods)) == len(mods) and (
        (len(base) == 1 and base.isprintable()) or base in _key_names()
        or _names_a_character(base))


def _long_form(key: str) -> str:
    *mods, base = key.split("+")
    if mods and len(base) == 1 and not base.isalnum():
        base = _character_to_key(base)
    return "+".join([*mods, base])


def _keys(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise KeymapError(f"{where}: expected keys as a string such as \"x\" or \"x,delete\"")
    parts = [k.strip() for k in value.split(",")]
    if any(not k or " " in k for k in parts):
        raise KeymapError(f"{where}: {clip(value)!r} is not a comma-separated list of keys")
    # "/" and "slash" are one key to Textual: compare them in its long form, after modifiers
    # too (Textual sends ctrl+. as ctrl+full_stop, which it does not rewrite itself).
    keys = ",".join(_long_form(k) for k in _normalize_key_list(",".join(parts)).split(","))
    for written, key in zip(parts, keys.split(","), strict=True):
        # A key nobody can press would leave its binding without one, silently.
        if not _is_key(key):
            raise KeymapError(f"{where}: {clip(written)!r} is not a key (a character, or a "
                              "name such as escape, f5 or slash, after modifiers such as "
                              "ctrl+)")
    return keys


def check(keymap: object, source: str) -> dict[str, str]:
    if not isinstance(keymap, dict):
        raise KeymapError(f"{source}: expected a JSON object of binding id -> keys")
    from swarm_tui.app.app import MODAL_VIEWS
    from swarm_tui.app.screens.base import FIELD_OPENERS

    views = remappable()
    by_id = {bid: b for pairs in views.values() for bid, b in pairs}
    out: dict[str, str] = {}
    for bid, value in keymap.items():
        if bid not in by_id:
            near = difflib.get_close_matches(str(bid), sorted(by_id), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else " ('?' in the console lists ids)"
            raise KeymapError(f"{source}: unknown binding id {bid!r}{hint}")
        out[bid] = keys = _keys(value, f"{source}: {bid}")
        binding = by_id[bid]
        typed = [k for k in keys.split(",") if _types_a_character(k)]
        if binding.priority and typed and bid not in FIELD_OPENERS:
            raise KeymapError(f"{source}: {bid} works even while typing in a field, so "
                              f"{typed[0]!r} would never reach the field; use a key with "
                              "ctrl or alt")
        fixed = [k for k in keys.split(",") if k in FIXED_KEYS]
        if fixed:
            raise KeymapError(f"{source}: {bid}: {fixed[0]!r} belongs to the tables and "
                              "fields (moving, opening, tabbing) and cannot be remapped")
    everywhere = views.get("everywhere", [])
    for view, pairs in views.items():
        # A modal screen (a dialog, the help) cuts off the app's keys except priority ones.
        app_keys = [(bid, b) for bid, b in everywhere if b.priority] \
            if view in MODAL_VIEWS else everywhere
        scope = pairs if view == "everywhere" else [*app_keys, *pairs]
        seen: dict[str, str] = {}
        for bid, binding in scope:
            for key in out.get(bid, _normalize_key_list(binding.key)).split(","):
                other = seen.setdefault(key, bid)
                if other != bid and (bid in out or other in out):
                    raise KeymapError(f"{source}: key {key!r} would be both {other} and {bid} "
                                      f"in the {view} view")
    return out


def load(path: Path | None = None) -> dict[str, str]:
    """The keymap to use: ``path`` (which must exist), else the default file if present."""
    if path is not None:
        target, must_exist = path, True
    else:
        target, must_exist = default_path()
    if not must_exist and not target.exists():
        return {}
    try:
        raw = target.read_bytes()
    except OSError as exc:
        raise KeymapError(f"keymap {target}: {exc.strerror or exc}") from None
    try:
        data = jsonio.loads(raw)
    except jsonio.JSONDecodeError as exc:
        raise KeymapError(f"keymap {target}: not valid JSON: {exc}") from None
    return check(data, f"keymap {target}")
