"""A progress bar per run for ``swarm sweep`` and ``swarm suite`` in an interactive terminal:
step of steps, loss, state, ETA (rich). Anywhere else (a pipe, a log file, ``--format json``)
the commands keep their plain progress lines, which scripts and the seed's workflow read."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from swarm_core.experiments.runner import TERMINAL, Experiment, RunState
from swarm_core.validators import printable

STATE_STYLE = {"COMPLETED": "green", "FAILED": "bold red", "CANCELLED": "yellow",
               "RUNNING": "cyan"}


def wants_bars(fmt: str) -> bool:
    """Bars only for a person at a terminal: table output to a TTY."""
    return fmt == "table" and sys.stdout.isatty()


class RunBars:
    """One bar per run; other lines print above the bars. Use as a context manager around the
    runner's monitoring, with ``line`` as its on_line and ``update`` as its on_update."""

    def __init__(self, states: list[RunState], console: Console | None = None) -> None:
        self.progress = Progress(
            TextColumn("{task.description}", style="bold", markup=False),  # (names as written)
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}", markup=False),
            TextColumn("{task.fields[state]}"),  # (markup of ours: see _state)
            TextColumn("ETA"), TimeRemainingColumn(),
            console=console or Console(), transient=False,
            # Steps come from the leader once per poll: the ETA averages over a minute.
            speed_estimate_period=60.0)
        self.tasks: dict[str, TaskID] = {}
        for st in states:
            # Not started until it runs: a queued run's wait is no part of its ETA.
            self.tasks[st.run_id] = self.progress.add_task(
                printable(st.spec.run_name), total=_steps(st), start=False, loss="-",
                state=_state(st.state))

    def __enter__(self) -> RunBars:
        self.progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.progress.stop()

    def line(self, text: str) -> None:
        """A line above the bars (as Text: what the leader relays is shown, never obeyed)."""
        self.progress.console.print(Text(printable(text, keep_newlines=True)))

    def update(self, st: RunState, line: str | None) -> None:
        task = self.tasks.get(st.run_id)
        if task is None:
            return
        if st.state == "RUNNING" and not _task(self.progress, task).started:
            self.progress.start_task(task)
        loss = "-" if st.last_loss is None else f"{st.last_loss:.4f}"
        fields: dict[str, Any] = {"loss": loss, "state": _state(st.state)}
        completed = st.last_step
        if st.state == "COMPLETED":
            completed = _steps(st) or completed
        self.progress.update(task, completed=completed, **fields)
        if st.state in TERMINAL:
            self.progress.stop_task(task)
            if st.state != "COMPLETED" and line is not None:
                self.line(line)  # (why it failed stays on screen, above the bars)


def _steps(st: RunState) -> int | None:
    steps = st.spec.training.get("steps")
    return steps if isinstance(steps, int) else None


def _state(state: str) -> str:
    """The state as markup (escaped: it is the leader's word)."""
    return f"[{STATE_STYLE.get(state, 'dim')}]{escape(printable(state))}[/]"


def _task(progress: Progress, task: TaskID) -> Any:
    return next(t for t in progress.tasks if t.id == task)


async def follow(runner: Experiment, fmt: str) -> None:
    """Run and monitor until every run ends: a bar per run at a terminal, else the lines."""
    if not wants_bars(fmt):
        await runner.run()
        return
    plain = runner.on_line
    with RunBars(runner.states) as bars:
        runner.on_line, runner.on_update = bars.line, bars.update
        try:
            await runner.run()
        finally:
            runner.on_line, runner.on_update = plain, None
