"""``swarm fellows``, ``nodes``, ``release``, ``set-speed``."""

from __future__ import annotations

import argparse

from swarm_core.client import SwarmClient
from swarm_core.protocol import SetSpeedRequest
from swarm_tui.commands.argtypes import fellow_id, latency_ms, link_mbps
from swarm_tui.commands.base import (
    CommandError,
    ExitCode,
    add_format,
    emit_json,
    emit_table,
    print_line,
    run_with_client,
)
from swarm_tui.fmt import describe_link, fmt_bytes, fmt_limit, fmt_loss


def cmd_fellows(args: argparse.Namespace) -> int:
    async def body(c: SwarmClient) -> None:
        fellows = await c.fellows()
        if args.format == "json":
            emit_json({"fellows": fellows})
            return
        emit_table("fellows", ["id", "name", "status", "devices", "job", "step", "loss",
                               "tx Mbit/s", "rx Mbit/s", "data tx", "data rx", "hb age",
                               "note"], [
            [f.fellow_id, f.name, f.status, ",".join(f.devices), f.current_job,
             f.current_step, fmt_loss(f.last_loss), fmt_limit(f.link.tx_mbps),
             fmt_limit(f.link.rx_mbps), fmt_bytes(f.counters.data_tx),
             fmt_bytes(f.counters.data_rx),
             "-" if f.heartbeat_age_s is None else f"{f.heartbeat_age_s:.1f}s", f.note or "-"]
            for f in fellows
        ])

    return run_with_client(args, body)


def cmd_nodes(args: argparse.Namespace) -> int:
    async def body(c: SwarmClient) -> None:
        nodes = (await c.nodes()).nodes
        if args.format == "json":
            emit_json({"nodes": nodes})
            return
        emit_table("nodes (bytes each fellow reported)",
                   ["id", "name", "host", "status", "control tx", "control rx", "data tx",
                    "data rx"],
                   [[n.fellow_id, n.name, n.host, n.status, fmt_bytes(n.control_tx),
                     fmt_bytes(n.control_rx), fmt_bytes(n.data_tx), fmt_bytes(n.data_rx)]
                    for n in nodes])

    return run_with_client(args, body)


def cmd_release(args: argparse.Namespace) -> int:
    if not args.all and not args.fellow_id:
        raise CommandError("release needs --all or --fellow-id N", ExitCode.USAGE)

    async def body(c: SwarmClient) -> None:
        released = await c.release(args.fellow_id or [], all=args.all)
        if args.format == "json":
            emit_json({"released": released})
        elif released:
            print_line("released fellow(s) " + ", ".join(map(str, released)))
        else:
            print_line("no fellows to release")

    return run_with_client(args, body)


def cmd_set_speed(args: argparse.Namespace) -> int:
    req = SetSpeedRequest(tx_mbps=args.tx_mbps, rx_mbps=args.rx_mbps,
                          latency_ms=args.latency_ms)

    async def body(c: SwarmClient) -> None:
        res = await c.set_speed(args.fellow_id, req)
        if args.format == "json":
            emit_json(res)
        else:
            during = f"; recorded in running job {res['job_id']}" if res.get("job_id") else ""
            print_line(f"fellow {args.fellow_id}: "
                       f"{describe_link(req.tx_mbps, req.rx_mbps, req.latency_ms)} "
                       f"(signal {res['signal_seq']}{during})")

    return run_with_client(args, body)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fellows", help="list fellows with live status")
    add_format(p)
    p.set_defaults(func=cmd_fellows)

    p = sub.add_parser("nodes", help="per-fellow control- and data-plane byte counters")
    add_format(p)
    p.set_defaults(func=cmd_nodes)

    p = sub.add_parser("release", help="release fellows: they stop work and leave the cluster")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--all", action="store_true", help="release every fellow")
    g.add_argument("--fellow-id", type=fellow_id, action="append",
                   help="release this fellow (repeatable)")
    add_format(p)
    p.set_defaults(func=cmd_release)

    p = sub.add_parser("set-speed", help="shape a fellow's data-plane link, live")
    p.add_argument("--fellow-id", type=fellow_id, required=True, help="which fellow")
    p.add_argument("--tx-mbps", type=link_mbps, default=None,
                   help="send limit in Mbit/s (omit: unlimited)")
    p.add_argument("--rx-mbps", type=link_mbps, default=None,
                   help="receive limit in Mbit/s (omit: unlimited)")
    p.add_argument("--latency-ms", type=latency_ms, default=0.0,
                   help="added one-way latency in ms (default 0)")
    add_format(p)
    p.set_defaults(func=cmd_set_speed)
