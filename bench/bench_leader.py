"""Heartbeat load benchmark of a real leader process (not a test).

For each fleet size N this starts a fresh leader subprocess on 127.0.0.1 (free port, temporary
state dir, ``SWARM_TOKEN`` in its environment), registers N simulated fellows from this one
asyncio process, lets each heartbeat at 1 Hz (start times spread evenly over the second) and
measures, over a fixed window after a warm-up:

* client-side heartbeat latency (request sent to response body read): p50, p99, max;
* heartbeats per second actually achieved;
* the leader's CPU (utime+stime from ``/proc/<pid>/stat``) as % of one core, and this
  process's own CPU, so a saturated client is visible (the machine may have only 2 cores);
* with ``--consoles K``, K WebSocket subscribers on ``/api/v1/events`` counting the events they
  receive against the events the leader published (``seq`` numbers), reporting gaps;
* with ``--history J``, a queue of J jobs held by the leader (half cancelled, half pending on a
  grid no fleet here fills) and one client listing ``GET /jobs`` once a second through the
  window, as a console refreshing its jobs table does: the listing's latency beside the
  heartbeats'.

Usage::

    .venv/bin/python bench/bench_leader.py                      # N = 100, 500, 1000
    .venv/bin/python bench/bench_leader.py --fellows 1000 --seconds 20 --consoles 4
    .venv/bin/python bench/bench_leader.py --quick              # smoke run, a few seconds
    .venv/bin/python bench/bench_leader.py --fellows 100 --history 20000   # 10k + 10k jobs

Only ever talks to 127.0.0.1. The leader gets SIGTERM at the end, also on Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

from swarm_core.protocol import API_PREFIX, SESSION_HEADER  # noqa: E402
from swarm_tui.app.app import JOB_WINDOW  # noqa: E402

HOST = "127.0.0.1"
TARGET_N = 1000
TARGET_P99_MS = 50.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
# A leader whose /events handler does not read its socket never answers a client's close frame
# (the first cut did not); a short close timeout keeps each disconnect from hanging for 10 s.
WS_TIMEOUT = aiohttp.ClientWSTimeout(ws_receive=None, ws_close=0.5)


# --- results ------------------------------------------------------------------------------------


@attrs.define
class ConsoleStats:
    hello_seq: int | None = None
    received: int = 0
    last_seq: int = 0
    gaps: int = 0  # events missing between consecutive received seqs
    out_of_order: int = 0
    last_rx: float = 0.0
    close_code: int | None = None
    expected: int = 0  # events the leader published between hello and the final probe
    seqs_seen: list[int] = attrs.field(factory=list)


@attrs.define
class RunResult:
    fellows: int
    registered: int
    register_s: float
    window_s: float
    sent: int
    ok: int
    errors: int
    error_kinds: dict[str, int]
    latencies_ms: list[float]
    leader_cpu_pct: float
    client_cpu_pct: float
    other_cpu_pct: float  # everything else on the host during the window, % of one core
    leader_rss_mb: float
    client_lag_p99_ms: float
    client_lag_max_ms: float
    consoles: list[ConsoleStats]
    published: int  # events the leader published while the consoles were subscribed
    job_steps: tuple[int, int] | None = None  # a real job's step at window start and end
    history: int = 0  # jobs the leader held
    listing_ms: list[float] = attrs.field(factory=list)  # GET /jobs, once a second
    history_s: float = 0.0  # to queue (and cancel) them

    @property
    def hb_per_s(self) -> float:
        return self.ok / self.window_s if self.window_s > 0 else 0.0

    def pct(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

    @property
    def max_ms(self) -> float:
        return max(self.latencies_ms, default=math.nan)

    @property
    def events_per_console(self) -> int | None:
        return min((c.received for c in self.consoles), default=None)

    @property
    def dropped(self) -> int | None:
        if not self.consoles:
            return None
        return max(max(0, c.expected - c.received) for c in self.consoles)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no data."""
    if not values:
        return math.nan
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))
    return s[k]


