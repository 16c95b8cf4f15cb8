"""``swarm leader`` and ``swarm fellow``: the daemons, in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading
from pathlib import Path

from swarm_core.launch.torchrun import (
    LaunchEnv,
    LaunchEnvError,
    fellow_devices,
    fellow_name,
    leader_url,
    read_launch_env,
)
from swarm_core.paths import default_state_dir
from swarm_core.protocol import SLOWDOWN_MAX, RegisterRequest
from swarm_core.schema import FieldError
from swarm_tui.commands.argtypes import (
    data_host,
    data_root,
    device_slots,
    port,
    positive_float,
    slowdown,
    thread_count,
)
from swarm_tui.commands.base import (
    CommandError,
    ExitCode,
    check_gpu_slots,
    check_state_dir,
    resolve_leader,
)

# Once a fellow has stopped, what can still hold its process is a stage thread inside one
# op that checks no stop event (a native call, a device that hangs): the process leaves
# without it this long after, as a fellow told to stop must.
EXIT_GRACE_S = 3.0


def exit_within(seconds: float, code: int) -> threading.Timer:
    """Make the process exit with ``code`` in ``seconds`` if it has not by then (the
    interpreter waits for every thread of the stages' executor before it exits)."""

    def leave() -> None:
        sys.stderr.write(f"swarm fellow: a stage thread still ran {seconds:g}s after the "
                         "fellow stopped; exiting without it\n")
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, leave)
    timer.daemon = True  # (a process that ends by itself does not wait for the timer)
    timer.start()
    return timer


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def cmd_leader(args: argparse.Namespace) -> int:
    from swarm_core.leader import (
        LeaderConfig,
        StateDirBusy,
        StoreError,
        TokenFileError,
        run_leader,
    )

    _logging(args.verbose)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.allow_remote:
        raise CommandError(f"refusing to bind {args.host}: the leader binds loopback unless "
                           "--allow-remote is given (then protect the token)", ExitCode.USAGE)
    state_dir = Path(args.state_dir).expanduser() if args.state_dir else default_state_dir()
    check_state_dir(state_dir)
    cfg = LeaderConfig(state_dir=state_dir,
                       stale_after_s=args.stale_after)
    try:
        run_leader(cfg, host=args.host, port=args.port)
    except StateDirBusy as exc:  # (a usage error: another --state-dir, or stop that leader)
        raise CommandError(str(exc), ExitCode.USAGE) from None
    except (StoreError, TokenFileError) as exc:
        raise CommandError(str(exc)) from None
    except OSError as exc:
        raise CommandError(
            f"cannot serve on {args.host}:{args.port}: {exc.strerror or exc}") from None
    return 0


def cmd_fellow(args: argparse.Namespace) -> int:
    from swarm_core.fellow import FellowDaemon, FellowOptions

    _logging(args.verbose)
    try:  # torchrun's variables (and srun's, as `swarm launch --slurm` passes them on)
        launch = read_launch_env(os.environ)
    except LaunchEnvError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    # As every other command: --leader-url, SWARM_LEADER_URL, then MASTER_ADDR's host, else the
    # local cluster (with its token), so a fellow joins the cluster `swarm restart-cluster`
    # started without flags.
    if not args.leader_url and not os.environ.get("SWARM_LEADER_URL"):
        args.leader_url = leader_url(launch)
    url, token = resolve_leader(args)
    devices = fellow_device_slots(args.devices, launch)
    check_gpu_slots(devices)
    name = fellow_name(socket.gethostname(), launch) if args.name is None else args.name
    try:  # the name the leader will check, checked here: one line and exit 2, no traceback
        RegisterRequest(name=name, instance_id="check")
    except FieldError as exc:
        raise CommandError(f"--name: {exc}", ExitCode.USAGE) from None
    opts = FellowOptions(
        leader_url=url, token=token,
        name=name, devices=devices or ["cpu"],
        threads=args.threads, data_host=args.data_host, data_port=args.data_port,
        data_advertise=args.data_advertise, data_roots=tuple(args.data_root),
        slowdown=args.slowdown,
    )
    daemon = FellowDaemon(opts)

    async def serve() -> int:
        code = 1
        try:
            code = await daemon.run()
            return code
        finally:  # (asyncio.run then waits for the executor's threads: bounded from here)
            exit_within(EXIT_GRACE_S, code)

    code = asyncio.run(serve())
    if daemon.exit_reason.startswith("registration refused"):
        raise CommandError(daemon.exit_reason)
    return code


