"""``swarm fellows``, ``fellow-log``, ``nodes``, ``release``, ``forget``, ``set-speed``."""

from __future__ import annotations

import argparse
import asyncio
import time

from swarm_core.client import ApiError, SwarmClient
from swarm_core.contract import MAX_LOG_LINES, FellowLog
from swarm_core.protocol import SLOWDOWN_MAX, FellowStatus, LinkLimits, SetSpeedRequest
from swarm_tui.commands.argtypes import (
    cell_index,
    fellow_id,
    latency_ms,
    link_mbps,
    number,
    slowdown,
)
from swarm_tui.commands.base import (
    CommandError,
    ExitCode,
    add_format,
    emit_json,
    emit_table,
    print_line,
    run_with_client,
)
from swarm_tui.fmt import describe_speed, fmt_bytes, fmt_limit, fmt_loss


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


# A tail this young is current (a fellow sends each second while asked); an older one was
# kept from an earlier read, so wait up to LOG_WAIT_S for the fresh one the read asked for.
LOG_FRESH_S = 2.5
LOG_WAIT_S = 4.0


def cmd_fellow_log(args: argparse.Namespace) -> int:
    async def body(c: SwarmClient) -> None:
        fid = await _fellow_by_id_or_name(c, args.fellow)
        got = await c.fellow_log(fid, args.lines)
        deadline = time.monotonic() + LOG_WAIT_S
        while got.asked and not _fresh(got) and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            got = await c.fellow_log(fid, args.lines)
        if args.format == "json":
            emit_json(got)
            return
        if got.received_at is None:
            print_line(got.message or f"fellow {fid} has sent no log yet")
            return
        print_line(f"fellow {got.fellow_id} ({got.name}): the last {len(got.lines)} line(s) of "
                   f"its own log, as of {got.age_s:.1f}s ago"
                   + (f"; {got.message}" if got.message else ""))
        for line in got.lines:
            print_line(line)

    return run_with_client(args, body)


def _fresh(got: FellowLog) -> bool:
    return got.age_s is not None and got.age_s <= LOG_FRESH_S


async def _fellow_by_id_or_name(c: SwarmClient, which: str) -> int:
    if which.isdigit():
        return int(which)
    found = [f.fellow_id for f in await c.fellows() if f.name == which]
    if not found:
        raise CommandError(f"no fellow named {which[:64]!r} (give its id or name; "
                           "see 'swarm fellows')")
    return found[0]


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


def cmd_forget(args: argparse.Namespace) -> int:
    """Drop the leader's records of fellows that are gone: those named (a live one, or one
    holding a running job's cell, is refused: exit 1 naming why), or ``--gone`` every one
    that may be (the others are left as they are)."""
    if not args.gone and not args.fellow_id:
        raise CommandError("forget needs --gone or --fellow-id N", ExitCode.USAGE)

    async def body(c: SwarmClient) -> None:
        if args.gone:
            ids = [f.fellow_id for f in await c.fellows()
                   if not FellowStatus(f.status).live]
        else:
            ids = list(dict.fromkeys(args.fellow_id))
        forgotten: list[int] = []
        kept: list[str] = []
        for fid in ids:
            try:
                await c.forget(fid)
            except ApiError as exc:
                if not args.gone:
                    raise CommandError(f"fellow {fid} not forgotten: {exc.message}") from None
                kept.append(f"{fid} ({exc.message})")
            else:
                forgotten.append(fid)
        if args.format == "json":
            emit_json({"forgotten": forgotten, "kept": kept})
            return
        print_line("forgot fellow(s) " + ", ".join(map(str, forgotten)) if forgotten
                   else "no fellows to forget")
        for why in kept:
            print_line(f"kept fellow {why}")

    return run_with_client(args, body)


def cmd_set_speed(args: argparse.Namespace) -> int:
    by_cell = args.stage is not None or args.replica is not None
    if (args.fellow_id is None) == (not by_cell):
        raise CommandError("set-speed needs --fellow-id N, or --stage K and/or --replica J",
                           ExitCode.USAGE)
    # --slowdown alone leaves the link as it is; any link flag sets the whole link, as ever.
    link = args.slowdown is None or any(
        v is not None for v in (args.tx_mbps, args.rx_mbps, args.latency_ms))
    if args.to is not None and args.slowdown is not None:
        raise CommandError("--slowdown is a fellow's own, not a pair's: leave out --to or "
                           "--slowdown", ExitCode.USAGE)
    req = SetSpeedRequest(tx_mbps=args.tx_mbps, rx_mbps=args.rx_mbps,
                          latency_ms=args.latency_ms or 0.0, slowdown=args.slowdown,
                          to=args.to)

    async def body(c: SwarmClient) -> None:
        if not by_cell:
            res = await c.set_speed(args.fellow_id, req, link=link)
            if args.format == "json":
                emit_json(res)
            else:
                _said(args.fellow_id, req, res, link)
            return
        job_id, fellows = await _cell_fellows(c, args.stage, args.replica)
        done = [{"fellow_id": fid, **await c.set_speed(fid, req, link=link)} for fid in fellows]
        if args.format == "json":
            emit_json({"job_id": job_id, "stage": args.stage, "replica": args.replica,
                       "fellows": done})
        else:
            for res in done:
                _said(res["fellow_id"], req, res, link)

    return run_with_client(args, body)


