"""The stage group's ring all-reduce alone, against gloo's (a benchmark, not a test).

Two processes, one thread each, all-reduce (the mean) of one float32 buffer the size of
``bench_dp.py``'s model's gradients (25.6 MB), over one loopback TCP connection: the
project's ``Ring`` (with its confirmation, as data parallel runs it each step) in each sync
codec asked for, and ``torch.distributed``'s gloo ``all_reduce`` (then the division). Per
all-reduce, the median over ``--reps``: wall time, and the CPU time of the whole process
(every thread: the ring's links send and receive on threads of their own). The CPU is what a
replica's training gives up on a machine whose cores are all busy (``bench_dp.py``'s (r)
against (d)).

Usage::

    .venv/bin/python bench/bench_ring.py                      # 25.6 MB, fp32, 10 reps
    .venv/bin/python bench/bench_ring.py --codecs none,int8 --mb 100
    .venv/bin/python bench/bench_ring.py --quick              # 1 MB, 3 reps

Only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a plain script from anywhere

HOST = "127.0.0.1"


def _ring(rank: int, sock: socket.socket, n: int, reps: int, compression: str,
          out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from swarm_core.config.schemas import SyncConfig
    from swarm_core.pipeline import codecs
    from swarm_core.pipeline.frames import Kind
    from swarm_core.pipeline.links import LinkShaper
    from swarm_core.pipeline.ring import Ring
    from swarm_core.pipeline.transport import PeerLink

    codec = codecs.WireCodec.of_sync(SyncConfig(compression=compression))
    link = PeerLink(sock, LinkShaper(), 0, "peer", max_payload=8 * n + (1 << 20),
                    receives={Kind.SYNC})
    ring = Ring([n], link, link, rank, 2, codec, torch.device("cpu"))
    grad = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    out.put((rank, _timed(reps, lambda step: (ring.reduce_(step, 60.0, [grad]),
                                              ring.confirm(step, 60.0)))))
    link.close()


def _gloo(rank: int, port: int, n: int, reps: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{port}", rank=rank,
                            world_size=2)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(rank))

    def once(_step: int) -> None:
        dist.all_reduce(grad)
        grad.div_(2)

    out.put((rank, _timed(reps, once)))
    dist.destroy_process_group()


def _timed(reps: int, once: Any) -> tuple[float, float]:
    """Median wall and process CPU seconds of ``once(step)``, after one untimed call."""
    once(0)
    walls, cpus = [], []
    for step in range(1, reps + 1):
        w0, c0 = time.perf_counter(), time.process_time()
        once(step)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _pair() -> tuple[socket.socket, socket.socket]:
    """Both ends of one loopback TCP connection."""
    with socket.socket() as srv:
        srv.bind((HOST, 0))
        srv.listen(1)
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    return a, b


def _both(ctx: Any, target: Any, args: list[tuple]) -> list[tuple[float, float]]:
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, out)) for a in args]
    for p in procs:
        p.start()
    res = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{target.__name__} worker exited with {p.exitcode}")
    return [res[r] for r in sorted(res)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--mb", type=float, default=None, help="buffer MB (default 25.6)")
    ap.add_argument("--reps", type=int, default=None, help="timed all-reduces (default 10)")
    ap.add_argument("--codecs", default="none",
                    help="the ring's sync codecs, comma-separated (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="1 MB, 3 reps (smoke)")
    args = ap.parse_args(argv)
    mb = args.mb if args.mb is not None else (1.0 if args.quick else 25.6)
    reps = args.reps if args.reps is not None else (3 if args.quick else 10)
    if mb <= 0 or reps < 1:
        print("bench_ring: --mb must be positive and --reps at least 1", file=sys.stderr)
        return 2
    n = int(mb * 1e6 / 4)
    # (fork: the connection's two ends go to the two processes as they are)
    ctx = mp.get_context("fork")
    print(f"bench_ring: all-reduce of {n * 4 / 1e6:.1f} MB fp32, 2 processes, 1 thread each, "
          f"median of {reps}", flush=True)
    rows: list[tuple[str, list[tuple[float, float]]]] = []
    for compression in args.codecs.split(","):
        a, b = _pair()
        rows.append((f"ring {compression}",
                     _both(ctx, _ring, [(0, a, n, reps, compression),
                                        (1, b, n, reps, compression)])))
        a.close()
        b.close()
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    rows.append(("gloo", _both(ctx, _gloo, [(0, port, n, reps), (1, port, n, reps)])))
    gloo_cpu = statistics.fmean(c for _w, c in rows[-1][1])
    print(f"\n{'row':<16} {'wall ms':>9} {'cpu ms':>8} {'cpu / gloo':>11}")
    print("-" * 47)
    for name, res in rows:
        wall = statistics.fmean(w for w, _c in res)
        cpu = statistics.fmean(c for _w, c in res)
        print(f"{name:<16} {wall * 1000:>9.1f} {cpu * 1000:>8.1f} {cpu / gloo_cpu:>10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
