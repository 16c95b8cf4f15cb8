"""``swarm quickstart``: the README's main job on the embedded default.

Starts a local leader and fellows, queues the default job, streams it to the end and stops the
cluster (unless ``--keep``). Until the training engine lands the default job is a smoke job.
"""

from __future__ import annotations

import argparse

from swarm_core.client import SwarmClient
from swarm_core.protocol import JobState
from swarm_tui.commands.base import ExitCode, print_line, run_async
from swarm_tui.commands.daemons import _positive_int
from swarm_tui.commands.jobs import smoke_job, watch_job
from swarm_tui.commands.local_cluster import ClusterSpec, start_cluster, stop_cluster, token_for


def cmd_quickstart(args: argparse.Namespace) -> int:
    print_line(f"starting a local leader and {args.fellows} fellow(s)…")
    record = start_cluster(ClusterSpec(fellows=args.fellows))
    print_line(f"leader {record.leader_url}; fellows "
               + ", ".join(f.name for f in record.fellows) + " ready")

    async def body() -> int:
        async with SwarmClient(record.leader_url, token_for(record)) as c:
            job = await c.submit(smoke_job(args.fellows, args.steps, "quickstart-smoke"))
            print_line(f"queued {job.job_id}")
            final = await watch_job(c, job.job_id)
            return 0 if final.state == JobState.COMPLETED.value else int(ExitCode.FAILURE)

    try:
        code = run_async(body())
    finally:
        if not args.keep:
            stop_cluster()
            print_line("local cluster stopped")
        else:
            print_line(f"cluster kept at {record.leader_url} ('swarm stop-cluster' stops it)")
    return code


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart",
                       help="start a local cluster, run the default job, show it finish")
    p.add_argument("--fellows", type=_positive_int, default=2, help="fellows (default 2)")
    p.add_argument("--steps", type=_positive_int, default=10, help="job steps (default 10)")
    p.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")
    p.set_defaults(func=cmd_quickstart)
