"""What every headless command shares: exit codes, errors, output formats, the leader client.

Exit codes and ``--format json`` output are an API for scripts; ``swarm llm-doc`` documents both.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import os
import shutil
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from swarm_core import jsonio
from swarm_core.client import ApiError, LeaderUnreachable, SwarmClient, check_leader_url
from swarm_core.schema import unstructure


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    UNREACHABLE = 3
    INTERRUPTED = 130


EXIT_CODE_MEANING = {
    ExitCode.OK: "success",
    ExitCode.FAILURE: "the action failed (the leader refused it, a job failed, a process died)",
    ExitCode.USAGE: "bad command line (unknown flag, bad value)",
    ExitCode.UNREACHABLE: "no leader: none configured, or it did not answer",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C)",
}


class CommandError(Exception):
    """A one-line message for stderr plus the exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.FAILURE) -> None:
        super().__init__(message)
        self.code = code


FORMATS = ("table", "json")


def add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="table",
                        help="table for people, json for scripts (default: table)")


def emit_json(data: Any) -> None:
    data = unstructure(data)
    sys.stdout.write(jsonio.dumps(data, pretty=True).decode() + "\n")
    sys.stdout.flush()


def emit_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    width = shutil.get_terminal_size((160, 24)).columns if sys.stdout.isatty() else 200
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row))
    Console(width=width, soft_wrap=False).print(table)


def print_line(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def warn(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


# --- the leader ---------------------------------------------------------------------------------


def resolve_leader(args: argparse.Namespace) -> tuple[str, str | None]:
    """URL: --leader-url, SWARM_LEADER_URL, the local cluster. Token: --token, SWARM_TOKEN, the
    local cluster's token file when the URL is the local cluster's."""
    from swarm_tui.commands.local_cluster import read_record, token_for

    for flag in ("leader_url", "token"):  # given but empty: a script's unset variable
        if getattr(args, flag, None) == "":
            raise CommandError(f"--{flag.replace('_', '-')} is empty", ExitCode.USAGE)
    url = getattr(args, "leader_url", None) or os.environ.get("SWARM_LEADER_URL")
    try:
        record = read_record()
    except CommandError:
        if not url:
            raise
        record = None  # (a leader named outright does not need it)
    if not url and record is not None:
        url = record.leader_url
    if not url:
        raise CommandError(
            "no leader: pass --leader-url, set SWARM_LEADER_URL, or run 'swarm restart-cluster'",
            ExitCode.UNREACHABLE,
        )
    try:
        check_leader_url(url)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    token = getattr(args, "token", None) or os.environ.get("SWARM_TOKEN")
    if not token and record is not None and record.leader_url.rstrip("/") == url.rstrip("/"):
        token = token_for(record)
    return url, token


def run_with_client(args: argparse.Namespace,
                    body: Callable[[SwarmClient], Awaitable[int | None]]) -> int:
    url, token = resolve_leader(args)

    async def main() -> int | None:
        async with SwarmClient(url, token) as client:
            return await body(client)

    return run_async(main())


def run_async(coro: Awaitable[int | None]) -> int:
    try:
        result = asyncio.run(coro)  # type: ignore[arg-type]
    except LeaderUnreachable as exc:
        raise CommandError(str(exc), ExitCode.UNREACHABLE) from None
    except ApiError as exc:
        raise CommandError(f"leader refused: {exc}", ExitCode.FAILURE) from None
    return int(ExitCode.OK if result is None else result)


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


def fmt_mbps(v: float | None) -> str:
    return "unlimited" if v is None else f"{v:g}"


def fmt_loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def check_dir(path: Path, what: str) -> None:
    """``path`` must be a directory, or one that can be made: the nearest part of it that
    exists is a directory."""
    part = path
    try:
        while not part.exists() and part != part.parent:
            part = part.parent
        if part.exists() and not part.is_dir():
            raise CommandError(f"{what}: {part} is not a directory", ExitCode.USAGE)
    except OSError as exc:  # (exists() raises on a directory we may not search)
        raise CommandError(f"{what}: cannot look at {part}: {exc.strerror}", ExitCode.USAGE) \
            from None


def check_state_dir(path: Path) -> None:
    """A leader's state dir must be a directory, or not exist yet."""
    check_dir(path, "--state-dir")


def check_gpu_slots(slots: Sequence[str]) -> None:
    """Device slots this machine cannot serve are refused now, not at a job's START (and never
    trained on the CPU instead). Imports torch (seconds) only when a GPU slot is named."""
    gpus = [d for d in slots if d != "cpu"]
    if not gpus:
        return
    from swarm_core.pipeline.devices import DeviceError, resolve_device

    for d in gpus:
        try:
            resolve_device(d)
        except DeviceError as exc:
            raise CommandError(f"--devices: {exc}", ExitCode.USAGE) from None
