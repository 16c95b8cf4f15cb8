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
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from swarm_core import jsonio
from swarm_core.client import ApiError, LeaderUnreachable, SwarmClient, check_leader_url
from swarm_core.local_cluster import ClusterError, read_record, token_for
from swarm_core.paths import dir_problem, private_dir_problem
from swarm_core.schema import unstructure
from swarm_core.validators import printable


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
    from rich.text import Text

    width = shutil.get_terminal_size((160, 24)).columns if sys.stdout.isatty() else 200
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        # Text, not markup: a job name or a fellow's message with [brackets] shows as written.
        table.add_row(*(Text("-" if v is None else printable(str(v))) for v in row))
    Console(width=width, soft_wrap=False).print(table)


# What the leader relays (a fellow's failure, a host name) is shown, never obeyed: a control
# character could move the cursor, retitle the terminal or hide the line before it.
def print_line(text: str) -> None:
    sys.stdout.write(printable(text, keep_newlines=True) + "\n")
    sys.stdout.flush()


def warn(text: str) -> None:
    sys.stderr.write(printable(text, keep_newlines=True) + "\n")
    sys.stderr.flush()


# --- the leader ---------------------------------------------------------------------------------


def resolve_leader(args: argparse.Namespace) -> tuple[str, str | None]:
    """URL: --leader-url, SWARM_LEADER_URL, the local cluster. Token: --token, SWARM_TOKEN, the
    local cluster's token file when the URL is the local cluster's."""
    for flag in ("leader_url", "token"):  # given but empty: a script's unset variable
        if getattr(args, flag, None) == "":
            raise CommandError(f"--{flag.replace('_', '-')} is empty", ExitCode.USAGE)
    url = getattr(args, "leader_url", None) or os.environ.get("SWARM_LEADER_URL")
    try:
        record = read_record()
    except ClusterError:
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


def exit_code(exc: CommandError | ClusterError) -> ExitCode:
    """What a failed action exits with."""
    if isinstance(exc, CommandError):
        return exc.code
    return ExitCode.USAGE if exc.usage else \
        ExitCode.UNREACHABLE if exc.unreachable else ExitCode.FAILURE


def run_with_client(args: argparse.Namespace,
                    body: Callable[[SwarmClient], Awaitable[int | None]]) -> int:
    url, token = resolve_leader(args)

    async def main() -> int | None:
        async with SwarmClient(url, token) as client:
            return await body(client)

    return run_async(main())


def run_async(coro: Coroutine[Any, Any, int | None]) -> int:
    try:
        result = asyncio.run(coro)
    except LeaderUnreachable as exc:
        raise CommandError(str(exc), ExitCode.UNREACHABLE) from None
    except ApiError as exc:
        raise CommandError(f"leader refused: {exc}", ExitCode.FAILURE) from None
    return int(ExitCode.OK if result is None else result)


def check_dir(path: Path, what: str) -> None:
    """``path`` must be a directory, or one that can be made: the nearest part of it that
    exists is a directory."""
    problem = dir_problem(path)
    if problem:
        raise CommandError(f"{what}: {problem}", ExitCode.USAGE)


def check_state_dir(path: Path) -> None:
    """A leader's state dir must not exist yet, or be a directory that only its owner can
    write (it holds the token and the database; an existing one is never chmodded)."""
    problem = private_dir_problem(path)
    if problem:
        raise CommandError(f"--state-dir: {problem}", ExitCode.USAGE)


def check_gpu_slots(slots: Sequence[str]) -> None:
    """Device slots this machine cannot serve are refused now, not at a job's START (and never
    trained on the CPU instead). Imports torch (seconds) only when a GPU slot is named."""
    gpus = [d for d in slots if d != "cpu"]
    if not gpus:
        return
    from swarm_core.pipeline.devices import DeviceError, check_slots

    try:
        check_slots(gpus)
    except DeviceError as exc:
        raise CommandError(f"--devices: {exc}", ExitCode.USAGE) from None
