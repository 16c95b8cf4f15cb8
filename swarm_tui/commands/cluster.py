"""``swarm restart-cluster`` and ``swarm stop-cluster``: a local cluster in the background."""

from __future__ import annotations

import argparse
from pathlib import Path

from swarm_core.local_cluster import ClusterSpec, start_cluster, stop_cluster
from swarm_tui.commands.argtypes import (
    data_root,
    device_slots,
    local_fellow_count,
    port,
    positive_float,
    thread_count,
)
from swarm_tui.commands.base import add_format, emit_json, print_line


def cmd_restart(args: argparse.Namespace) -> int:
    spec = ClusterSpec(
        fellows=args.fellows, port=args.port,
        state_dir=Path(args.state_dir).expanduser() if args.state_dir else None,
        stale_after_s=args.stale_after, devices=args.devices, threads=args.threads,
        timeout_s=args.timeout,
        data_roots=None if args.data_root is None else tuple(args.data_root),
    )
    record = start_cluster(spec)
    if args.format == "json":
        emit_json({"leader_url": record.leader_url, "state_dir": record.state_dir,
                   "leader_pid": record.leader.pid,
                   "fellows": [{"name": f.name, "pid": f.pid} for f in record.fellows]})
    else:
        print_line(record.leader_url)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    record = stop_cluster()
    if args.format == "json":
        emit_json({"stopped": record is not None,
                   "pids": [] if record is None else
                   [record.leader.pid, *(f.pid for f in record.fellows)]})
    elif record is None:
        print_line("no local cluster recorded")
    else:
        print_line(f"stopped leader {record.leader_url} and {len(record.fellows)} fellow(s)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "restart-cluster", help="(re)start a local leader and N fellows in the background",
        description="Stop the previous local cluster (by its recorded pids), start a leader and "
                    "N fellows, wait until all fellows are ready, print the leader URL.")
    p.add_argument("--fellows", type=local_fellow_count, default=2,
                   help="fellows to start (default 2, at most 64)")
    p.add_argument("--port", type=port, default=None, help="leader port (default: a free one)")
    p.add_argument("--state-dir", default=None,
                   help="leader state dir (default: under SWARM_HOME or the user data dir)")
    p.add_argument("--stale-after", type=positive_float, default=5.0,
                   help="heartbeat timeout in seconds (default 5)")
    p.add_argument("--devices", type=device_slots, default="cpu",
                   help="device slots of each fellow (default cpu)")
    p.add_argument("--threads", type=thread_count, default=1, help="threads per fellow")
    p.add_argument("--data-root", type=data_root, action="append", default=None, metavar="DIR",
                   help="a directory whose files the fellows' jobs may train on (repeatable; "
                        "default: the current directory)")
    p.add_argument("--timeout", type=positive_float, default=30.0,
                   help="seconds to wait for readiness (default 30)")
    add_format(p)
    p.set_defaults(func=cmd_restart)

    p = sub.add_parser("stop-cluster", help="stop the local cluster started by restart-cluster")
    add_format(p)
    p.set_defaults(func=cmd_stop)