# --- the leader subprocess ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rindex(b")") + 2:].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def host_busy_s() -> float:
    """CPU seconds all cores spent busy (not idle, not iowait) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already in user/nice]
    return (sum(vals[:8]) - vals[3] - vals[4]) / CLK_TCK


def proc_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return math.nan


class Leader:
    """A leader subprocess in its own session (so Ctrl-C reaches only us; we SIGTERM it)."""

    def __init__(self, token: str, verbose: bool = False, profile: Path | None = None) -> None:
        self.token = token
        self.verbose = verbose
        self.profile = profile  # write a cProfile of the leader process here
        self.tmp = Path(tempfile.mkdtemp(prefix="swarm-bench-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.tmp / "leader.log"

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
        env.update(SWARM_TOKEN=self.token, SWARM_HOME=str(self.tmp / "home"),
                   PYTHONUNBUFFERED="1")
        self.port = free_port()
        prof = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        argv = [sys.executable, *prof, "-m", "swarm_tui.cli", "leader",
                "--state-dir", str(self.tmp / "state"), "--host", HOST, "--port", str(self.port)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    async def wait_healthy(self, timeout_s: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"leader exited with {self.proc.returncode}:\n"
                                       f"{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with http.get(f"{self.url}/healthz",
                                        timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                if loop.time() > deadline:
                    raise RuntimeError(f"leader not healthy after {timeout_s:g}s:\n"
                                       f"{self.log_tail()}")
                await asyncio.sleep(0.05)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no leader log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"leader {proc.pid} ignored SIGTERM for 10 s; killing it", file=sys.stderr)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=5)
        if self.verbose and self.log_path.exists():
            print(f"--- leader log ---\n{self.log_tail()}", file=sys.stderr)
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def leader_process(token: str, verbose: bool, profile: Path | None = None) -> Iterator[Leader]:
    leader = Leader(token, verbose, profile)
    try:
        leader.start()
        yield leader
    finally:
        leader.stop()


# --- the simulated fleet ------------------------------------------------------------------------


@attrs.define(eq=False)
class Fellow:
    index: int
    fellow_id: int = -1
    url: str = ""
    headers: dict[str, str] = attrs.field(factory=dict)
    control_tx: int = 0
    control_rx: int = 0
    beats: int = 0

    def body(self) -> bytes:
        # What an idle fellow sends (see FellowDaemon.heartbeat_body): every field present,
        # counters growing, link limits set.
        return orjson.dumps({
            "status": "ready", "current_job": None, "current_stage": None,
            "current_step": 0, "last_loss": None, "tokens_per_s": 0.0,
            "counters": {"control_tx": self.control_tx, "control_rx": self.control_rx,
                         "data_tx": 1_048_576 * self.beats, "data_rx": 524_288 * self.beats},
            "link": {"tx_mbps": 100.0, "rx_mbps": 100.0, "latency_ms": 20.0},
            "signal_seq": 0,
        })


class Recorder:
    """Latencies of heartbeats *sent* inside the measurement window."""

    def __init__(self) -> None:
        self.t_start = math.inf
        self.t_end = math.inf
        self.sent = 0
        self.ok = 0
        self.errors: dict[str, int] = {}
        self.latencies_ms: list[float] = []

    def in_window(self, t: float) -> bool:
        return self.t_start <= t < self.t_end

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def register_all(http: aiohttp.ClientSession, base: str, auth: dict[str, str],
                       n: int, run_tag: str, concurrency: int = 32) -> list[Fellow]:
    sem = asyncio.Semaphore(concurrency)
    url = f"{base}{API_PREFIX}/fellows/register"
    hdrs = {**auth, "Content-Type": "application/json"}

    async def one(i: int) -> Fellow:
        body = orjson.dumps({
            "name": f"bench-{run_tag}-{i:05d}", "instance_id": secrets.token_hex(8),
            "host": f"bench-host-{i % 64:02d}", "pid": 10_000 + i, "devices": ["cpu"],
            "threads": 1, "data_addr": f"10.0.{i // 250}.{i % 250}:7000", "version": "0.1.0",
        })
        async with sem, http.post(url, data=body, headers=hdrs) as resp:
            raw = await resp.read()
            if resp.status != 201:
                raise RuntimeError(f"register {i}: HTTP {resp.status}: {raw[:200]!r}")
        res = orjson.loads(raw)
        fid = res["fellow_id"]
        return Fellow(index=i, fellow_id=fid,
                      url=f"{base}{API_PREFIX}/fellows/{fid}/heartbeat",
                      headers={**hdrs, SESSION_HEADER: res["session"]},
                      control_tx=len(body) + 200, control_rx=len(raw) + 150)

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def heartbeat_loop(http: aiohttp.ClientSession, fellow: Fellow, first_at: float,
                         stop_at: float, rec: Recorder, timeout: aiohttp.ClientTimeout) -> None:
    """Fixed-rate 1 Hz heartbeats from ``first_at``, one in flight at a time; a beat that falls
    due while the previous reply is still outstanding (over 1 s) is skipped."""
    loop = asyncio.get_running_loop()
    perf = time.perf_counter
    k = 0
    while True:
        due = first_at + k
        if due >= stop_at:
            return
        now = loop.time()
        if due > now:
            await asyncio.sleep(due - now)
        k += 1
        fellow.beats += 1
        data = fellow.body()
        t0 = perf()
        counted = rec.in_window(loop.time())
        try:
            async with http.post(fellow.url, data=data, headers=fellow.headers,
                                 timeout=timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            if counted:
                rec.sent += 1
                rec.error("timeout")
            continue
        except (aiohttp.ClientError, OSError) as exc:
            if counted:
                rec.sent += 1
                rec.error(type(exc).__name__)
            continue
        dt = (perf() - t0) * 1000.0
        fellow.control_tx += len(data) + 200
        fellow.control_rx += len(raw) + 150
        if counted:
            rec.sent += 1
            if status == 200:
                rec.ok += 1
                rec.latencies_ms.append(dt)
            else:
                rec.error(f"HTTP {status}")
        # Beats missed while waiting for a slow reply are skipped (it shows in hb/s).
        behind = loop.time() - (first_at + k)
        if behind > 0:
            k += math.ceil(behind)


async def console(http: aiohttp.ClientSession, base: str, auth: dict[str, str],
                  stats: ConsoleStats, ready: asyncio.Event) -> None:
    loads = orjson.loads
    async with http.ws_connect(f"{base}{API_PREFIX}/events", headers=auth, heartbeat=20.0,
                               max_msg_size=0, timeout=WS_TIMEOUT) as ws:
        async for msg in ws:
            if msg.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                break
            ev = loads(msg.data)
            seq = ev["seq"]
            if stats.hello_seq is None:
                if ev.get("type") != "hello":
                    raise RuntimeError(f"event stream began with {ev.get('type')!r}, not hello")
                stats.hello_seq = stats.last_seq = seq
                ready.set()
                continue
            stats.received += 1
            stats.last_rx = time.monotonic()
            stats.seqs_seen.append(seq)
            if seq <= stats.last_seq:
                stats.out_of_order += 1
            else:
                stats.gaps += seq - stats.last_seq - 1
                stats.last_seq = seq
        stats.close_code = ws.close_code


async def current_seq(http: aiohttp.ClientSession, base: str, auth: dict[str, str]) -> int:
    """The leader's event counter, read from the hello frame of a fresh subscription."""
    async with http.ws_connect(f"{base}{API_PREFIX}/events", headers=auth,
                               timeout=WS_TIMEOUT) as ws:
        msg = await ws.receive(timeout=10)
        return int(orjson.loads(msg.data)["seq"])


