"""The current view of a table as a file (no Textual): CSV or JSON, by the file's extension.

What is exported is what the table shows — its rows after the filter, in its sort order — but
with each cell's value rather than its display text where the cell has one (bytes as numbers,
not "1.2 MB/s"; empty where the screen shows "-", and for an unlimited link), so the file goes
straight into pandas or a spreadsheet. Columns are named by their keys (``tx_rate``,
``loss``). An existing file is never overwritten; in CSV, text that a spreadsheet would run as
a formula (``=``, ``+``, ``-``, ``@``) is prefixed with ``'``.
"""

from __future__ import annotations

import csv
import io
import math
import time
from pathlib import Path
from typing import Any

from swarm_core import jsonio
from swarm_core.paths import atomic_write

FORMATS = (".csv", ".json")
SKIP_COLUMNS = {"sel"}  # the mark column is a console state, not data


class ExportError(ValueError):
    """One line saying why nothing was written."""


def default_name(view: str, suffix: str = ".csv") -> str:
    return f"swarm-{view}-{time.strftime('%Y%m%d-%H%M%S')}{suffix}"


def cell_value(cell: Any) -> Any:
    """What a cell exports: its declared export value, else its value when that is a plain
    scalar, None when it has none (a "-" on screen; an unlimited link), else its text (the
    value is only a sort key, as for job ids and states)."""
    if cell is None:
        return None
    export = getattr(cell, "export", NotImplemented)
    if export is not NotImplemented:
        return export
    sort_key = getattr(cell, "sort_key", None)
    if sort_key is not None:
        if sort_key[0] == 1:
            return None
        value = sort_key[1]
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, bool | int | str):
            return value
    text = getattr(cell, "plain", str(cell)).strip()
    return text or None


def _csv_safe(value: Any) -> Any:
    # Fellow and job names are anyone's text: a spreadsheet must not run "=..." as a formula.
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return "" if value is None else value


def render(rows: list[dict[str, Any]], columns: list[str], suffix: str) -> bytes:
    if suffix == ".json":
        return jsonio.dumps(rows, pretty=True)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows({c: _csv_safe(r.get(c)) for c in columns} for r in rows)
    return out.getvalue().encode()


def write_view(path: str | Path, columns: list[str], rows: list[dict[str, Any]]) -> Path:
    """Write ``rows`` atomically; the format comes from the extension. Raises ExportError."""
    text = str(path).strip()
    if not text:
        raise ExportError("give a file name ending in .csv or .json")
    try:
        target = Path(text).expanduser()
    except RuntimeError as exc:  # ~user with no such user
        raise ExportError(f"{text}: {exc}") from None
    suffix = target.suffix.lower()
    if target.name.lower() in FORMATS:  # (".csv" alone: a hidden file with no extension)
        raise ExportError(f"{target.name}: give a name before the extension")
    if suffix not in FORMATS:
        raise ExportError(f"{target.name}: the name must end in .csv or .json")
    try:
        # Any of these may raise too: a folder we may not read, a name too long.
        if target.is_dir():
            raise ExportError(f"{target}: is a directory")
        if target.exists() or target.is_symlink():
            raise ExportError(f"{target.name} exists already: pick another name")
        if not target.parent.is_dir():
            raise ExportError(f"{target.parent}: no such directory")
        atomic_write(target, render(rows, columns, suffix))
    except ExportError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ExportError(f"{target}: {detail}") from None
    return target
