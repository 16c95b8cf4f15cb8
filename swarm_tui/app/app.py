"""``SwarmApp``: the console. Everything it knows comes through :class:`SwarmClient`.

Data flow: a worker consumes the leader's event stream (reconnecting with backoff), a timer
fetches full snapshots every few seconds to catch anything missed, both update one
:class:`ClusterModel`, and every change is published on ``model_changed`` so views redraw only
what it touched. Calls to the leader run in workers; their failures all arrive at one
``Worker.StateChanged`` handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
from rich.text import Text
from textual import work
from textual.app import App
from textual.binding import Binding, BindingType
from textual.dom import DOMNode
from textual.driver import Driver
from textual.reactive import reactive
from textual.signal import Signal
from textual.timer import Timer
from textual.worker import Worker, WorkerState

from swarm_core.client import ApiError, ClientError, LeaderUnreachable, SwarmClient
from swarm_core.config.profiles import ResolvedExperiment
from swarm_core.contract import JobInfo, JobSubmit
from swarm_core.contract.events import Event, Hello
from swarm_core.experiments.runner import Experiment, ExperimentError
from swarm_core.protocol import JobState, LinkLimits, SetSpeedRequest
from swarm_tui.app.cluster import LeaderAddress, OwnedCluster
from swarm_tui.app.commands import SwarmCommands
from swarm_tui.app.launch import LaunchPlan, LaunchSource, default_configs_dir, default_sources
from swarm_tui.app.model import LEFT, Change, ClusterModel
from swarm_tui.app.screens.dialogs import ConfirmDialog, HelpScreen, SetSpeedDialog
from swarm_tui.app.screens.fellows import FellowDetailScreen, FellowsScreen
from swarm_tui.app.screens.jobs import JobsScreen, JobWatchScreen
from swarm_tui.app.screens.launch import LaunchScreen
from swarm_tui.app.screens.record import DescribeScreen, FellowLogScreen
from swarm_tui.app.widgets.live_table import LiveTable
from swarm_tui.fmt import describe_speed

VIEWS = ("fellows", "jobs", "launch")
BACKOFF_MIN_S = 0.5
JOB_WINDOW = 100  # pending jobs in line and finished ones the console lists (the rest: counted)
BACKOFF_MAX_S = 5.0


class SwarmApp(App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "SilentSwarm"
    MODES: ClassVar[dict[str, Any]] = {
        "fellows": FellowsScreen,
        "jobs": JobsScreen,
        "launch": LaunchScreen,
    }
    DEFAULT_MODE = "fellows"
    COMMANDS = App.COMMANDS | {SwarmCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("1", "view('fellows')", "Fellows", show=False, id="view.fellows"),
        Binding("2", "view('jobs')", "Jobs", show=False, id="view.jobs"),
        Binding("3", "view('launch')", "Launch", show=False, id="view.launch"),
        Binding("question_mark", "help", "Help", id="app.help"),
        Binding("q", "ask_quit", "Quit", id="app.quit"),
        Binding("ctrl+q", "quit", "Quit", show=False, priority=True, id="app.quit_now"),
        Binding("ctrl+r", "refresh", "Refresh now", show=False, id="app.refresh"),
        # Priority, as Textual's own palette key is: it opens over the help screen and dialogs.
        Binding("ctrl+p", "command_palette", "Commands", show=False, priority=True,
                id="app.palette"),
    ]

    # connecting | live | polling (no event stream) | lost (no answer) | refused (an error answer)
    connection: reactive[str] = reactive("connecting")
    connection_detail: reactive[str] = reactive("")

    def __init__(self, client: SwarmClient, *, leader_url: str | None = None,
                 read_only: bool = False, clock: Callable[[], float] = time.time,
                 refresh_s: float | None = 3.0, tick_s: float | None = 1.0,
                 stream: bool = True, configs_dir: Path | None = None,
                 launch_sources: Sequence[LaunchSource] | None = None, note: str = "",
                 owns_client: bool = True, flush_s: float = 0.25,
                 cluster: OwnedCluster | None = None,
                 follow: Callable[[], LeaderAddress | None] | None = None,
                 connect: Callable[[str, str | None], SwarmClient] = SwarmClient,
                 keymap: dict[str, str] | None = None) -> None:
        super().__init__()
        self.keymap = dict(keymap or {})  # binding id -> keys, checked by keymap.check
        if self.keymap:
            self.set_keymap(self.keymap)
        self.client = client
        self.leader_url = leader_url or client.base_url
        self.read_only = read_only
        self.model = ClusterModel(clock)
        self.model_changed: Signal[Change] = Signal(self, "model_changed")
        # The fellows view lists those gone a while too (stale, offline, left: ``H``).
        self.show_gone = False
        self.refresh_s, self.tick_s, self.stream = refresh_s, tick_s, stream
        self.flush_s = flush_s
        self._pending = Change()
        self._flush_timer: Timer | None = None
        self.launch_sources: list[LaunchSource] = list(
            launch_sources or default_sources(configs_dir or default_configs_dir()))
        self.owns_client = owns_client
        # The local cluster this console started (quitting stops it: ask first), and where
        # the local cluster's leader is now (a restart-cluster moves it to a new port).
        self.cluster = cluster
        self.follow, self.connect = follow, connect
        self.note = note
        # A launch until its runs are queued (or refused): a second would queue them twice.
        self.launching = False
        self.sub_title = self.leader_url + (f"  {note}" if note else "")
        self._api_ok: bool | None = None
        self._stream_ok = False
        self._stream_error = ""
        self._api_error = ""
        self._retry_at: float | None = None
        self._wake_stream = asyncio.Event()  # the API answers again: retry the stream now
        self.snapshots = 0  # full refreshes applied (tests wait on it)

    # lifecycle --------------------------------------------------------------------------------
    def get_driver_class(self) -> type[Driver]:
        """Textual's driver for the platform; on Linux and macOS one whose input thread stops
        at once (a quit waited 0.2 s for it)."""
        driver = super().get_driver_class()
        if driver.__name__ == "LinuxDriver" and driver.__module__.startswith("textual."):
            from swarm_tui.app.driver import QuickExitDriver

            return QuickExitDriver
        return driver

    def on_mount(self) -> None:
        if self.cluster is not None:
            # An SSH session that drops (SIGHUP) or a kill (SIGTERM) still stops the cluster
            # this console started: exit cleanly, and the caller's `finally` stops it.
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGHUP, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.add_signal_handler(sig, self.exit)
        self.refresh_now()
        if self.stream:
            self.stream_events()
        if self.refresh_s:
            self.set_interval(self.refresh_s, self.refresh_now, name="refresh")
        if self.tick_s:
            self.set_interval(self.tick_s, self._tick, name="tick")

    async def on_unmount(self) -> None:
        if self.owns_client:
            await self.client.close()

    def publish(self, change: Change, *, now: bool = False) -> None:
        """Views redraw what ``change`` touched, at most every ``flush_s``: hundreds of
        heartbeats a second become a few frames a second."""
        if not change:
            return
        self._pending.merge(change)
        if now or not self.flush_s:
            self.flush_changes()
        elif self._flush_timer is None:
            self._flush_timer = self.set_timer(self.flush_s, self.flush_changes, name="flush")

    def flush_changes(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.stop()
            self._flush_timer = None
        change, self._pending = self._pending, Change()
        if change:
            self.model_changed.publish(change)

    def _tick(self) -> None:
        """Ages move on even when nothing happens."""
        self.publish(Change(ages=True))
        self._update_connection()

    # the leader -------------------------------------------------------------------------------
    def refresh_now(self) -> None:
        self.refresh_snapshot()

    def action_refresh(self) -> None:
        self.refresh_now()

    @work(exclusive=True, group="refresh", exit_on_error=False, description="refresh")
    async def refresh_snapshot(self) -> None:
        try:
            fellows = await self.client.fellows()
            jobs, left_out = await self._job_window()
            for extra in await self._watched_beyond(jobs):
                jobs.append(extra)  # (held now, so no longer among those left out)
                key = extra.state if extra.state == JobState.PENDING.value else "finished"
                left_out[key] = left_out.get(key, 0) - 1
        except ApiError as exc:  # it answers, but refuses (a wrong token): say so, keep trying
            self._api_ok, self._api_error = False, f"leader refused: {_one_line(exc)}"
            self._update_connection()
            if await self._follow_local_cluster():
                self.call_later(self.refresh_now)
            return
        except (LeaderUnreachable, aiohttp.ClientError, OSError, TimeoutError) as exc:
            self._api_ok, self._api_error = False, _one_line(exc)
            self._update_connection()
            if await self._follow_local_cluster():
                self.call_later(self.refresh_now)
            return
        if self._api_ok is False or not self._stream_ok:
            self._wake_stream.set()
        self._api_ok, self._api_error = True, ""
        self.model.need_refresh = False
        change = self.model.apply_fellows(fellows).merge(
            self.model.apply_jobs(jobs, left_out=left_out))
        self.snapshots += 1
        self._update_connection()
        self.publish(change)

    async def _job_window(self) -> tuple[list[JobInfo], dict[str, int]]:
        """The running job, the next pending ones in line and the latest to finish: a
        refresh a second costs the leader the same with 10 jobs held as with 10k."""
        # (one after another, not gathered: a snapshot is applied before the events that
        # follow it, as the fixed data of the snapshot tests assume)
        running = await self.client.jobs(JobState.RUNNING.value)
        pending = await self.client.job_page(JobState.PENDING.value, limit=JOB_WINDOW)
        finished = await self.client.job_page(order="finished", limit=JOB_WINDOW)
        left_out = {JobState.PENDING.value: (pending.total or 0) - len(pending.jobs),
                    "finished": (finished.total or 0) - len(finished.jobs)}
        return running + pending.jobs + finished.jobs, left_out

    async def _watched_beyond(self, listed: list[JobInfo]) -> list[JobInfo]:
        """The jobs open in a watch view that the window left out, each asked for: one the
        leader no longer has goes (its view says so), one that is only older stays."""
        have = {j.job_id for j in listed}
        out = []
        for jid in dict.fromkeys(s.job_id for s in self.screen_stack
                                 if isinstance(s, JobWatchScreen) and s.job_id not in have):
            try:
                out.append(await self.client.job(jid))
            except ApiError as exc:
                if exc.status != 404:
                    raise
        return out

    async def _follow_local_cluster(self) -> bool:
        """The leader does not answer: has the local cluster record moved on to another one
        (``swarm restart-cluster``)? Then talk to that one from now on."""
        if self.follow is None:
            return False
        found = await asyncio.to_thread(self.follow)
        if found is None or found[0].rstrip("/") == self.leader_url.rstrip("/"):
            return False
        url, token = found
        old, owned = self.client, self.owns_client
        self.client, self.owns_client = self.connect(url, token), True
        self.leader_url = url
        mine = self.cluster is not None and self.cluster.is_current()
        self.sub_title = url + (f"  {self.note}" if self.note and mine else "")
        self.model.last_seq = None  # a new leader numbers its events afresh
        self._api_ok, self._api_error, self._retry_at = None, "", None
        self._stream_ok = False
        self.notify(f"the local cluster was restarted: following its leader at {url}",
                    timeout=6)
        if self.stream:
            self.stream_events()  # (exclusive: replaces the one dialling the old port)
        if owned:
            with contextlib.suppress(Exception):
                await old.close()
        self._update_connection()
        self.publish(Change(ages=True), now=True)  # the top bar names the new leader
        return True

    @work(exclusive=True, group="events", exit_on_error=False, description="event stream")
    async def stream_events(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                async for ev in self.client.event_stream():
                    if isinstance(ev.data, Hello):
                        self._stream_ok, self._stream_error = True, ""
                        backoff = BACKOFF_MIN_S
                        self._update_connection()
                        self.refresh_now()  # whatever happened while we were away
                    self.apply_event(ev)
                reason = "the event stream closed"
            except (ClientError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                reason = _one_line(exc)
            self._stream_ok, self._stream_error = False, reason
            self._retry_at = self.model.clock() + backoff
            self._update_connection()
            self._wake_stream.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_stream.wait(), backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def apply_event(self, ev: Event | Mapping[str, Any]) -> Change:
        change = self.model.apply_event(ev)
        self.publish(change)
        if self.model.need_refresh:
            self.model.need_refresh = False
            self.refresh_now()
        return change

    def _update_connection(self) -> None:
        if self._api_ok is False and self._api_error.startswith("leader refused"):
            self.connection_detail = self._api_error
            self.connection = "refused"
        elif self._api_ok is False:
            left = "" if self._retry_at is None else \
                f"next try in {max(0.0, self._retry_at - self.model.clock()):.0f}s: "
            self.connection_detail = f"{left}{_short_reason(self._api_error)}"
            self.connection = "lost"
        elif self._stream_ok:
            self.connection, self.connection_detail = "live", ""
        elif self._api_ok and self.stream:
            self.connection_detail = f"event stream: {self._stream_error or 'connecting'}"
            self.connection = "polling"
        elif self._api_ok:
            self.connection, self.connection_detail = "live", ""
        else:
            self.connection, self.connection_detail = "connecting", ""

    def watch_connection(self, old: str, new: str) -> None:
        if old == new:
            return
        if new == "lost":
            self.notify(f"leader lost: {self._api_error}; retrying", severity="error",
                        timeout=4)
        elif new == "refused":
            self.notify(f"{self._api_error}; retrying", severity="error", timeout=6)
        elif old in ("lost", "refused") and new in ("live", "polling"):
            self.notify("leader back", timeout=3)

    @work(exclusive=True, group="job", exit_on_error=False, description="fetch job")
    async def fetch_job(self, job_id: str) -> None:
        self.publish(self.model.apply_job(await self.client.job(job_id)))

    # the one place worker failures arrive -----------------------------------------------------
    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        worker = event.worker
        if event.state is not WorkerState.ERROR:
            return
        exc = worker.error
        what = worker.description or worker.name or "request"
        if isinstance(exc, LeaderUnreachable):
            self._api_ok, self._api_error = False, _one_line(exc)
            self._update_connection()
            self.notify(f"{what}: {exc}", severity="error")
        elif isinstance(exc, ApiError):
            where = f" ({exc.field})" if exc.field else ""
            self.notify(f"{what}: leader refused: {exc.message}{where}", severity="error")
        else:
            self.notify(f"{what}: {type(exc).__name__}: {exc}", severity="error")
        if worker.group == "events":  # the stream must outlive any surprise
            self.set_timer(BACKOFF_MAX_S, self.stream_events)

    # views ------------------------------------------------------------------------------------
    def action_view(self, name: str) -> None:
        self.switch_view(name)

    def switch_view(self, name: str) -> None:
        if name not in VIEWS:
            return
        if self.current_mode != name:
            self.switch_mode(name)
        # To the view itself, not to a screen pushed over it (a fellow's detail, a job's
        # watch), now or when that view was left.
        while len(self.screen_stack) > 1:
            self.pop_screen()

    def action_ask_quit(self) -> None:
        # Only a cluster this console started, and only while it runs: one that
        # restart-cluster put in its place is not this console's to stop.
        if self.cluster is None or not self.cluster.running():
            self.exit()
            return
        body = "This console started a local cluster; quitting stops its leader and fellows"
        running = [v.info for v in self.model.jobs.values()
                   if v.info.state == JobState.RUNNING.value]
        if running:
            names = ", ".join(f"{j.job_id} {j.name}" for j in running[:3]) + \
                (f" and {len(running) - 3} more" if len(running) > 3 else "")
            body += f", so {names}, running on it, will fail"
        dialog = ConfirmDialog("Quit?", Text(body + " (ctrl+q quits without asking)."), "Quit")
        self.push_screen(dialog, lambda ok: self.exit() if ok else None)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(help_sections(), read_only=self.read_only,
                                    keymap=self.keymap))

    def watch_job(self, job_id: str) -> None:
        if self.current_mode != "jobs":
            self.switch_mode("jobs")
        screen = self.screen
        if isinstance(screen, JobWatchScreen):
            if screen.job_id == job_id:
                return
            self.pop_screen()
        self.push_screen(JobWatchScreen(job_id))

    # actions that change the cluster ----------------------------------------------------------
    def refuse_if_read_only(self, what: str) -> bool:
        if self.read_only:
            self.notify(f"read-only console: {what} is disabled", severity="warning")
        return self.read_only

    def _names(self, ids: Iterable[int]) -> list[tuple[int, str]]:
        return [(f, self.model.fellows[f].name if f in self.model.fellows else "?") for f in ids]

    def ask_set_speed(self, ids: Sequence[int]) -> None:
        if self.refuse_if_read_only("set-speed"):
            return
        if not ids:
            self.notify("no fellow selected", severity="warning")
            return
        if self._refuse_gone(ids, "set-speed", left_too=True):
            return
        first = self.model.fellows.get(ids[0])
        dialog = SetSpeedDialog(self._names(ids), first.tx_limit if first else None,
                                first.rx_limit if first else None,
                                first.latency_ms if first else 0.0)

        def done(req: SetSpeedRequest | None) -> None:
            if req is not None:
                self.set_speed(list(ids), req, link=dialog.link_given)

        self.push_screen(dialog, done)

    @work(group="set_speed", exit_on_error=False, description="set-speed")
    async def set_speed(self, ids: list[int], req: SetSpeedRequest, *, link: bool = True
                        ) -> None:
        """``link=False``: ``req.slowdown`` alone, each fellow's link left as it is."""
        # Not exclusive: a second request must not cancel the first one mid-flight. Each
        # fellow is its own request: one refused (it left meanwhile) does not stop the rest,
        # and the notice says which took it.
        limits = LinkLimits(req.tx_mbps, req.rx_mbps, req.latency_ms) if link else None
        said = describe_speed(limits, req.slowdown)
        sent: list[int] = []
        failed: list[str] = []
        for i, fid in enumerate(ids):
            try:
                await self.client.set_speed(fid, req, link=link)
                sent.append(fid)
            except ApiError as exc:
                failed.append(f"leader refused {exc.message}")
            except LeaderUnreachable as exc:  # (the rest would not get through either)
                failed.append(f"not sent to fellow{'s' if len(ids) - i > 1 else ''} "
                              f"{_ids(ids[i:])}: {exc}")
                break
        if sent:
            self.notify(f"set-speed {said} sent to fellow{'s' if len(sent) > 1 else ''} "
                        f"{_ids(sent)}")
        if failed:
            self.notify(f"set-speed {said}: " + "; ".join(failed), severity="error")
        self.refresh_now()

    def ask_release(self, ids: Sequence[int]) -> None:
        if self.refuse_if_read_only("release"):
            return
        if not ids:
            self.notify("no fellow selected", severity="warning")
            return
        if self._refuse_gone(ids, "release"):
            return
        # A fellow that does not heartbeat cannot be told to leave (the signal would wait
        # for ever): it has gone already; its record is forgotten instead.
        dead = [i for i in ids if self.model.gone(self.model.fellows[i])]
        if dead:
            how = self.key_hint("fellows.forget", "F")
            self.notify(f"release: fellow {_ids(dead)} is "
                        f"{self.model.shown_status(self.model.fellows[dead[0]])} (no heartbeat "
                        f"to take it); nothing sent. {how} forgets a gone fellow",
                        severity="warning")
            return
        names = ", ".join(f"{f} {n}" for f, n in self._names(ids))
        dialog = ConfirmDialog(f"Release {len(ids)} fellow{'s' if len(ids) > 1 else ''}?",
                               f"{names}\n\nThey stop their job and leave the cluster.",
                               "Release")

        def done(ok: bool | None) -> None:
            if ok:
                self.release(list(ids))

        self.push_screen(dialog, done)

    def _refuse_gone(self, ids: Sequence[int], what: str, *, left_too: bool = False) -> bool:
        """A fellow the leader no longer knows (a detail view left open) takes no action, and
        with ``left_too`` neither does one released or leaving (the leader refuses it a
        set-speed, part-way through a marked set): none of the set does."""
        gone = [i for i in ids if i not in self.model.fellows]
        if gone:
            self.notify(f"{what}: fellow {_ids(gone)} is no longer known to the leader",
                        severity="warning")
            return True
        if not left_too:
            return False
        left = [i for i in ids if self.model.fellows[i].status in LEFT]
        if left:
            self.notify(f"{what}: fellow {_ids(left)} has left the cluster; nothing sent",
                        severity="warning")
        return bool(left)

    def ask_release_all(self) -> None:
        if self.refuse_if_read_only("release all"):
            return
        # (released and leaving fellows have left already: they are not asked again)
        n = sum(1 for st in self.model.fellows.values() if st.status not in LEFT)
        if not n:
            self.notify("no fellow to release: every one has left", severity="warning")
            return
        dialog = ConfirmDialog(f"Release ALL {n} fellow{'s' if n != 1 else ''}?",
                               "Every fellow stops its job and leaves the cluster.",
                               "Release all")

        def done(ok: bool | None) -> None:
            if ok:
                self.release([], everyone=True)

        self.push_screen(dialog, done)

    def ask_forget(self, ids: Sequence[int]) -> None:
        """Drop the leader's records of gone fellows (stale, offline, left), after a
        confirmation; a live one is refused here with a notice (the leader would say 409)."""
        if self.refuse_if_read_only("forget"):
            return
        if not ids:
            self.notify("no fellow selected", severity="warning")
            return
        if self._refuse_gone(ids, "forget"):
            return
        live = [i for i in ids if not self.model.gone(self.model.fellows[i])]
        if live:
            self.notify(f"forget: fellow {_ids(live)} is "
                        f"{self.model.shown_status(self.model.fellows[live[0]])}: it still "
                        "heartbeats (release it first)", severity="warning")
            return
        names = ", ".join(f"{f} {n}" for f, n in self._names(ids))
        dialog = ConfirmDialog(f"Forget {len(ids)} fellow{'s' if len(ids) > 1 else ''}?",
                               f"{names}\n\nThe leader drops their records; one that comes "
                               "back registers as a new fellow.", "Forget")

        def done(ok: bool | None) -> None:
            if ok:
                self.forget(list(ids))

        self.push_screen(dialog, done)

    @work(group="forget", exit_on_error=False, description="forget")
    async def forget(self, ids: list[int]) -> None:
        forgotten: list[int] = []
        refused: list[str] = []
        for fid in ids:
            try:
                await self.client.forget(fid)
            except ApiError as exc:
                refused.append(exc.message)
            else:
                forgotten.append(fid)
        if forgotten:
            self.publish(self.model.forget(forgotten), now=True)
            self.notify(f"forgot fellow{'s' if len(forgotten) > 1 else ''} {_ids(forgotten)}")
        if refused:
            self.notify("forget: " + "; ".join(refused), severity="error")
        self.refresh_now()

    def key_hint(self, binding_id: str, default: str) -> str:
        """The key of a binding as remapped (for a notice that names it)."""
        return self.keymap.get(binding_id, default)

    @work(group="release", exit_on_error=False, description="release")
    async def release(self, ids: list[int], everyone: bool = False) -> None:
        released = await self.client.release(None if everyone else ids, all=everyone)
        self.notify(f"released fellow{'s' if len(released) != 1 else ''} {_ids(released)}"
                    if released else "no fellow to release")
        self.refresh_now()

    def ask_cancel(self, job_id: str) -> None:
        if self.refuse_if_read_only("cancel"):
            return
        view = self.model.jobs.get(job_id)
        if view is not None and view.terminal:
            self.notify(f"{job_id} is already {view.info.state}", severity="warning")
            return
        name = f" ({view.info.name})" if view is not None else ""
        # ("Cancel job" beside "Cancel" read as two ways to cancel: the no is "Keep job")
        dialog = ConfirmDialog(f"Cancel {job_id}?", f"{job_id}{name} stops on every fellow.",
                               "Cancel job", "Keep job")

        def done(ok: bool | None) -> None:
            if ok:
                self.cancel(job_id)

        self.push_screen(dialog, done)

    @work(group="cancel", exit_on_error=False, description="cancel")
    async def cancel(self, job_id: str) -> None:
        job = await self.client.cancel(job_id)
        self.publish(self.model.apply_job(job, with_history=False), now=True)
        self.notify(f"{job_id} {job.state.lower()}")

    def refuse_if_launching(self) -> bool:
        """A launch until its runs are queued: a second would queue them twice."""
        if self.launching:
            self.notify("a launch is under way: its runs are not queued yet", severity="warning")
        return self.launching

    def launch(self, plan: LaunchPlan, origin: Any = None) -> None:
        if self.refuse_if_read_only("launch") or self.refuse_if_launching():
            return
        self.launching = True
        if plan.experiment is not None:
            self._run_experiment(plan.experiment, origin)
            return
        self._submit(list(plan.runs), origin)

    @work(group="sweep", exit_on_error=False, description="sweep")
    async def _run_experiment(self, exp: ResolvedExperiment, origin: Any) -> None:
        """What ``swarm sweep`` does, from the console: preflight, queue every run, then keep
        each run's artifacts current while the console is open."""
        try:
            # (built in a thread: it asks git for the commit, which may take a moment)
            runner = await asyncio.to_thread(Experiment, self.client, exp,
                                             on_line=lambda _line: None)
            await runner.start()  # all or nothing: a refused run cancels those before it
        except (ExperimentError, ClientError) as exc:
            if origin is not None and hasattr(origin, "launch_failed"):
                origin.launch_failed(exc, [])
            return
        finally:
            self.launching = False
        name = exp.config.name
        queued = [st.job_id for st in runner.states if st.job_id]
        runs = len(runner.states)
        self.notify(f"sweep {name}: {runs} run{'s' if runs != 1 else ''}"
                    + (f", queued {' '.join(queued)}" if queued else ", one at a time")
                    + f"; artifacts in {runner.runs_dir}", timeout=8)
        self.action_refresh()
        self._show_queued(origin, queued[:1])
        try:
            states = await runner.run()
        except (ClientError, ExperimentError, OSError) as exc:
            # The runs stay queued on the leader; only this console stops writing artifacts.
            self.notify(f"sweep {name}: stopped following it: {exc}", severity="warning")
            return
        bad = [f"{st.spec.run_name} {st.state}" for st in states if st.state != "COMPLETED"]
        self.notify(f"sweep {name} finished: {len(states) - len(bad)}/{len(states)} completed"
                    + (f"; {', '.join(bad)}" if bad else ""),
                    severity="warning" if bad else "information", timeout=10)

    @work(group="submit", exit_on_error=False, description="launch")
    async def _submit(self, runs: list[JobSubmit], origin: Any) -> None:
        submitted: list[str] = []
        try:
            for req in runs:
                job = await self.client.submit(req)
                submitted.append(job.job_id)
                self.publish(self.model.apply_job(job, with_history=False), now=True)
        except ClientError as exc:
            if origin is not None and hasattr(origin, "launch_failed"):
                origin.launch_failed(exc, submitted)
            raise
        finally:
            self.launching = False
        self.notify(f"submitted {', '.join(submitted)}")
        self._show_queued(origin, submitted[-1:])

    def _show_queued(self, origin: Any, job_ids: list[str]) -> None:
        """To the queue, cursor on the job, if the user still looks at the launcher: one who
        has moved on meanwhile stays where they went (the notice says what was queued)."""
        if origin is not None and self.screen is not origin:
            return
        self.switch_view("jobs")
        screen = self.screen
        if isinstance(screen, JobsScreen) and job_ids:
            screen.select_job(job_ids[0])


