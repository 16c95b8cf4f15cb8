"""``swarm launch``: fellows on the hosts of a hostfile, started and stopped over ssh; or
(``--slurm``) a leader and its fellows as a Slurm batch script."""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import swarm_core
from swarm_core.launch.hostfile import HostEntry, HostfileError, read_hostfile
from swarm_core.launch.launcher import (
    HostResult,
    run_all,
    ssh_argv,
    start_request,
    stop_request,
)
from swarm_core.launch.slurm import (
    DEFAULT_PORT,
    SlurmError,
    SlurmPlan,
    is_generated,
    make_plan,
    sbatch_script,
)
from swarm_tui.commands.argtypes import number, port
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

slurm_count = number(int, 1, 1024, "node count")
per_node = number(int, 0, 64, "count per node")
FAILED_MAX = 100  # exit codes above are the shell's (126+: not run, signals)
SBATCH_TIMEOUT_S = 60.0
# Flags of one way that the other does not take (checked before anything is read or written).
SSH_ONLY = {"hostfile": "--hostfile", "stop": "--stop", "ssh_config": "--ssh-config"}
SLURM_ONLY = {"nodes": "--nodes", "gpus_per_node": "--gpus-per-node",
              "fellows_per_node": "--fellows-per-node", "partition": "--partition",
              "time": "--time", "account": "--account", "job_name": "--job-name",
              "python": "--python", "state_dir": "--state-dir", "port": "--port",
              "output": "--output", "submit": "--submit"}


def cmd_launch(args: argparse.Namespace) -> int:
    if args.slurm:
        return _slurm(args)
    given = _given(args, SLURM_ONLY)
    if given is not None:
        raise CommandError(f"{given} is for --slurm (a batch script); the ssh launch takes "
                           "--hostfile", ExitCode.USAGE)
    if args.hostfile is None:
        raise CommandError("give --hostfile FILE (fellows over ssh) or --slurm --nodes N "
                           "(a Slurm batch script)", ExitCode.USAGE)
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


def _given(args: argparse.Namespace, flags: dict[str, str]) -> str | None:
    """The first of ``flags`` given on the command line (each defaults to None or False)."""
    return next((flag for key, flag in flags.items()
                 if getattr(args, key) is not None and getattr(args, key) is not False), None)


def _slurm(args: argparse.Namespace) -> int:
    given = _given(args, SSH_ONLY)
    if given is not None:
        raise CommandError(f"{given} is for the ssh launch; --slurm writes a batch script",
                           ExitCode.USAGE)
    if args.nodes is None:
        raise CommandError("--slurm needs --nodes N", ExitCode.USAGE)
    if args.dry_run and (args.submit or args.output):
        raise CommandError("--dry-run prints the script: leave out --submit and --output",
                           ExitCode.USAGE)
    try:
        plan = make_plan(args.nodes, gpus_per_node=args.gpus_per_node or 0,
                         fellows_per_node=args.fellows_per_node,
                         job_name=args.job_name or "swarm", partition=args.partition,
                         time=args.time, account=args.account,
                         python=args.python or sys.executable, state_dir=args.state_dir,
                         port=DEFAULT_PORT if args.port is None else args.port,
                         data_host=args.data_host or "0.0.0.0")
    except SlurmError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    script = sbatch_script(plan, swarm_core.__version__)
    if args.dry_run:
        if args.format == "json":
            emit_json({"action": "slurm", "dry_run": True, "script": script})
        else:
            sys.stdout.write(script)
        return 0
    sbatch = shutil.which("sbatch") if args.submit else None
    if args.submit and sbatch is None:  # (before the file: a failed --submit leaves nothing)
        raise CommandError("--submit: sbatch is not on PATH (run this on a Slurm login node, "
                           "or write the script with --output and submit it there)")
    path = Path(args.output or f"{plan.job_name}.sbatch")
    _write_script(path, script)
    job = _submit(sbatch, path) if sbatch is not None else None
    _print_slurm(plan, path, job, args)
    return 0


def _write_script(path: Path, script: str) -> None:
    """Write ``script`` to ``path``, over an earlier script of ours, never over another file."""
    if path.is_dir():
        raise CommandError(f"--output: {path} is a directory", ExitCode.USAGE)
    if path.exists():
        try:
            ours = is_generated(path.read_text(errors="replace"))
        except OSError as exc:
            raise CommandError(f"--output: cannot read {path}: {exc.strerror}") from None
        if not ours:
            raise CommandError(f"--output: {path} exists and was not written by 'swarm launch "
                               "--slurm'; remove it or name another file", ExitCode.USAGE)
    try:
        path.write_text(script)
    except OSError as exc:
        raise CommandError(f"--output: cannot write {path}: {exc.strerror}") from None