def fellow_device_slots(requested: str, launch: LaunchEnv) -> list[str]:
    """``--devices`` as slots: ``cuda`` and ``auto`` take the launcher's LOCAL_RANK."""
    has_gpu = False
    if requested == "auto":  # (torch only for this: seconds of imports)
        import torch

        has_gpu = torch.cuda.is_available()
    chosen = fellow_devices(requested, launch, os.environ.get("CUDA_VISIBLE_DEVICES"), has_gpu)
    try:
        return device_slots(chosen).split(",")
    except argparse.ArgumentTypeError as exc:
        raise CommandError(f"--devices: {exc}", ExitCode.USAGE) from None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("leader", help="run the leader in the foreground",
                       description="Run the leader (HTTP API, registry, queue) until SIGTERM.")
    p.add_argument("--state-dir", default=None,
                   help="SQLite state and token live here (default: $SWARM_HOME/leader, "
                        "else the user data dir)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    p.add_argument("--port", type=port, default=8765, help="TCP port (default: %(default)s)")
    p.add_argument("--stale-after", type=positive_float, default=5.0,
                   help="seconds without heartbeat before a fellow is stale (default: 5)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow binding a non-loopback address")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=cmd_leader)

    p = sub.add_parser("fellow", help="run a fellow daemon in the foreground",
                       description="Register with the leader, heartbeat, run assigned stages. "
                                   "Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                                   "MASTER_PORT set) RANK makes the default name unique, "
                                   "LOCAL_RANK picks the GPU of --devices cuda/auto, and with "
                                   "no leader URL given the leader is http://MASTER_ADDR:8765 "
                                   "(MASTER_PORT is torchrun's own store); flags win.")
    p.add_argument("--name", help="fellow name, unique in the cluster (default: hostname; "
                                  "hostname-rRANK under torchrun, whose RANK is set)")
    p.add_argument("--devices", default="cpu",
                   help="device slots: cpu, or cuda:0,cuda:1; cuda: the GPU torchrun's "
                        "LOCAL_RANK names (cuda:0 where CUDA_VISIBLE_DEVICES lists one); auto: "
                        "that GPU where torch sees one, else cpu (default: cpu)")
    p.add_argument("--threads", type=thread_count, default=1,
                   help="torch threads per stage (default: 1)")
    p.add_argument("--data-host", default="127.0.0.1",
                   help="address the data plane binds; neighbours dial it for activations "
                        "(default: %(default)s)")
    p.add_argument("--data-advertise", type=data_host, default=None, metavar="HOST",
                   help="host neighbours dial when it is not --data-host (NAT, a bind-all "
                        "--data-host); default with 0.0.0.0: the address this machine "
                        "reaches the leader from")
    p.add_argument("--data-port", type=port, default=0,
                   help="data-plane TCP port (default: any free one)")
    p.add_argument("--data-root", type=data_root, action="append", default=[], metavar="DIR",
                   help="a directory whose files jobs may train on (training.dataset_paths; "
                        "repeatable). Without one, jobs read no file of this machine")
    p.add_argument("--slowdown", type=slowdown, default=1.0, metavar="X",
                   help="emulate a slower peer: pad each stage's compute to X times its "
                        f"measured time (1-{SLOWDOWN_MAX:g}; default 1: none); set-speed "
                        "--slowdown changes it live")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=cmd_fellow)
