"""The fellow's control loop: register, heartbeat every second, long-poll signals, run jobs."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import secrets
import signal
import socket
import urllib.parse
from typing import Any

import attrs

import swarm_core
from swarm_core.client import ApiError, ClientError, LeaderUnreachable, SwarmClient
from swarm_core.contract import (
    CellRef,
    FellowLogTail,
    Heartbeat,
    JobStatusUpdate,
    MembersSignal,
    RegroupAnswer,
    RegroupReport,
    StageStart,
    UnreportedFinal,
)
from swarm_core.contract.heartbeat import MAX_UNREPORTED
from swarm_core.fellow.jobs import (
    JobContext,
    JobRefused,
    LinkOverrides,
    Progress,
    import_engine,
    run_job,
)
from swarm_core.fellow.logring import LogRing, current_owner
from swarm_core.pipeline.frames import FrameError
from swarm_core.pipeline.heap import keep_large_blocks
from swarm_core.pipeline.links import LinkShaper
from swarm_core.pipeline.listener import DataListener
from swarm_core.pipeline.pace import Pace
from swarm_core.pipeline.peers import peer_states
from swarm_core.protocol import (
    ByteCounters,
    FellowStatus,
    LinkLimits,
    RegisterRequest,
    ReportedStatus,
    SetSpeedRequest,
    Signal,
    is_bind_all,
)
from swarm_core.schema import SchemaError, structure

log = logging.getLogger("swarm.fellow")

REPORT_PATIENCE_S = 120.0
# How long a fellow told to stop (SIGTERM, SIGINT) lets its running stages wind down: their
# stage threads stop between ops, and what they still had to report waits for no leader.
STOP_GRACE_S = 3.0
GOODBYE_S = 2.0  # the last heartbeat of a stopping fellow, to a leader that may be gone

# The fellow only ever takes the statuses it may report of itself (stale and offline are the
# leader's judgement), and a heartbeat carries them as their plain names.
_REPORTED: dict[FellowStatus, ReportedStatus] = {
    FellowStatus.READY: "ready", FellowStatus.BUSY: "busy",
    FellowStatus.RELEASED: "released", FellowStatus.LEAVING: "leaving"}


@attrs.define
class FellowOptions:
    leader_url: str
    token: str | None
    name: str = attrs.field(factory=socket.gethostname)
    devices: list[str] = attrs.field(factory=lambda: ["cpu"])
    threads: int = 1
    heartbeat_s: float = 1.0
    poll_wait_s: float = 15.0
    max_backoff_s: float = 5.0
    data_host: str = "127.0.0.1"
    data_port: int = 0
    # The host neighbours dial, when it is not data_host (a bind-all address, NAT). None with a
    # bind-all data_host: the address this machine reaches the leader from.
    data_advertise: str | None = None
    # The directories jobs may read files from (``training.dataset_paths``), resolved; empty:
    # none at all. A fellow's operator names them: a job is not trusted with the machine.
    data_roots: tuple[str, ...] = ()
    # Emulated compute slowdown of its stages (swarm_core.pipeline.pace); SET_SPEED changes it.
    slowdown: float = 1.0


def advertised_host(opts: FellowOptions) -> str:
    """The data-plane host to register. Raises OSError when a bind-all data_host has no route
    to the leader to take it from."""
    if opts.data_advertise:
        return opts.data_advertise
    if not is_bind_all(opts.data_host):
        return opts.data_host
    # The source address of the route to the leader: connecting a UDP socket only picks it
    # (nothing is sent). Fellows reach each other where they reach the leader.
    url = urllib.parse.urlsplit(opts.leader_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((url.hostname or "127.0.0.1", url.port or 80))
        return probe.getsockname()[0]


def _data_plane_fault(exc: BaseException) -> bool:
    """A failure the data plane explains in one line: a link error pointing at a neighbouring
    stage, or a frame refused by its checks."""
    return getattr(exc, "peer_stage", None) is not None or isinstance(exc, FrameError)


def parse_start(payload: dict) -> StageStart:
    """A START signal's payload as the stage it describes; JobRefused saying what is wrong."""
    try:
        return structure(payload, StageStart)
    except SchemaError as exc:
        raise JobRefused(f"bad START payload: {exc}") from None


