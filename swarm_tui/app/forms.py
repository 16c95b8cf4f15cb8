"""Parsing what people type into the console's dialogs (no Textual): one-line errors."""

from __future__ import annotations

import math

import attrs

from swarm_core.protocol import SLOWDOWN_MAX, SetSpeedRequest
from swarm_core.schema import FieldError
from swarm_core.validators import RATE_MBPS
from swarm_tui.typed import clip, decimal_number

SPEED_LABELS = {"tx_mbps": "tx Mbit/s", "rx_mbps": "rx Mbit/s", "latency_ms": "latency ms",
                "slowdown": "slowdown x"}


class FormError(ValueError):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def _bounds() -> dict[str, tuple[float, float]]:
    """The ranges the leader accepts (its validators'), so the dialog says them first."""
    lat = attrs.fields(SetSpeedRequest).latency_ms.metadata
    return {"tx_mbps": RATE_MBPS, "rx_mbps": RATE_MBPS,
            "latency_ms": (float(lat["minimum"]), float(lat["maximum"])),
            "slowdown": (1.0, SLOWDOWN_MAX)}


def parse_number(text: str, field: str, *, empty: float | None,
                 blank: str | None = None) -> float | None:
    """``text`` as a number within the field's range; empty (or a word for nothing: for a
    rate, also "unlimited") is ``empty``. Every error has one form: ``label: 'text' is …
    (…; leave it empty for …)``, quoting what was typed (``blank`` names what empty means)."""
    label = SPEED_LABELS.get(field, field)
    blank = blank or ("unlimited" if empty is None else f"{empty:g} ms")
    nothing = ("none", "-") if empty is not None else ("none", "-", "unlimited", "∞")
    text = text.strip()
    if not text or text.lower() in nothing:
        return empty
    try:
        value = decimal_number(text)
    except ValueError:
        raise FormError(f"{label}: {clip(text)!r} is not a number (leave it empty for "
                        f"{blank})", field) from None
    lo, hi = _bounds().get(field, (-math.inf, math.inf))
    if not math.isfinite(value) or not lo <= value <= hi:
        raise FormError(f"{label}: {clip(text)!r} is out of range ({lo:g} to {hi:g}; leave "
                        f"it empty for {blank})", field)
    return value


def parse_speed(tx: str, rx: str, latency: str, slowdown: str = "") -> SetSpeedRequest:
    """Rates in Mbit/s (empty: unlimited), latency in ms (empty: 0), the emulated compute
    slowdown (empty: unchanged)."""
    tx_v = parse_number(tx, "tx_mbps", empty=None)
    rx_v = parse_number(rx, "rx_mbps", empty=None)
    lat_v = parse_number(latency, "latency_ms", empty=0.0)
    slow_v = parse_number(slowdown, "slowdown", empty=None, blank="unchanged")
    try:
        return SetSpeedRequest(tx_mbps=tx_v, rx_mbps=rx_v, latency_ms=lat_v or 0.0,
                               slowdown=slow_v)
    except FieldError as exc:  # (a rule of the leader's beyond the ranges above)
        field = exc.field or ""
        raise FormError(f"{SPEED_LABELS.get(field, field)}: {exc}", field) from None


def fmt_input(v: float | None) -> str:
    """A value as the dialog pre-fills it (empty for unlimited)."""
    return "" if v is None else f"{v:g}"