async def loop_lag_monitor(samples: list[float], rec: Recorder, period: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(period)
        if rec.in_window(t):
            samples.append(max(0.0, (loop.time() - t - period) * 1000.0))


async def submit_unsatisfiable_job(http: aiohttp.ClientSession, base: str,
                                   auth: dict[str, str], n: int) -> None:
    """A PENDING job asking for more fellows than exist: every heartbeat then runs dispatch()."""
    body = orjson.dumps({"name": "bench-pending", "kind": "smoke",
                         "topology": {"fellows": n + 1}})
    async with http.post(f"{base}{API_PREFIX}/jobs", data=body,
                         headers={**auth, "Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        if resp.status != 201 or orjson.loads(raw)["state"] != "PENDING":
            raise RuntimeError(f"submit pending job: HTTP {resp.status}: {raw[:200]!r}")


async def queue_history(http: aiohttp.ClientSession, base: str, auth: dict[str, str],
                        jobs: int) -> None:
    """``jobs`` jobs on a grid no fleet here fills (1024 fellows), every other one cancelled:
    a leader's long history beside a long queue."""
    body = orjson.dumps({"name": "bench-history", "kind": "smoke",
                         "topology": {"fellows": 1024}})
    headers = {**auth, "Content-Type": "application/json"}

    async def one(i: int) -> None:
        async with http.post(f"{base}{API_PREFIX}/jobs", data=body, headers=headers) as resp:
            raw = await resp.read()
            if resp.status != 201:
                raise RuntimeError(f"queue job {i}: HTTP {resp.status}: {raw[:200]!r}")
            job_id = orjson.loads(raw)["job_id"]
        if i % 2 == 0:
            async with http.post(f"{base}{API_PREFIX}/jobs/{job_id}/cancel",
                                 headers=auth) as resp:
                await resp.read()

    for start in range(0, jobs, 64):
        await asyncio.gather(*(one(i) for i in range(start, min(jobs, start + 64))))


# What a console asks each second (swarm_tui's refresh): the running job, the next pending ones
# in line and the latest to finish; ``all`` is the whole list (``swarm jobs``, or the console
# before it held a window).
WINDOW_LISTING = [{"state": "RUNNING"}, {"state": "PENDING", "limit": str(JOB_WINDOW)},
                  {"order": "finished", "limit": str(JOB_WINDOW)}]


async def list_jobs_loop(http: aiohttp.ClientSession, base: str, auth: dict[str, str],
                         rec: Recorder, out: list[float], listing: str) -> None:
    """A console refreshing its jobs table once a second, in the window: one figure is the
    time of one refresh (its requests sent together, as the console does)."""
    loop = asyncio.get_running_loop()
    queries = WINDOW_LISTING if listing == "window" else [{}]

    async def one(params: dict[str, str]) -> None:
        async with http.get(f"{base}{API_PREFIX}/jobs", headers=auth, params=params,
                            timeout=aiohttp.ClientTimeout(total=60)) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET /jobs: HTTP {resp.status}")

    await asyncio.sleep(max(0.0, rec.t_start - loop.time()))
    while loop.time() < rec.t_end:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(q) for q in queries))
        out.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))