def _said(fid: int, req: SetSpeedRequest, res: dict, link: bool) -> None:
    during = f"; recorded in running job {res['job_id']}" if res.get("job_id") else ""
    limits = LinkLimits(req.tx_mbps, req.rx_mbps, req.latency_ms) if link else None
    pair = f" (its links to fellow {req.to})" if req.to is not None else ""
    print_line(f"fellow {fid}{pair}: {describe_speed(limits, req.slowdown)} "
               f"(signal {res['signal_seq']}{during})")


async def _cell_fellows(c: SwarmClient, stage: int | None,
                        replica: int | None) -> tuple[str, list[int]]:
    """The running job and the fellows that hold its cells of ``stage`` / ``replica`` (each
    fellow once: a fellow's link is shaped as one, whatever cells it holds)."""
    running = await c.jobs("RUNNING")
    job = running[0] if running else None
    p = job.placement if job is not None else None
    if job is None or p is None:
        raise CommandError("--stage/--replica name cells of the running job; none is running")
    # (under a layout, --replica names a cell id: up to the widest stage's, p.width)
    for flag, value, count in (("--stage", stage, p.num_stages), ("--replica", replica,
                                                                  p.width)):
        if value is not None and value >= count:
            raise CommandError(f"{flag} {value}: the running job {job.job_id} has "
                               f"{count} {flag[2:]}(s), 0-{count - 1}", ExitCode.USAGE)
    if stage is not None and replica is not None and not p.has(stage, replica):
        raise CommandError(f"--stage {stage} --replica {replica}: the running job "
                           f"{job.job_id} has no cell {stage}.{replica} (stage {stage}'s "
                           f"cells: {', '.join(map(str, p.ids(stage)))})", ExitCode.USAGE)
    if replica is not None and job.members is not None and replica not in job.members:
        raise CommandError(f"--replica {replica}: replica {replica} of {job.job_id} has left "
                           f"(training: {', '.join(map(str, job.members))})", ExitCode.USAGE)
    return job.job_id, p.fellows_of(stage, replica, job.members)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fellows", help="list fellows with live status")
    add_format(p)
    p.set_defaults(func=cmd_fellows)

    p = sub.add_parser("fellow-log", help="the tail of a fellow's own log, through the leader",
                       description="The newest lines of a fellow's own log, as the fellow "
                                   "sent them to the leader (it sends them while someone "
                                   "reads; this waits a few seconds for a fresh tail).")
    p.add_argument("fellow", metavar="FELLOW", help="the fellow's id or name")
    p.add_argument("--lines", type=number(int, 1, MAX_LOG_LINES, "lines"), default=None,
                   metavar="N", help=f"the newest N lines, 1-{MAX_LOG_LINES} (default: 200)")
    add_format(p)
    p.set_defaults(func=cmd_fellow_log)

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

    p = sub.add_parser("forget", help="drop the records of fellows that are gone (stale, "
                       "offline, released)",
                       description="The leader keeps a record of every fellow that ever "
                                   "registered. Forget those that are gone, so that views stop "
                                   "listing them; one that still heartbeats, or holds a cell "
                                   "of the running job, is refused. A forgotten fellow that "
                                   "comes back registers with a new id.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--gone", action="store_true",
                   help="every fellow that is not live (those that may not be are kept)")
    g.add_argument("--fellow-id", type=fellow_id, action="append",
                   help="forget this fellow (repeatable)")
    add_format(p)
    p.set_defaults(func=cmd_forget)

    p = sub.add_parser("set-speed", help="shape a fellow's data-plane link, live",
                       description="Shape one fellow's link, or those of the running job's "
                                   "cells: a stage group (--stage K), a replica's chain "
                                   "(--replica J), or one cell (both); --to FELLOW shapes "
                                   "only the links to that fellow (a link matrix's pairs); "
                                   "--slowdown emulates a slower peer.")
    p.add_argument("--fellow-id", type=fellow_id, default=None, help="which fellow")
    p.add_argument("--stage", type=cell_index, default=None, metavar="K",
                   help="the fellows of stage K of the running job (every replica)")
    p.add_argument("--replica", type=cell_index, default=None, metavar="J",
                   help="the fellows of replica J of the running job (every stage)")
    p.add_argument("--tx-mbps", type=link_mbps, default=None,
                   help="send limit in Mbit/s (omit: unlimited)")
    p.add_argument("--rx-mbps", type=link_mbps, default=None,
                   help="receive limit in Mbit/s (omit: unlimited)")
    p.add_argument("--latency-ms", type=latency_ms, default=None,
                   help="added one-way latency in ms (default 0)")
    p.add_argument("--to", type=fellow_id, default=None, metavar="FELLOW",
                   help="per pair: shape only the links to fellow FELLOW's cells (those a "
                        "running job's link matrix shapes): --tx-mbps is the pair's rate, "
                        "--latency-ms its latency")
    p.add_argument("--slowdown", type=slowdown, default=None, metavar="X",
                   help="emulate a slower peer: pad its compute to X times its measured time "
                        f"(1-{SLOWDOWN_MAX:g}; 1: none), from the next micro-batch; alone, it "
                        "leaves the link as it is (omit: unchanged)")
    add_format(p)
    p.set_defaults(func=cmd_set_speed)
