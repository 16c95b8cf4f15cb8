"""How long the console takes to apply updates to a large fellow table (not a test).

Runs the real ``SwarmApp`` headless (Textual's test driver, 160x48) against an in-process client
that serves N fixed fellows, so no leader and no network are involved; then, for each N, times:

* ``event``: one ``fellow.heartbeat`` event (new step, loss, tokens/s, counters) applied to the
  model and written into the table (``update_cell`` on the cells that changed);
* ``event+frame``: an event for a fellow whose row is on screen, plus the next frame as
  Textual's screen update paints it;
* ``stock update_cell+frame``: for comparison, the same with ``DataTable.update_cell``, which
  invalidates every cached cell render (what ``LiveTable`` avoids);
* ``event, sorted by tok/s``: an event that moves the row, so the table re-sorts N rows;
* ``event, regex filter``: an event while ``/`` filters the table;
* ``tick (all ages)``: the once-a-second redraw of every row (heartbeat ages move on);
* ``snapshot``: a full ``fellows()`` snapshot applied (every few seconds).

The target is under 50 ms per update at N = 500.

Usage::

    .venv/bin/python bench/bench_tui.py              # N = 100, 500, 1000; 300 updates each
    .venv/bin/python bench/bench_tui.py --quick      # N = 500, 60 updates (a few seconds)
    .venv/bin/python bench/bench_tui.py --fellows 2000 --updates 500
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

from swarm_core.client import SwarmClient  # noqa: E402
from swarm_core.contract import JobInfo, JobList  # noqa: E402
from swarm_core.protocol import ByteCounters, FellowInfo, LinkLimits  # noqa: E402
from swarm_tui.app.app import SwarmApp  # noqa: E402
from swarm_tui.app.model import Change  # noqa: E402
from swarm_tui.app.widgets.live_table import LiveTable  # noqa: E402

TARGET_MS = 50.0
T0 = 1_700_000_000.0
SIZE = (160, 48)


def fellow(i: int) -> FellowInfo:
    busy = i % 4 != 3
    return FellowInfo(
        fellow_id=i, name=f"node{i // 8:03d}-gpu{i % 8}", host=f"node{i // 8:03d}", pid=1000 + i,
        devices=[f"cuda:{i % 8}"], threads=4, data_addr=None,
        status="busy" if busy else "ready", reported_status="busy" if busy else "ready",
        current_job="job-000001" if busy else None, current_stage=i % 16 if busy else None,
        current_step=100 if busy else 0, last_loss=3.0 if busy else None,
        tokens_per_s=1500.0 + i if busy else 0.0,
        counters=ByteCounters(0, 0, 1_000_000 * i, 900_000 * i),
        link=LinkLimits(tx_mbps=80.0 if i % 2 else None, rx_mbps=80.0 if i % 2 else None),
        registered_at=T0 - 3600, last_heartbeat=T0 - 1, heartbeat_age_s=1.0)


class BenchClient(SwarmClient):
    """Serves N fellows; no network."""

    def __init__(self, n: int) -> None:
        super().__init__("http://bench.invalid", None)
        self.infos = [fellow(i) for i in range(n)]

    async def fellows(self) -> list[FellowInfo]:
        return list(self.infos)

    async def jobs(self, state: str | None = None) -> list[JobInfo]:
        return []

    async def job_page(self, state: str | None = None, *, limit: int, after: str | None = None,
                       order: str = "queue") -> JobList:
        return JobList(jobs=[], total=0)

    async def events(self, **_: Any) -> AsyncIterator[dict[str, Any]]:  # type: ignore[override]
        if False:  # pragma: no cover - the bench feeds events itself
            yield {}


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def heartbeat(seq: int, fid: int, step: int, ts: float) -> dict[str, Any]:
    return {"seq": seq, "ts": ts, "type": "fellow.heartbeat", "data": {
        "fellow_id": fid, "name": f"node{fid // 8:03d}-gpu{fid % 8}", "status": "busy",
        "job_id": "job-000001", "step": step, "loss": 3.0 - step * 1e-3,
        "tokens_per_s": 1500.0 + (step * 37 + fid * 11) % 900,
        "link": {"tx_mbps": 80.0, "rx_mbps": 80.0, "latency_ms": 0.0},
        "counters": {"control_tx": step, "control_rx": step,
                     "data_tx": 1_000_000 * (fid + step), "data_rx": 900_000 * (fid + step)}}}


def stats(samples: list[float]) -> tuple[float, float, float]:
    ms = sorted(s * 1000 for s in samples)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return statistics.median(ms), p99, ms[-1]


async def bench(n: int, updates: int) -> list[tuple[str, list[float]]]:
    clock = Clock()
    # flush_s=0: each update reaches the table at once, so it can be timed on its own (the
    # console batches them every 0.25 s, which bounds the frames painted to four a second).
    app = SwarmApp(BenchClient(n), clock=clock, refresh_s=None, tick_s=None, stream=False,
                   flush_s=0)
    results: list[tuple[str, list[float]]] = []
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one(LiveTable)
        deadline = time.monotonic() + 60
        while table.row_count < n:
            assert time.monotonic() < deadline, "the table never filled"
            await pilot.pause(0.05)
        await pilot.pause()
        seq = [0]

        def one_event(on_screen: bool = False) -> None:
            seq[0] += 1
            clock.now += 0.002
            # Any fellow, or one whose row is on screen (then the next frame has work to do).
            fid = seq[0] % 40 if on_screen else (seq[0] * 7919) % n
            app.apply_event(heartbeat(seq[0], fid, 100 + seq[0], clock.now))

        def paint() -> None:
            # The next frame, as Textual paints it: the table's Update message puts it among
            # the screen's dirty widgets, then the update timer composes the dirty regions.
            screen = app.screen
            table._repaint_required = False
            screen._dirty_widgets.add(table)
            screen._on_timer_update()

        def stock_update() -> None:
            # What DataTable.update_cell costs instead: it invalidates every cached cell, so
            # the next frame re-renders the whole visible table.
            key = table.shown_keys[seq[0] % 40]
            seq[0] += 1
            table.update_cell(key, "step", table.get_cell(key, "step"))
            paint()

        async def timed(name: str, body: Callable[[], None], count: int) -> None:
            samples = []
            for _ in range(count):
                t = time.perf_counter()
                body()
                samples.append(time.perf_counter() - t)
                if len(samples) % 20 == 0:
                    await pilot.pause()  # let Textual process what piled up
            results.append((name, samples))
            await pilot.pause()

        await timed("event", one_event, updates)

        def event_and_paint() -> None:
            one_event(on_screen=True)
            paint()

        await timed("event+frame", event_and_paint, max(20, updates // 3))
        await timed("stock update_cell+frame", stock_update, max(10, updates // 10))
        screen = app.screen
        screen.sort_by("tps")  # type: ignore[attr-defined]
        await timed("event, sorted by tok/s", one_event, updates)
        screen.sort_by("id")  # type: ignore[attr-defined]
        table.set_filter(r"gpu[0-3]$", [str(i) for i in range(n)])
        await timed("event, regex filter", one_event, updates)
        table.set_filter("", [str(i) for i in range(n)])

        def tick() -> None:
            clock.now += 1.0
            app.publish(Change(ages=True))

        await timed("tick (all ages)", tick, max(5, updates // 30))

        def snapshot() -> None:
            app.publish(app.model.apply_fellows(app.client.infos))  # type: ignore[attr-defined]

        await timed("snapshot", snapshot, max(5, updates // 30))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fellows", type=int, nargs="*", default=None,
                        help="table sizes (default: 100 500 1000; --quick: 500)")
    parser.add_argument("--updates", type=int, default=None,
                        help="timed updates per case (default 300; --quick: 60)")
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    args = parser.parse_args()
    sizes = args.fellows or ([500] if args.quick else [100, 500, 1000])
    updates = args.updates or (60 if args.quick else 300)
    rows = []
    worst_at_500 = 0.0
    for n in sizes:
        t = time.perf_counter()
        for name, samples in asyncio.run(bench(n, updates)):
            p50, p99, worst = stats(samples)
            rows.append((n, name, len(samples), p50, p99, worst))
            if n == 500 and name.startswith("event"):  # the console's own update paths
                worst_at_500 = max(worst_at_500, p99)
        print(f"# N={n}: {time.perf_counter() - t:.1f}s", file=sys.stderr)
    print(f"{'fellows':>7}  {'case':<24} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for n, name, count, p50, p99, worst in rows:
        print(f"{n:>7}  {name:<24} {count:>5} {p50:>8.2f} {p99:>8.2f} {worst:>8.2f}")
    if 500 in sizes:
        verdict = "ok" if worst_at_500 < TARGET_MS else "OVER TARGET"
        print(f"\none update to a 500-fellow table (worst p99 of the event cases): "
              f"{worst_at_500:.2f} ms (target < {TARGET_MS:.0f} ms): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
