"""Hostfiles in the spirit of DeepSpeed's: one host per line, what runs there as key=value.

    # host            fellows   device slots, split over them   the remote interpreter
    gpu-a             slots=2   devices=cuda:0,cuda:1            python=/opt/venv/bin/python
    alice@gpu-b       slots=1   devices=cuda:0,cuda:1
    cpu-box                                                      # one fellow on the CPU

``slots`` is how many fellows the host runs (default 1); ``devices`` (default ``cpu``) are
dealt out evenly, so ``slots=1 devices=cuda:0,cuda:1`` is one fellow owning two GPUs and
``slots=2`` two fellows with one each (``cpu`` alone goes to every fellow). ``python`` is the
interpreter of the remote install of SilentSwarm (default ``python3``). ``data_host`` and
``data_advertise`` (optional) are the host's fellows' ``--data-host`` and ``--data-advertise``:
where their data plane binds, and the address neighbours dial when it is not that one (NAT).
The host is what ``ssh`` is given, so the user's ``~/.ssh/config`` aliases, keys and ProxyJump
apply.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from swarm_core.validators import CONTROL, DEVICE_SLOT

KEYS = ("slots", "devices", "python", "data_host", "data_advertise")
MAX_SLOTS = 64
# What ssh takes as a destination here: [user@]host, never anything it could read as an option.
HOST = re.compile(r"[A-Za-z0-9_.\[\]:%-]+(@[A-Za-z0-9_.\[\]:%-]+)?")
PYTHON = re.compile(r"[^\s'\"`$\\;|&<>(){}*?!#]+")
ADDRESS = re.compile(r"[A-Za-z0-9_.:%-]+")


class HostfileError(Exception):
    """A hostfile that cannot be used: one line naming the file, the line and what is wrong."""


@attrs.frozen
class FellowPlan:
    name: str
    devices: tuple[str, ...]


@attrs.frozen
class HostEntry:
    host: str  # as ssh is given it
    line: int
    slots: int = 1
    devices: tuple[str, ...] = ("cpu",)
    python: str = "python3"
    data_host: str | None = None
    data_advertise: str | None = None

    @property
    def label(self) -> str:
        """The host without its user: the stem of its fellows' names."""
        return self.host.rpartition("@")[2]

    def fellows(self) -> list[FellowPlan]:
        """The fellows this host runs, each with its share of the device slots."""
        shares: list[tuple[str, ...]]
        if self.devices == ("cpu",):
            shares = [("cpu",)] * self.slots
        else:
            k = len(self.devices) // self.slots
            shares = [self.devices[i * k:(i + 1) * k] for i in range(self.slots)]
        if self.slots == 1:
            return [FellowPlan(self.label, shares[0])]
        return [FellowPlan(f"{self.label}-{i}", share) for i, share in enumerate(shares)]


def read_hostfile(path: Path) -> list[HostEntry]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise HostfileError(f"{path}: no such hostfile") from None
    except UnicodeDecodeError:
        raise HostfileError(f"{path}: not a text file") from None
    except OSError as exc:
        raise HostfileError(f"{path}: cannot read: {exc.strerror}") from None
    return parse_hostfile(text, str(path))


def parse_hostfile(text: str, where: str = "hostfile") -> list[HostEntry]:
    entries: list[HostEntry] = []
    seen: dict[str, int] = {}
    names: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry = _entry(line, n, where)
        if entry.host in seen:
            raise HostfileError(f"{where} line {n}: host {entry.host} is already on line "
                                f"{seen[entry.host]}")
        seen[entry.host] = n
        for f in entry.fellows():
            if f.name in names:
                raise HostfileError(f"{where} line {n}: fellow name {f.name} is also line "
                                    f"{names[f.name]}'s")
            names[f.name] = n
        entries.append(entry)
    if not entries:
        raise HostfileError(f"{where}: no hosts (one per line: host slots=N devices=... "
                            "python=...)")
    return entries


def _entry(line: str, n: int, where: str) -> HostEntry:
    at = f"{where} line {n}"
    host, *pairs = line.split()
    if CONTROL.search(host) or not HOST.fullmatch(host) or host.startswith("-"):
        raise HostfileError(f"{at}: {host[:40]!r} is not a host ([user@]host, as ssh takes "
                            "it)")
    fields: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise HostfileError(f"{at}: expected key=value, got {pair[:40]!r}")
        if key not in KEYS:
            raise HostfileError(f"{at}: unknown key {key[:40]!r} (known: {', '.join(KEYS)})")
        if key in fields:
            raise HostfileError(f"{at}: {key} is given twice")
        if not value:
            raise HostfileError(f"{at}: {key} is empty")
        fields[key] = value
    slots = 1
    if "slots" in fields:
        text = fields["slots"]
        if not text.isdigit() or not 1 <= int(text) <= MAX_SLOTS:
            raise HostfileError(f"{at}: slots must be a whole number from 1 to {MAX_SLOTS}, "
                                f"got {text[:40]!r}")
        slots = int(text)
    devices: tuple[str, ...] = ("cpu",)
    if "devices" in fields:
        devices = tuple(d for d in fields["devices"].split(",") if d)
        bad = next((d for d in devices if not DEVICE_SLOT.fullmatch(d)), None)
        if bad is not None or not devices:
            raise HostfileError(f"{at}: devices: {(bad or '')[:40]!r} is not 'cpu' or "
                                "'cuda:N'")
        if len(set(devices)) != len(devices):
            raise HostfileError(f"{at}: devices: a slot is named twice")
        if devices != ("cpu",) and len(devices) % slots:
            raise HostfileError(f"{at}: {len(devices)} device slot(s) do not split evenly over "
                                f"slots={slots}")
    python = fields.get("python", "python3")
    if not PYTHON.fullmatch(python):
        raise HostfileError(f"{at}: python: {python[:40]!r} is not a plain path")
    for key in ("data_host", "data_advertise"):
        if key in fields and not ADDRESS.fullmatch(fields[key]):
            raise HostfileError(f"{at}: {key}: {fields[key][:40]!r} is not a host name or "
                                "address")
    if fields.get("data_advertise") in ("0.0.0.0", "::"):
        raise HostfileError(f"{at}: data_advertise: {fields['data_advertise']} is a bind-all "
                            "address; give one neighbours can dial")
    return HostEntry(host=host, line=n, slots=slots, devices=devices, python=python,
                     data_host=fields.get("data_host"),
                     data_advertise=fields.get("data_advertise"))