async def start_running_job(http: aiohttp.ClientSession, leader: Leader,
                            auth: dict[str, str], token: str) -> tuple[list[Any], str]:
    """Two real fellow processes training a tiny model beside the simulated fleet, so the
    leader also handles a live job: status reports, progress records, metric events."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}
    env.update(SWARM_TOKEN=token, SWARM_HOME=str(leader.tmp / "home"), PYTHONUNBUFFERED="1")
    procs = []
    for i in range(2):
        with open(leader.tmp / f"fellow-{i}.log", "ab") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "swarm_tui.cli", "fellow", "--leader-url", leader.url,
                 "--name", f"real-{i}"], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True))
    base = leader.url
    deadline = time.monotonic() + 60
    while True:
        async with http.get(f"{base}{API_PREFIX}/fellows", headers=auth) as resp:
            ready = [f for f in orjson.loads(await resp.read())["fellows"]
                     if f["status"] == "ready"]
        if len(ready) >= 2:
            break
        if time.monotonic() > deadline:
            raise RuntimeError("the real fellows did not become ready")
        await asyncio.sleep(0.2)
    body = orjson.dumps({
        "name": "bench-running", "kind": "train",
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        # 50 ms per frame on its links keeps the job stepping (status reports, progress
        # records, metric events) without taking a core from the leader on a small machine.
        "training": {"steps": 10_000_000, "batch_size": 4, "micro_batches": 2,
                     "eval_batches": 0, "link": {"latency_ms": 50}},
        "topology": {"fellows": 2}})
    async with http.post(f"{base}{API_PREFIX}/jobs", data=body,
                         headers={**auth, "Content-Type": "application/json"}) as resp:
        job_id = orjson.loads(await resp.read())["job_id"]
    while (await job_step(http, base, auth, job_id)) < 3:
        if time.monotonic() > deadline:
            raise RuntimeError("the running job did not start stepping")
        await asyncio.sleep(0.2)
    return procs, job_id


async def job_step(http: aiohttp.ClientSession, base: str, auth: dict[str, str],
                   job_id: str) -> int:
    async with http.get(f"{base}{API_PREFIX}/jobs/{job_id}", headers=auth) as resp:
        return int(orjson.loads(await resp.read())["last_step"])


async def run_one(leader: Leader, n: int, seconds: float, warmup: float, consoles: int,
                  token: str, pending_job: bool = False,
                  running_job: bool = False, history: int = 0,
                  listing_kind: str = "window") -> RunResult:
    await leader.wait_healthy()
    base = leader.url
    auth = {"Authorization": f"Bearer {token}"}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, force_close=False,
                                     keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector) as http:
        tasks: list[asyncio.Task[Any]] = []  # cancelled before the session closes
        try:
            # Consoles subscribe first, so they see registrations as well as heartbeats.
            stats = [ConsoleStats() for _ in range(consoles)]
            readies = [asyncio.Event() for _ in range(consoles)]
            console_tasks = [asyncio.create_task(console(http, base, auth, s, r))
                             for s, r in zip(stats, readies, strict=True)]
            tasks += console_tasks
            if console_tasks:
                await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 10)

            real: list[Any] = []
            job_id = None
            if running_job:
                real, job_id = await start_running_job(http, leader, auth, token)
            t_hist = time.perf_counter()
            if history:
                await queue_history(http, base, auth, history)
            history_s = time.perf_counter() - t_hist
            t_reg = time.perf_counter()
            fleet = await register_all(http, base, auth, n, secrets.token_hex(3))
            register_s = time.perf_counter() - t_reg
            if pending_job:
                await submit_unsatisfiable_job(http, base, auth, n)

            loop = asyncio.get_running_loop()
            rec = Recorder()
            lag: list[float] = []
            lag_task = asyncio.create_task(loop_lag_monitor(lag, rec))
            tasks.append(lag_task)
            t0 = loop.time() + 0.2
            rec.t_start = t0 + warmup
            rec.t_end = rec.t_start + seconds
            timeout = aiohttp.ClientTimeout(total=5.0)
            hb_tasks = [
                asyncio.create_task(
                    heartbeat_loop(http, f, t0 + f.index / n, rec.t_end, rec, timeout))
                for f in fleet
            ]
            tasks += hb_tasks
            listing: list[float] = []
            lister = asyncio.create_task(list_jobs_loop(http, base, auth, rec, listing,
                                                         listing_kind)) \
                if history else None
            if lister is not None:
                tasks.append(lister)

            await asyncio.sleep(max(0.0, rec.t_start - loop.time()))
            cpu_h0, cpu_l0, cpu_c0 = host_busy_s(), proc_cpu_s(leader.pid), time.process_time()
            step0 = await job_step(http, base, auth, job_id) if job_id else None
            w0 = time.perf_counter()
            await asyncio.sleep(max(0.0, rec.t_end - loop.time()))
            cpu_h1, cpu_l1, cpu_c1 = host_busy_s(), proc_cpu_s(leader.pid), time.process_time()
            step1 = await job_step(http, base, auth, job_id) if job_id else None
            w1 = time.perf_counter()
            rss = proc_rss_mb(leader.pid)

            # Let in-flight heartbeats finish (they count: they were sent inside the window).
            _done, pending = await asyncio.wait(hb_tasks, timeout=6.0)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            lag_task.cancel()
            await asyncio.gather(lag_task, return_exceptions=True)
            if lister is not None:
                await asyncio.wait_for(lister, 70)  # (its last listing counts)

            published = 0
            if console_tasks:
                # Wait until the consoles went quiet, then read the leader's counter.
                quiet_deadline = loop.time() + 5.0
                while loop.time() < quiet_deadline:
                    now = time.monotonic()
                    if all(now - s.last_rx > 0.3 or s.close_code is not None for s in stats):
                        break
                    await asyncio.sleep(0.1)
                final_seq = await current_seq(http, base, auth)
                await asyncio.sleep(0.2)
                for t in console_tasks:
                    t.cancel()
                await asyncio.gather(*console_tasks, return_exceptions=True)
                for s in stats:
                    # Count only what was published between this console's hello and final_seq.
                    s.received = sum(1 for q in s.seqs_seen if q <= final_seq)
                    s.expected = max(0, final_seq - (s.hello_seq or 0))
                    s.seqs_seen = []
                published = max((s.expected for s in stats), default=0)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for p in real:
                p.send_signal(signal.SIGTERM)
            for p in real:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()

    wall = w1 - w0
    return RunResult(
        fellows=n, registered=len(fleet), register_s=register_s, window_s=seconds,
        sent=rec.sent, ok=rec.ok, errors=sum(rec.errors.values()), error_kinds=rec.errors,
        latencies_ms=rec.latencies_ms,
        leader_cpu_pct=100.0 * (cpu_l1 - cpu_l0) / wall,
        client_cpu_pct=100.0 * (cpu_c1 - cpu_c0) / wall,
        other_cpu_pct=max(0.0, 100.0 * ((cpu_h1 - cpu_h0) - (cpu_l1 - cpu_l0)
                                        - (cpu_c1 - cpu_c0)) / wall),
        leader_rss_mb=rss,
        client_lag_p99_ms=percentile(lag, 99), client_lag_max_ms=max(lag, default=math.nan),
        consoles=stats, published=published,
        job_steps=None if step0 is None or step1 is None else (step0, step1),
        history=history, listing_ms=listing, history_s=history_s,
    )


# --- reporting ----------------------------------------------------------------------------------


def fmt(v: float | int | None, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def print_table(results: list[RunResult], consoles: int) -> None:
    listed = any(r.history for r in results)
    head = ["N", "hb/s", "p50 ms", "p99 ms", "max ms", "leader CPU%", "client CPU%",
            "events/console", "dropped", "errors"] + ["jobs", "GET /jobs p99 ms"] * listed
    rows = [[
        str(r.fellows), fmt(r.hb_per_s), fmt(r.pct(50), ".2f"), fmt(r.pct(99), ".2f"),
        fmt(r.max_ms, ".2f"), fmt(r.leader_cpu_pct), fmt(r.client_cpu_pct),
        (f"{r.events_per_console}/{r.published}" if consoles else "-"),
        fmt(r.dropped, "d"), str(r.errors),
    ] + [str(r.history), fmt(percentile(r.listing_ms, 99), ".0f")] * listed
        for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def print_details(results: list[RunResult]) -> None:
    for r in results:
        cons = ", ".join(
            f"c{i}: {c.received}/{c.expected} rx, {c.gaps} gap(s)"
            + (f", {c.out_of_order} out of order" if c.out_of_order else "")
            + (f", closed {c.close_code}" if c.close_code not in (None, 1000) else "")
            for i, c in enumerate(r.consoles)) or "no consoles"
        errs = ", ".join(f"{k}: {v}" for k, v in sorted(r.error_kinds.items())) or "none"
        print(f"N={r.fellows}: registered {r.registered} in {r.register_s:.2f}s; "
              f"{r.sent} sent / {r.ok} ok in {r.window_s:g}s; errors {errs}; "
              f"leader RSS {fmt(r.leader_rss_mb, '.0f')} MB; other processes "
              f"{r.other_cpu_pct:.0f}% CPU; client loop lag "
              f"p99 {fmt(r.client_lag_p99_ms, '.1f')} ms, max {fmt(r.client_lag_max_ms, '.1f')} "
              f"ms; {cons}"
              + (f"; running job: steps {r.job_steps[0]} -> {r.job_steps[1]} in the window"
                 if r.job_steps else "")
              + (f"; {r.history} jobs held (queued in {r.history_s:.1f}s), GET /jobs x"
                 f"{len(r.listing_ms)}: p50 {fmt(percentile(r.listing_ms, 50), '.0f')} ms, "
                 f"max {fmt(max(r.listing_ms, default=math.nan), '.0f')} ms"
                 if r.history else ""))


def target_line(results: list[RunResult]) -> tuple[str, bool | None]:
    r = next((r for r in results if r.fellows == TARGET_N), None)
    if r is None:
        return (f"target: p99 < {TARGET_P99_MS:g} ms at {TARGET_N} fellows: not measured "
                f"(N={TARGET_N} not in --fellows)", None)
    p99 = r.pct(99)
    met = (not math.isnan(p99)) and p99 < TARGET_P99_MS and r.errors == 0
    why = "" if r.errors == 0 else f", {r.errors} failed heartbeat(s)"
    return (f"target: p99 < {TARGET_P99_MS:g} ms at {TARGET_N} fellows: "
            f"{'MET' if met else 'MISSED'} (p99 = {fmt(p99, '.2f')} ms{why})", met)


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fellows", default="100,500,1000",
                   help="comma-separated fleet sizes, one fresh leader each (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="measurement window per fleet size (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="heartbeating before the window opens (default: %(default)s)")
    p.add_argument("--consoles", type=int, default=2,
                   help="WebSocket event subscribers kept open (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 20 fellows, 3 s window, 1 s warm-up, 1 console")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--pending-job", action="store_true",
                   help="keep one job PENDING that needs N+1 fellows (N < 1024), so every "
                        "heartbeat runs the dispatcher against the whole registry")
    p.add_argument("--history", type=int, default=0, metavar="J",
                   help="the leader holds J jobs (half cancelled, half pending), and a client "
                        "lists them once a second in the window, as --listing says")
    p.add_argument("--listing", choices=("window", "all"), default="window",
                   help=f"with --history: what the client lists, a console's window (the "
                        f"running job, the next and the latest {JOB_WINDOW}) or every job "
                        "(default: %(default)s)")
    p.add_argument("--running-job", action="store_true",
                   help="also run a real 2-fellow training job beside the simulated fleet")
    p.add_argument("--profile", metavar="DIR",
                   help="run each leader under cProfile; writes DIR/leader-N.prof "
                        "(inflates the leader's CPU and latency)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each leader's log tail")
    args = p.parse_args(argv)
    if args.quick:
        args.fellows, args.seconds, args.warmup, args.consoles = "20", 3.0, 1.0, 1
    try:
        args.sizes = [int(x) for x in args.fellows.split(",") if x.strip()]
    except ValueError:
        p.error(f"--fellows: expected numbers like 100,500,1000, got {args.fellows!r}")
    if not args.sizes or min(args.sizes) < 1:
        p.error("--fellows: sizes must be >= 1")
    if args.pending_job and max(args.sizes) >= 1024:
        p.error("--pending-job needs every fleet size below 1024 (a job asks for <= 1024)")
    if args.seconds <= 0 or args.warmup < 0 or args.consoles < 0 or args.history < 0:
        p.error("--seconds must be > 0, --warmup, --consoles and --history >= 0")
    if args.history and max(args.sizes) >= 1024:
        p.error("--history: its pending jobs need 1024 fellows, so N must be below 1024")
    return args


def result_json(r: RunResult) -> dict[str, Any]:
    return {
        "fellows": r.fellows, "hb_per_s": r.hb_per_s, "p50_ms": r.pct(50), "p99_ms": r.pct(99),
        "max_ms": r.max_ms, "leader_cpu_pct": r.leader_cpu_pct,
        "client_cpu_pct": r.client_cpu_pct, "other_cpu_pct": r.other_cpu_pct,
        "leader_rss_mb": r.leader_rss_mb,
        "sent": r.sent, "ok": r.ok, "errors": r.error_kinds, "window_s": r.window_s,
        "register_s": r.register_s, "client_lag_p99_ms": r.client_lag_p99_ms,
        "client_lag_max_ms": r.client_lag_max_ms, "events_published": r.published,
        "events_per_console": r.events_per_console, "dropped_events": r.dropped,
        "consoles": [{"received": c.received, "expected": c.expected, "gaps": c.gaps,
                      "out_of_order": c.out_of_order,
                      "close_code": c.close_code} for c in r.consoles],
        "history": r.history, "history_s": r.history_s, "listing_ms": r.listing_ms,
    }


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (and SIGINT even where a shell ignored it for us) stop the run the way Ctrl-C
    # does: the leader gets its SIGTERM and the temp dir goes.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    token = secrets.token_urlsafe(24)
    results: list[RunResult] = []
    print(f"leader heartbeat benchmark: fellows {args.sizes}, window {args.seconds:g}s after "
          f"{args.warmup:g}s warm-up, {args.consoles} console(s)"
          f"{', one unsatisfiable PENDING job' if args.pending_job else ''}"
          f"{f', {args.history} jobs held and listed each second' if args.history else ''}, "
          f"{os.cpu_count()} CPU(s), "
          f"Python {sys.version.split()[0]}, aiohttp {aiohttp.__version__}", flush=True)
    try:
        for n in args.sizes:
            print(f"  N={n} ...", end="", flush=True)
            prof = None
            if args.profile:
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                prof = Path(args.profile).resolve() / f"leader-{n}.prof"
            with leader_process(token, args.verbose, prof) as leader:
                r = asyncio.run(run_one(leader, n, args.seconds, args.warmup, args.consoles,
                                        token, args.pending_job, args.running_job,
                                        args.history, args.listing))
            results.append(r)
            print(f" {r.hb_per_s:.0f} hb/s, p99 {fmt(r.pct(99), '.2f')} ms", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted; leader stopped", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the report
        if not results:
            return 130
    print()
    print_table(results, args.consoles)
    print()
    print_details(results)
    line, _met = target_line(results)
    print()
    print(line)
    cores = os.cpu_count() or 1
    for r in results:
        if r.other_cpu_pct > 20.0:
            print(f"warning: N={r.fellows}: other processes used {r.other_cpu_pct:.0f}% of a core "
                  f"({cores} core(s) in all) during the window; the numbers are noisy")
        if r.client_lag_p99_ms > 20.0:
            print(f"warning: N={r.fellows}: this client's event loop lagged (p99 "
                  f"{r.client_lag_p99_ms:.0f} ms); latencies include client-side delay")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps([result_json(r) for r in results],
                                                 option=orjson.OPT_INDENT_2))
    # Exit 1 only when the benchmark itself failed (nothing got through), not on a missed target.
    return 0 if results and all(r.ok > 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