def _submit(sbatch: str, path: Path) -> str:
    try:
        proc = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True,
                              text=True, timeout=SBATCH_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CommandError(f"sbatch gave no answer within {SBATCH_TIMEOUT_S:g} s "
                           f"(the script is {path})") from None
    except OSError as exc:
        raise CommandError(f"cannot run sbatch: {exc.strerror}") from None
    said = [x.strip() for x in (proc.stderr + proc.stdout).splitlines() if x.strip()]
    if proc.returncode != 0:
        raise CommandError(f"sbatch refused {path}: "
                           f"{said[-1][:300] if said else f'exit status {proc.returncode}'}")
    # --parsable: "JOBID" or "JOBID;CLUSTER"
    out = [x.strip() for x in proc.stdout.splitlines() if x.strip()]
    return out[-1].split(";", 1)[0] if out else ""


def _print_slurm(plan: SlurmPlan, path: Path, job: str | None,
                 args: argparse.Namespace) -> None:
    if args.format == "json":
        emit_json({"action": "slurm", "dry_run": False, "script_path": str(path),
                   "submitted": job is not None, "job_id": job or None,
                   "nodes": plan.nodes, "fellows_per_node": plan.fellows_per_node,
                   "devices": plan.devices})
        return
    if job is None:
        print_line(f"wrote {path}: submit it with 'sbatch {path}'")
        return
    print_line(f"submitted {path} as Slurm job {job or '(sbatch printed no id)'}; the job's "
               "output names the leader URL, and its state directory holds the token")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="start (or --stop) fellows on the hosts of a hostfile over ssh "
                       "(exit code: how many hosts failed), or write a Slurm batch script "
                       "(--slurm)",
        description="One line per host: 'host slots=N devices=cuda:0,cuda:1 "
                    "python=/path/to/venv/bin/python'. The system ssh is used, so "
                    "~/.ssh/config, keys, agents and ProxyJump apply. The leader URL and "
                    "token travel on ssh's standard input, never a command line. With --slurm: "
                    "a batch script that runs the leader on the first node and the fellows on "
                    "every node through srun; it holds no token (the fellows read SWARM_TOKEN "
                    "from the environment sbatch is given, else the leader's token file).")
    p.add_argument("--hostfile", default=None, metavar="FILE", help="the hosts (ssh launch)")
    p.add_argument("--stop", action="store_true", help="stop the fellows a launch started")
    p.add_argument("--dry-run", action="store_true",
                   help="print the ssh commands and the fellows (with --slurm: the script), "
                        "run nothing")
    p.add_argument("--ssh-config", default=None, metavar="FILE",
                   help="an ssh config file instead of ~/.ssh/config (ssh -F)")
    p.add_argument("--data-host", default=None, metavar="ADDR",
                   help="the fellows' --data-host: an address of each host, or 0.0.0.0 "
                        "(default: theirs, 127.0.0.1, which only a one-machine job can use; "
                        "a host's data_host= wins; with --slurm: 0.0.0.0)")
    g = p.add_argument_group("Slurm (--slurm)")
    g.add_argument("--slurm", action="store_true",
                   help="write a Slurm batch script (to --output, default JOB_NAME.sbatch; "
                        "an existing file only if it is such a script) instead of using ssh")
    g.add_argument("--nodes", type=slurm_count, default=None, metavar="N",
                   help="nodes of the allocation (required with --slurm)")
    g.add_argument("--gpus-per-node", type=per_node, default=None, metavar="G",
                   help="GPUs per node (default 0: fellows on the CPU)")
    g.add_argument("--fellows-per-node", type=per_node, default=None, metavar="F",
                   help="fellows per node: G (one per GPU, the default) or 1 (one owning all "
                        "G); without GPUs, F fellows on the CPU (default 1)")
    g.add_argument("--partition", default=None, help="sbatch --partition")
    g.add_argument("--time", default=None, metavar="LIMIT",
                   help="sbatch --time (minutes, H:M:S or D-H:M:S)")
    g.add_argument("--account", default=None, help="sbatch --account")
    g.add_argument("--job-name", default=None, metavar="NAME",
                   help="sbatch --job-name (default: swarm)")
    g.add_argument("--python", default=None, metavar="PATH",
                   help="the interpreter of SilentSwarm's install on the nodes (default: this "
                        "one's)")
    g.add_argument("--state-dir", default=None, metavar="DIR",
                   help="the leader's state directory as the nodes see it (default: "
                        "swarm-state-JOBID in the submit directory)")
    g.add_argument("--port", type=port, default=None,
                   help="the leader's port on the first node (default: 8765)")
    g.add_argument("--output", default=None, metavar="FILE",
                   help="where the script is written (default: JOB_NAME.sbatch)")
    g.add_argument("--submit", action="store_true",
                   help="write the script, then hand it to sbatch (which must be on PATH)")
    add_format(p)
    p.set_defaults(func=cmd_launch)