def _raw_int(payload: dict, key: str) -> int:
    """A field of a START that did not structure, for the report that refuses it."""
    value = payload.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class SessionLost(Exception):
    """The leader no longer knows our session (it restarted): register again."""


def reconnect_cap(max_backoff_s: float, stale_after_s: float) -> float:
    """The longest a fellow waits between tries to reach its leader (see Liveness.watch_s)."""
    return max(0.2, min(max_backoff_s, stale_after_s / 4))


class FellowDaemon:
    def __init__(self, opts: FellowOptions) -> None:
        self.opts = opts
        self.instance_id = secrets.token_hex(8)
        self.client = SwarmClient(opts.leader_url, opts.token)
        self.fellow_id: int | None = None
        self.session = ""
        self.shaper = LinkShaper()
        self.links = LinkOverrides(self.shaper)
        self.pace = Pace(opts.slowdown)
        self.listeners: list[DataListener] = []  # one per device slot
        self.signal_seq = 0
        self.status = FellowStatus.READY
        # One running cell per device slot, keyed by (job, stage, replica).
        self.stages: dict[tuple[str, int, int], tuple[asyncio.Task[None], Progress]] = {}
        # Final reports the leader did not take in time, sent with the heartbeats until one is
        # answered: a job whose last report was lost must not stay RUNNING on the leader.
        self.unreported: collections.deque[UnreportedFinal] = collections.deque(
            maxlen=MAX_UNREPORTED)
        self._stop = asyncio.Event()
        self._reports_dropped = False  # stopping, the leader unreachable: report no more
        self._beat_now = asyncio.Event()
        self.exit_reason = ""
        # Retries back off to this; once registered, to a quarter of the leader's heartbeat
        # timeout, so a leader back from a restart hears from its fellows well inside the grace
        # it gives their running job (a fixed 5 s cap outlasted a 2 s timeout).
        self.backoff_cap = opts.max_backoff_s
        # Its own log lines, for a console elsewhere (through the leader: ``send_log``), and
        # the newest line the leader holds of them this session (None: send the whole tail).
        self.log_ring = LogRing(self)
        self._log_sent: int | None = None
        self._log_post: asyncio.Task[None] | None = None

    # lifecycle --------------------------------------------------------------------------------
    def request_stop(self, reason: str = "signal") -> None:
        self.exit_reason = reason
        self._stop.set()

    async def run(self) -> int:
        """Run until stopped or released. Returns the process exit code."""
        # Before any thread of ours exists: the stage threads must share the main heap.
        keep_large_blocks()
        owner = current_owner.set(self)  # (this task's context, and every task it starts)
        logging.getLogger().addHandler(self.log_ring)
        try:
            return await self._run()
        finally:
            logging.getLogger().removeHandler(self.log_ring)
            current_owner.reset(owner)

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop, sig.name)
        try:
            advertise = advertised_host(self.opts)
        except OSError as exc:
            self.exit_reason = (f"registration refused: --data-host {self.opts.data_host} binds "
                                f"every address and the route to the leader names none ({exc}); "
                                "give --data-advertise")
            await self.client.close()
            return 1
        try:
            for slot in range(len(self.opts.devices)):
                port = self.opts.data_port + slot if self.opts.data_port else 0
                self.listeners.append(DataListener(self.opts.data_host, port, advertise))
        except OSError as exc:
            self.exit_reason = f"registration refused: cannot open the data port: {exc}"
            for ln in self.listeners:
                ln.close()
            await self.client.close()
            return 1
        # Warm the training engine up in the background: START then finds torch loaded.
        warmup = loop.run_in_executor(None, import_engine)
        warmup.add_done_callback(lambda f: f.exception())  # errors surface at START instead
        try:
            while not self._stop.is_set():
                if not await self._register():
                    break
                await self._serve_session()
        finally:
            await self._stop_job(grace_s=STOP_GRACE_S)
            await self._say_goodbye()
            await self.client.close()
            for ln in self.listeners:
                ln.close()
        log.info("fellow %s exiting: %s", self.opts.name, self.exit_reason or "done")
        return 0

    async def _register(self) -> bool:
        backoff = 0.2
        req = RegisterRequest(
            name=self.opts.name, instance_id=self.instance_id, host=socket.gethostname(),
            pid=os.getpid(), devices=list(self.opts.devices), threads=self.opts.threads,
            data_addr=self.listeners[0].addr if self.listeners else None,
            data_addrs=[ln.addr for ln in self.listeners],
            version=swarm_core.__version__,
        )
        while not self._stop.is_set():
            try:
                res = await self.client.register(req)
            except (LeaderUnreachable, ApiError) as exc:
                if isinstance(exc, ApiError) and exc.status in (400, 401, 403):
                    log.error("leader refused registration: %s", exc)
                    self.exit_reason = f"registration refused: {exc}"
                    return False
                log.warning("register failed (%s); retrying in %.1fs", exc, backoff)
                await self._sleep(backoff)
                backoff = min(backoff * 2, self.backoff_cap)
                continue
            self.fellow_id, self.session = res.fellow_id, res.session
            self.backoff_cap = reconnect_cap(self.opts.max_backoff_s, res.stale_after_s)
            self.signal_seq = 0
            self._log_sent = None  # (a new session: the leader may hold none of it)
            log.info("registered as fellow %d (%s)", res.fellow_id, self.opts.name)
            return True
        return False

    async def _serve_session(self) -> None:
        tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._signal_loop(), name="signals"),
            asyncio.create_task(self._stop.wait(), name="stop"),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if exc is not None and not isinstance(exc, SessionLost):
                    raise exc
        finally:
            if self._log_post is not None:
                tasks.append(self._log_post)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

    # heartbeats -------------------------------------------------------------------------------
    @property
    def progress(self) -> Progress:
        """What the heartbeat says: the slowest stage's step, the last stage's loss."""
        if not self.stages:
            return Progress()
        ps = [p for _t, p in self.stages.values()]
        losses = [p for p in ps if p.loss is not None]
        return Progress(
            job_id=ps[0].job_id, stage=min(p.stage or 0 for p in ps),
            step=min(p.step for p in ps),
            loss=max(losses, key=lambda p: p.stage or 0).loss if losses else None,
            tokens_per_s=max(p.tokens_per_s for p in ps))

    def heartbeat_body(self) -> Heartbeat:
        p = self.progress
        return Heartbeat(
            status=_REPORTED[self.status], current_job=p.job_id, current_stage=p.stage,
            current_step=p.step, last_loss=p.loss, tokens_per_s=p.tokens_per_s,
            counters=ByteCounters(
                control_tx=self.client.bytes_sent, control_rx=self.client.bytes_received,
                data_tx=self.shaper.tx_bytes, data_rx=self.shaper.rx_bytes,
            ),
            link=self.shaper.limits(), signal_seq=self.signal_seq,
            running=[CellRef(job_id=k[0], stage=k[1], replica=k[2], attempt=p.attempt)
                     for k, (t, p) in self.stages.items() if not t.done()],
            unreported=list(self.unreported),
            peers=peer_states(self.shaper), slowdown=self.pace.slowdown,
        )

    async def _heartbeat_loop(self) -> None:
        backoff = 0.2
        while True:
            body = self.heartbeat_body()
            try:
                assert self.fellow_id is not None
                answer = await self.client.heartbeat(self.fellow_id, self.session, body)
                self._delivered(body.unreported)
                if isinstance(answer, dict) and answer.get("send_log") and (
                        self._log_post is None or self._log_post.done()):
                    # Beside the heartbeats, not in their way: a slow link delays the log,
                    # never the fellow's liveness.
                    self._log_post = asyncio.create_task(self._send_log(), name="log-post")
                backoff = 0.2
                wait = self.opts.heartbeat_s
            except ApiError as exc:
                if exc.status in (401, 403, 404):
                    log.warning("leader forgot this fellow (%s); registering again", exc)
                    raise SessionLost() from None
                log.warning("heartbeat refused: %s", exc)
                # Answered: what it carried was read (a report the leader refuses must not
                # keep every later heartbeat from being taken), unless the leader could not
                # store it (503): then the next heartbeat carries it again.
                if exc.status != 503:
                    self._delivered(body.unreported)
                wait = self.opts.heartbeat_s
            except LeaderUnreachable as exc:
                log.warning("heartbeat failed (%s); retrying in %.1fs", exc, backoff)
                wait, backoff = backoff, min(backoff * 2, self.backoff_cap)
            self._beat_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), wait)

    async def _send_log(self) -> None:
        """Post the lines the leader does not hold yet (all of them, once a session): someone
        reads this fellow's log. Even none new is posted: it tells the reader they are current.
        Failures are not logged above debug: each would be a new line to send."""
        assert self.fellow_id is not None
        seq, lines, whole = self.log_ring.since(self._log_sent)
        try:
            await self.client.post_log(self.fellow_id, self.session,
                                       FellowLogTail(seq=seq, lines=lines, replace=whole))
            self._log_sent = seq
        except ApiError as exc:
            log.debug("log post refused: %s", exc)
            self._log_sent = None  # (out of step, say after a leader restart: all next time)
        except ClientError as exc:
            log.debug("log post failed: %s", exc)

    def _delivered(self, sent: list[UnreportedFinal]) -> None:
        for final in sent:
            with contextlib.suppress(ValueError):
                self.unreported.remove(final)

    # signals ----------------------------------------------------------------------------------
    async def _signal_loop(self) -> None:
        backoff = 0.2
        while True:
            try:
                assert self.fellow_id is not None
                batch = await self.client.poll_signals(
                    self.fellow_id, self.session, self.signal_seq, self.opts.poll_wait_s)
                backoff = 0.2
            except ApiError as exc:
                if exc.status in (401, 403, 404):
                    raise SessionLost() from None
                log.warning("signal poll refused: %s", exc)
                await asyncio.sleep(backoff)
                continue
            except LeaderUnreachable:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_cap)
                continue
            for sig in batch.signals:
                if sig.seq <= self.signal_seq:
                    continue
                await self.apply(sig)
                self.signal_seq = sig.seq
            if batch.signals:
                self._beat_now.set()

    def _set_speed(self, payload: dict[str, Any]) -> None:
        """A SET_SPEED: its link fields, if it names any, and its slowdown, if it names one
        (a leader's slowdown-only set-speed leaves the link as it is)."""
        link = {k: v for k, v in payload.items() if k not in ("slowdown", "to")}
        slowdown = payload.get("slowdown")
        if slowdown is not None or "to" in payload:  # (checked whole first: all or nothing)
            req = structure(payload, SetSpeedRequest)
            slowdown = req.slowdown
            if req.to is not None:
                # Per pair: the links to that fellow's cells, not the fellow's own limits.
                limits = structure(link, LinkLimits)
                for pair in self.shaper.pairs_to(req.to):
                    pair.apply(limits)
                return
        if link or slowdown is None:
            self.links.set_speed(structure(link, LinkLimits))
        if slowdown is not None:
            self.pace.slowdown = slowdown

    async def apply(self, sig: Signal) -> None:
        log.info("signal %d %s %s", sig.seq, sig.kind, sig.job_id or "")
        if sig.kind == "SET_SPEED":
            try:
                self._set_speed(sig.payload)
            except SchemaError as exc:
                log.error("ignoring bad SET_SPEED payload: %s", exc)
        elif sig.kind == "START":
            await self._start_job(sig)
        elif sig.kind == "STOP":
            attempt = sig.payload.get("attempt")
            await self._stop_job(sig.job_id, attempt if isinstance(attempt, int) else None)
        elif sig.kind == "MEMBERS":
            self._told(sig)
        elif sig.kind == "RELEASE":
            await self._stop_job()
            self.status = FellowStatus.RELEASED
            self.request_stop("released by the leader")

    # jobs -------------------------------------------------------------------------------------
    async def _start_job(self, sig: Signal) -> None:
        start: StageStart | str
        try:
            start = parse_start(sig.payload)
            stage, replica, attempt = start.stage, start.replica, start.attempt
        except JobRefused as exc:
            # Refused by the job's task, which reports it; the fellow carries on.
            start = str(exc)
            stage, replica, attempt = (_raw_int(sig.payload, k)
                                       for k in ("stage", "replica", "attempt"))
        key = (sig.job_id or "", stage, replica)
        running = self.stages.get(key)
        if running is not None and not running[0].done():
            log.warning("START for %s stage %d replica %d while it runs; ignored", sig.job_id,
                        stage, replica)
            return
        progress = Progress(job_id=sig.job_id, stage=stage, replica=replica, attempt=attempt)
        self.status = FellowStatus.BUSY
        task = asyncio.create_task(self._run_job(start, progress, attempt),
                                   name=f"job-{sig.job_id}-stage-{stage}-{replica}")
        self.stages[key] = (task, progress)

    def _told(self, sig: Signal) -> None:
        """A replica joins the job a cell of this fellow runs: the membership to move to, for
        the stage thread to take at its group's next synchronisation."""
        try:
            told = structure(sig.payload, MembersSignal)
        except SchemaError as exc:
            log.error("ignoring bad MEMBERS payload: %s", exc)
            return
        running = self.stages.get((sig.job_id or "", told.stage, told.replica))
        if running is None or running[1].attempt != told.attempt:
            return  # (that cell ended, or is of another attempt)
        running[1].told.append((told.order, told.placement.group_of(told.stage, told.replica)))

    async def _report(self, job_id: str, upd: JobStatusUpdate | list[JobStatusUpdate]
                      ) -> None:
        """Report on a job (a list: several step reports at once). Reports wait out a leader
        restart (and the re-registration after it), so the leader's step records have no
        holes; they stay in order because callers await. A 409 (the job ended: cancelled,
        failed elsewhere) cancels the caller."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPORT_PATIENCE_S
        backoff = 0.2
        while True:
            if self._stop.is_set() and self._reports_dropped:
                self._keep_final(job_id, upd)
                return
            try:
                if isinstance(upd, list):
                    await self.client.job_statuses(job_id, self.session, upd)
                else:
                    await self.client.job_status(job_id, self.session, upd)
                return
            except ApiError as exc:
                if exc.status in (404, 405) and isinstance(upd, list):
                    # (a leader older than batches of reports: the reports one by one)
                    for one in upd:
                        await self._report(job_id, one)
                    return
                if exc.status == 409:
                    raise asyncio.CancelledError() from None
                # 401: registering again; 503: the leader could not store it (a full disk)
                # and changed nothing: the same report is taken once it can.
                again = exc.status in (401, 503)
                if not again or loop.time() > deadline or self._stop.is_set():
                    log.warning("status report refused: %s", exc)
                    if again:
                        self._keep_final(job_id, upd)
                    return
            except LeaderUnreachable as exc:
                if self._stop.is_set():
                    # Leaving: no leader restart is waited out (it learns of this fellow's
                    # cells from its absence), and once one report is lost the rest are
                    # dropped unsent: a stage may have queued thousands while it was gone.
                    log.warning("status report lost: %s; the fellow is stopping: its later "
                                "reports are dropped", exc)
                    self._reports_dropped = True
                    self._keep_final(job_id, upd)
                    return
                if loop.time() > deadline:
                    log.warning("status report lost: %s", exc)
                    self._keep_final(job_id, upd)
                    return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _keep_final(self, job_id: str, upd: JobStatusUpdate | list[JobStatusUpdate]) -> None:
        """A cell's last word the leader did not take: the heartbeats carry it from now on
        (a step's report may be lost; the end of a cell may not)."""
        if isinstance(upd, JobStatusUpdate) and upd.state != "RUNNING":
            self.unreported.append(UnreportedFinal(job_id=job_id, report=upd))

    async def _push_shard(self, job: str, stage: int, manifest: dict, weights: bytes | None,
                          optimizer: bytes | None) -> None:
        # As patient as a report: a stage's last shard is its export, and the stage says
        # COMPLETED only after it; a leader restarting meanwhile must not lose it.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REPORT_PATIENCE_S
        backoff = 0.2
        while True:
            try:
                await self.client.push_shard(job, stage, self.session, manifest, weights,
                                             optimizer)
                return
            except (LeaderUnreachable, ApiError) as exc:
                retry = isinstance(exc, LeaderUnreachable) or exc.status in (401, 503)
                if not retry or loop.time() > deadline or self._stop.is_set():
                    # The shard is on this fellow's disk either way.
                    log.warning("shard push for %s stage %d failed: %s", job, stage, exc)
                    return
            except ClientError as exc:
                log.warning("shard push for %s stage %d failed: %s", job, stage, exc)
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _regroup(self, job: str, rep: RegroupReport, wait_s: float) -> RegroupAnswer:
        assert self.fellow_id is not None
        return await self.client.regroup(job, self.session,
                                         attrs.evolve(rep, fellow_id=self.fellow_id), wait_s)

    async def _fetch_checkpoint(self, job: str, step: int,
                                stage: int) -> tuple[dict, bytes, bytes | None]:
        return await self.client.checkpoint(job, step, stage, self.session)

    async def _fetch_weights(self, job: str, step: int, stage: int) -> tuple[dict, bytes]:
        manifest, weights, _ = await self.client.checkpoint(job, step, stage, self.session,
                                                            weights_only=True)
        return manifest, weights

    async def _fetch_manifest(self, job: str, step: int, stage: int) -> dict:
        return await self.client.checkpoint_manifest(job, step, stage, self.session)

    async def _fetch_replica_state(self, job: str, step: int, stage: int,
                                   replica: int) -> tuple[dict, bytes] | None:
        return await self.client.replica_state(job, step, stage, replica, self.session)

    def _context(self, start: StageStart | str, progress: Progress) -> JobContext:
        """What this fellow lends a stage: its id, reporting, the listener of its slot, its
        link shaping and threads."""
        assert progress.job_id is not None and self.fellow_id is not None
        job_id = progress.job_id
        slot = start.mine.slot if isinstance(start, StageStart) else 0

        async def report(upd: JobStatusUpdate) -> None:
            await self._report(job_id, upd)

        async def report_steps(updates: list[JobStatusUpdate]) -> None:
            await self._report(job_id, updates)

        def moved(new: StageStart) -> None:
            # (a rebalancing move made this cell another: the task runs on under its key)
            entry = self.stages.pop((job_id, progress.stage or 0, progress.replica), None)
            progress.told.clear()  # (the job's TrainJob names the progress's new cell)
            if entry is not None:
                self.stages[(job_id, new.stage, new.replica)] = entry

        return JobContext(fellow_id=self.fellow_id, progress=progress, report=report,
                          report_steps=report_steps, moved=moved,
                          shaper=self.shaper,
                          listener=self.listeners[slot] if slot < len(self.listeners) else None,
                          threads=self.opts.threads, fellow_name=self.opts.name,
                          push_shard=self._push_shard, fetch_checkpoint=self._fetch_checkpoint,
                          fetch_weights=self._fetch_weights,
                          fetch_manifest=self._fetch_manifest,
                          fetch_replica_state=self._fetch_replica_state,
                          links=self.links, data_roots=self.opts.data_roots, pace=self.pace,
                          regroup=self._regroup)

    async def _run_job(self, start: StageStart | str, progress: Progress,
                       attempt: int) -> None:
        ctx = self._context(start, progress)
        job_id = progress.job_id

        def failed(message: str, blames: int | None = None) -> JobStatusUpdate:
            # (the cell it runs now: a move may have made it another)
            return JobStatusUpdate(fellow_id=ctx.fellow_id, state="FAILED", step=progress.step,
                                   message=message[:4000], attempt=attempt,
                                   stage=progress.stage,
                                   replica=progress.replica,
                                   blames_stage=blames)

        try:
            if isinstance(start, str):
                raise JobRefused(start)
            await run_job(start, ctx)
        except JobRefused as exc:
            await ctx.report(failed(str(exc)))
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            if _data_plane_fault(exc):
                # A neighbour closed, broke or went quiet, or sent a bad frame: the message
                # says it all, and a traceback of our own stack would only bury it.
                log.warning("job %s stage %s failed: %s: %s", job_id, progress.stage,
                            type(exc).__name__, exc)
            else:
                log.exception("job %s crashed", job_id)
            with contextlib.suppress(ClientError, asyncio.CancelledError):
                await ctx.report(failed(f"{type(exc).__name__}: {exc}",
                                        getattr(exc, "peer_stage", None)))
        finally:
            key = (job_id or "", progress.stage or 0, progress.replica)
            if self.stages.get(key, (None,))[0] is asyncio.current_task():
                del self.stages[key]
            if self.status is FellowStatus.BUSY and not self.stages:
                self.status = FellowStatus.READY
            self._beat_now.set()

    async def _stop_job(self, job_id: str | None = None, attempt: int | None = None,
                        grace_s: float | None = None) -> None:
        """Stop every running cell (of ``job_id`` only, when given; of that attempt of it only,
        when given: the leader stops an attempt it replaced, not the one it started since).
        With ``grace_s`` (the fellow is leaving), the cells get that long to wind down."""
        doomed = [(k, t) for k, (t, p) in self.stages.items()
                  if job_id is None or (k[0] == job_id and attempt in (None, p.attempt))]
        for _k, task in doomed:
            task.cancel()
        if grace_s is not None:
            await _cancel_within([t for _k, t in doomed], grace_s)
        for k, task in doomed:
            with contextlib.suppress(asyncio.CancelledError):
                if grace_s is None or task.done():
                    await task
            self.stages.pop(k, None)
        if not self.stages and self.status is FellowStatus.BUSY:
            self.status = FellowStatus.READY

    async def _say_goodbye(self) -> None:
        """One last heartbeat so the leader shows 'released'/'leaving' at once, not 'stale'."""
        if self.fellow_id is None or not self.session:
            return
        if self.status is not FellowStatus.RELEASED:
            self.status = FellowStatus.LEAVING
        with contextlib.suppress(ClientError, TimeoutError):
            await asyncio.wait_for(
                self.client.heartbeat(self.fellow_id, self.session, self.heartbeat_body()),
                GOODBYE_S)


async def _cancel_within(tasks: list[asyncio.Task[None]], grace_s: float) -> None:
    """Wait up to ``grace_s`` for cancelled tasks to end, cancelling them again after half of
    it and then every tenth: a stage's clean-up after a cancel waits for its thread and for its
    reporter (each up to the job's frame timeout, a minute by default), and each new cancel
    cuts the wait it is in. Whatever is left at the end is left (and logged)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    pending = {t for t in tasks if not t.done()}
    wait = grace_s / 2  # (first the cells' own wind-down; then a new cancel every so often)
    while pending and (left := deadline - loop.time()) > 0:
        _done, pending = await asyncio.wait(pending, timeout=min(left, wait))
        for task in pending:
            task.cancel()
        wait = grace_s / 10
    for task in pending:
        log.warning("%s did not stop within %gs of the fellow stopping; left behind",
                    task.get_name(), grace_s)
