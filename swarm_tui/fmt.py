"""How the CLI and the console write numbers, sizes, rates and links: one place, one look.

No Textual here: the headless commands use it as the console does.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarm_core.contract import CodecErrors, LinkChange, link_changes_in_all
from swarm_core.protocol import LinkLimits


def fmt_cell(stage: int, replica: int) -> str:
    """A grid cell, (stage 1, replica 0), as every surface names it: ``s1/r0``."""
    return f"s{stage}/r{replica}"


def fmt_codec_error(errors: CodecErrors | None) -> str | None:
    """The relative error a stage's codec put on what it sent, ``act 0.12%, grad 0.30%``;
    None where it reported none."""
    if errors is None:
        return None
    parts = [f"{name} {v:.2%}" for name, v in (("act", errors.act), ("grad", errors.grad))
             if v is not None]
    return ", ".join(parts) or None


def fmt_age(seconds: float | None) -> str:
    """A duration in at most four characters: 59s, 12m, 3h, 5d."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 100:
        return f"{s}s"
    if s < 6000:
        return f"{s // 60}m"
    if s < 360000:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


def fmt_bytes(n: int | None, compact: bool = False) -> str:
    """``1.5 MiB``; ``compact`` (table cells): ``1.5M``, at most five characters."""
    if n is None:
        return "-"
    value = float(n)
    units = ("B", "K", "M", "G", "T") if compact else ("B", "KiB", "MiB", "GiB", "TiB")
    # Compact cells switch unit at 1000 so "1023.5K" never needs six characters.
    limit = 1000 if compact else 1024
    sep = "" if compact else " "
    for unit in units:
        if value < limit or unit == units[-1]:
            return f"{value:.0f}{sep}{unit}" if unit == "B" else f"{value:.1f}{sep}{unit}"
        value /= 1024
    return str(n)


def fmt_loss(v: float | None) -> str:
    """A loss in at most six characters: 2.4312, 10.431, 1234."""
    if v is None:
        return "-"
    if abs(v) < 10:
        return f"{v:.4f}"
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"


def fmt_rate(v: float | None) -> str:
    """A measured rate in Mbit/s, three significant figures."""
    if v is None:
        return "-"
    if v < 10:
        return f"{v:.2f}"
    if v < 1000:
        return f"{v:.1f}"
    return f"{v:.0f}"


def fmt_limit(v: float | None) -> str:
    """A link limit in Mbit/s, ∞ for none (in a sentence, :func:`describe_link` says
    "unlimited")."""
    return "∞" if v is None else f"{v:g}"


def fmt_tps(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v < 10_000 else f"{v / 1000:.0f}k"


def fmt_number(v: object, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def fmt_devices(devices: Sequence[str]) -> str:
    if not devices:
        return "-"
    if all(d.startswith("cuda:") for d in devices):
        return "cuda:" + ",".join(d[5:] for d in devices)
    if len(set(devices)) == 1:
        return devices[0] if len(devices) == 1 else f"{len(devices)}x{devices[0]}"
    return ",".join(devices)


def describe_link(tx: float | None, rx: float | None, latency_ms: float) -> str:
    """``tx 8 Mbit/s, rx unlimited, +20 ms``."""
    def rate(v: float | None) -> str:
        return "unlimited" if v is None else f"{v:g} Mbit/s"

    lat = f", +{latency_ms:g} ms" if latency_ms else ""
    return f"tx {rate(tx)}, rx {rate(rx)}{lat}"


def describe_speed(link: LinkLimits | None, slowdown: float | None) -> str:
    """A set-speed's link (None: left as it was) and emulated slowdown (None: left as it was):
    ``tx 8 Mbit/s, rx unlimited, slowdown 4x (emulated)``."""
    parts = [] if link is None else [describe_link(link.tx_mbps, link.rx_mbps, link.latency_ms)]
    if slowdown is not None:
        parts.append(f"slowdown {slowdown:g}x (emulated)")
    return ", ".join(parts) or "no change"


def describe_link_changes(changes: list[LinkChange], shown: int = 3, total: int = 0) -> str:
    """A job's mid-run set-speeds, newest last: "link set mid-run: @12 fellow 1 tx 8 Mbit/s,
    rx unlimited; …" (the run did not keep its network profile throughout). ``total``: how
    many there were in all, where the record kept only some."""
    parts = [f"@{c.at_step} fellow {c.fellow_id} " + describe_speed(c.link, c.slowdown)
             for c in changes[-shown:]]
    total = link_changes_in_all(changes, total)
    earlier = f" (+{total - shown} earlier)" if total > shown else ""
    return "link set mid-run: " + "; ".join(parts) + earlier