# help_sections' titles of modal screens (and the help screen itself, see keymap.remappable).
MODAL_VIEWS = frozenset({"set-speed dialog", "confirmation", "export dialog", "columns dialog",
                         "help"})


def help_sections() -> list[tuple[str, list[Binding]]]:
    """Every binding of every view, for the help screen."""
    from swarm_tui.app.screens.dialogs import ColumnsDialog as Columns
    from swarm_tui.app.screens.dialogs import ConfirmDialog as Confirm
    from swarm_tui.app.screens.dialogs import ExportDialog as Export
    from swarm_tui.app.screens.dialogs import SetSpeedDialog as Speed

    def of(cls: type[DOMNode]) -> list[Binding]:
        return [b for b in cls.BINDINGS if isinstance(b, Binding)]

    navigation = [
        # The widgets' own keys: listed for help, without ids (they cannot be remapped).
        Binding("up,down,pageup,pagedown", "", "move in a table"),
        Binding("left,right", "", "scroll a wide table sideways"),
        Binding("enter", "", "open (fellow detail / job watch)"),
        Binding("tab,shift+tab", "", "next / previous field"),
    ]
    return [
        ("everywhere", of(SwarmApp)),
        ("fellows", of(FellowsScreen)),
        ("fellow detail", of(FellowDetailScreen)),
        ("jobs", of(JobsScreen)),
        ("job watch", of(JobWatchScreen)),
        ("launch", of(LaunchScreen)),
        ("describe", of(DescribeScreen)),
        ("fellow log", of(FellowLogScreen)),
        ("set-speed dialog", of(Speed)),
        ("confirmation", of(Confirm)),
        ("export dialog", of(Export)),
        ("columns dialog", of(Columns)),
        ("tables", of(LiveTable)),
        ("tables and forms", navigation),
    ]


def _ids(ids: Iterable[int]) -> str:
    return ", ".join(map(str, ids))


def _short_reason(text: str) -> str:
    """``cannot reach the leader at URL: connection refused …`` -> ``connection refused …``
    (the URL is on screen already)."""
    head, sep, tail = text.partition(": ")
    return tail if sep and head.startswith("cannot reach the leader") else text


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
