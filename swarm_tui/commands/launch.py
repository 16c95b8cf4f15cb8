"""``swarm launch``: fellows on the hosts of a hostfile, started and stopped over ssh."""

from __future__ import annotations

import argparse
import asyncio
import shlex
from pathlib import Path
from typing import Any

from swarm_core.launch.hostfile import HostEntry, HostfileError, read_hostfile
from swarm_core.launch.launcher import (
    HostResult,
    run_all,
    ssh_argv,
    start_request,
    stop_request,
)
from swarm_tui.commands.base import (
    CommandError,
    ExitCode,
    add_format,
    emit_json,
    emit_table,
    print_line,
    resolve_leader,
    warn,
)

FAILED_MAX = 100  # exit codes above are the shell's (126+: not run, signals)


def cmd_launch(args: argparse.Namespace) -> int:
    try:
        entries = read_hostfile(Path(args.hostfile))
    except HostfileError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    ssh_config = Path(args.ssh_config) if args.ssh_config else None
    if ssh_config is not None and not ssh_config.is_file():
        raise CommandError(f"--ssh-config: {ssh_config} is not a file", ExitCode.USAGE)
    if args.dry_run:
        return _dry_run(entries, ssh_config, args)
    if args.stop:
        requests = [stop_request(e) for e in entries]
    else:
        url, token = resolve_leader(args)
        if not token:  # (every fellow would be refused, and retry for ever)
            raise CommandError("no token for the fellows: pass --token or set SWARM_TOKEN "
                               "(the leader's state dir holds it in 'token')", ExitCode.USAGE)
        requests = [start_request(e, url, token, args.data_host) for e in entries]
    results = asyncio.run(run_all(entries, requests, ssh_config))
    failed = [r for r in results if not r.ok]
    for r in failed:  # one line per host, naming it
        warn(f"swarm: host {r.host}: {r.error}")
    _print(results, entries, args)
    return min(len(failed), FAILED_MAX)


def _print(results: list[HostResult], entries: list[HostEntry],
           args: argparse.Namespace) -> None:
    if args.format == "json":
        emit_json({"action": "stop" if args.stop else "start",
                   "hosts": [{"host": r.host, "ok": r.ok, "error": r.error or None,
                              "fellows": r.fellows} for r in results],
                   "failed": sum(not r.ok for r in results)})
        return
    rows: list[list[str | None]] = []
    for r, e in zip(results, entries, strict=True):
        if not r.fellows:
            rows.append([r.host, "-", "-", "FAILED" if not r.ok else "-"])
        for f in r.fellows:
            devices = next((",".join(p.devices) for p in e.fellows()
                            if p.name == f.get("name")), "-")
            rows.append([r.host, f.get("name"), devices, _result(f, args.stop)])
    emit_table("stopped" if args.stop else "launched", ["host", "fellow", "devices", "result"],
               rows)


def _result(f: dict, stopping: bool) -> str:
    if not f.get("ok"):
        return f"FAILED: {f.get('error', '')}"
    if stopping:
        if not f.get("stopped"):
            return "not running"
        return f"stopped (pid {f.get('pid')}{', killed' if f.get('killed') else ''})"
    return f"{'already running' if f.get('already') else 'started'} (pid {f.get('pid')}), " \
           f"log {f.get('log')}"


def _dry_run(entries: list[HostEntry], ssh_config: Path | None,
             args: argparse.Namespace) -> int:
    what = "stop" if args.stop else "start"
    hosts: list[dict[str, Any]] = [
        {"host": e.host, "command": ssh_argv(e, ssh_config),
         "fellows": [{"name": f.name, "devices": list(f.devices)} for f in e.fellows()]}
        for e in entries]
    if args.format == "json":
        emit_json({"action": what, "dry_run": True, "hosts": hosts})
        return 0
    for h in hosts:
        names = ", ".join(f"{f['name']} ({','.join(f['devices'])})" for f in h["fellows"])
        print_line(f"{h['host']}: {what} {names}")
        print_line(f"  {shlex.join(h['command'])}")
    if not args.stop:
        print_line("(each command reads the leader URL and token on its standard input; "
                   "they reach the fellows through their environment)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="start (or --stop) fellows on the hosts of a hostfile over ssh "
                       "(exit code: how many hosts failed)",
        description="One line per host: 'host slots=N devices=cuda:0,cuda:1 "
                    "python=/path/to/venv/bin/python'. The system ssh is used, so "
                    "~/.ssh/config, keys, agents and ProxyJump apply. The leader URL and "
                    "token travel on ssh's standard input, never a command line.")
    p.add_argument("--hostfile", required=True, metavar="FILE", help="the hosts")
    p.add_argument("--stop", action="store_true", help="stop the fellows a launch started")
    p.add_argument("--dry-run", action="store_true",
                   help="print the ssh commands and the fellows, run nothing")
    p.add_argument("--ssh-config", default=None, metavar="FILE",
                   help="an ssh config file instead of ~/.ssh/config (ssh -F)")
    p.add_argument("--data-host", default=None, metavar="ADDR",
                   help="the fellows' --data-host: an address of each host, or 0.0.0.0 "
                        "(default: theirs, 127.0.0.1, which only a one-machine job can use; "
                        "a host's data_host= wins)")
    add_format(p)
    p.set_defaults(func=cmd_launch)
