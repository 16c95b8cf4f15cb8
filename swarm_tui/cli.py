"""Entry point of ``swarm`` and ``swarm-tui``: one parser; ``swarm X`` ≡ ``swarm-tui --cmd X``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import swarm_core
from swarm_core.local_cluster import ClusterError
from swarm_tui.commands.argtypes import local_fellow_count
from swarm_tui.commands.base import CommandError, ExitCode, exit_code, warn
from swarm_tui.commands.parser import Parser, build_parser


def _global_flags_anywhere(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Let ``--leader-url``/``--token`` also follow the command (``swarm fellows --token T``)."""
    head: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in ("--leader-url", "--token"):
            if "=" in arg:
                head.append(arg)
            elif i + 1 < len(argv):
                head += [arg, argv[i + 1]]
                i += 1
            else:
                rest.append(arg)
        else:
            rest.append(arg)
        i += 1
    return head + rest


def run(argv: Sequence[str], prog: str = "swarm") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(_global_flags_anywhere(list(argv), parser))
    if args.command is None:
        parser.print_help()
        return int(ExitCode.USAGE)
    try:
        return int(args.func(args))
    except (CommandError, ClusterError) as exc:
        warn(f"{prog}: {exc}")
        return int(exit_code(exc))
    except KeyboardInterrupt:
        warn(f"{prog}: interrupted")
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        # The reader (head, less) went away; that is not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return int(ExitCode.OK)
    except Exception as exc:
        if os.environ.get("SWARM_DEBUG"):
            raise
        warn(f"{prog}: internal error: {type(exc).__name__}: {exc} (SWARM_DEBUG=1 shows more)")
        return int(ExitCode.FAILURE)


def main_swarm(argv: Sequence[str] | None = None) -> int:
    if argv is not None:  # (called as a function: return like one)
        return run(argv, "swarm")
    return exit_process(run(sys.argv[1:], "swarm"))


def exit_process(code: int, *, always: bool = False) -> int:
    """End a ``swarm`` process that loaded torch (a fellow, glue, eval) at once: tearing the
    interpreter down frees every tensor and module one by one, about a second that a script
    waiting on the exit (or a cluster stopping) pays for nothing. Output and logs are flushed
    first; nothing else of ours runs at exit. ``always``: whatever it loaded (the console:
    its teardown, after the terminal is restored, took 0.2-0.4 s of a quit)."""
    if always or "torch" in sys.modules:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    return code


def main_tui(argv: Sequence[str] | None = None) -> int:
    if argv is not None:  # (called as a function: return like one)
        return _main_tui(list(argv))
    return exit_process(_main_tui(sys.argv[1:]), always=True)


def _main_tui(args: list[str]) -> int:
    for i, arg in enumerate(args):
        if arg == "--cmd" or arg.startswith("--cmd="):
            if arg == "--cmd":
                if i + 1 >= len(args):
                    warn("swarm-tui: --cmd needs an action (see 'swarm-tui --cmd --help')")
                    return int(ExitCode.USAGE)
                action, rest = args[i + 1], args[i + 2:]
            else:
                action, rest = arg.split("=", 1)[1], args[i + 1:]
            return run([*args[:i], action, *rest], "swarm-tui --cmd")
    # The interactive console. Textual is imported only here, so headless commands never load it.
    parser = Parser(prog="swarm-tui",
                     description="SilentSwarm console; 'swarm-tui --cmd ACTION …' runs a headless "
                                 "action instead (see 'swarm --help').")
    parser.add_argument("--version", action="version", version=swarm_core.__version__)
    parser.add_argument("--leader-url", default=None,
                        help="leader URL (default: SWARM_LEADER_URL, then the local cluster's)")
    parser.add_argument("--token", default=None,
                        help="bearer token (default: SWARM_TOKEN, then the local cluster's)")
    parser.add_argument("--local", type=local_fellow_count, default=None, metavar="N",
                        help="start a local cluster (leader + N fellows) first; stop it on exit")
    parser.add_argument("--read-only", action="store_true",
                        help="refuse every action that changes the cluster (shared screens)")
    parser.add_argument("--configs", default=None, metavar="DIR",
                        help="experiment configs for the launcher (default: exp/configs)")
    parser.add_argument("--keymap", default=None, metavar="FILE",
                        help="JSON of binding id -> keys (default: the user config dir's "
                             "silentswarm/keymap.json, when it exists)")
    parser.add_argument("--no-mouse", action="store_true",
                        help="leave the mouse to the terminal (its own selection and "
                             "scrolling, as over tmux or SSH); every action has a key")
    ns = parser.parse_args(args)
    if ns.local is not None and ns.leader_url:
        parser.error("--local starts its own leader; leave out --leader-url")
    if ns.configs is not None:
        try:  # (expanded once, here: the launcher reads what was checked)
            configs = Path(ns.configs).expanduser()
        except RuntimeError:  # ~user with no such user
            parser.error(f"--configs: {ns.configs}: no such user's home directory")
        if not configs.is_dir():
            parser.error(f"--configs: {ns.configs} is not a directory")
        ns.configs = str(configs)
    try:
        from swarm_tui.app.main import run_console

        return run_console(ns)
    except (CommandError, ClusterError) as exc:
        warn(f"swarm-tui: {exc}")
        return int(exit_code(exc))
    except KeyboardInterrupt:
        warn("swarm-tui: interrupted")
        return int(ExitCode.INTERRUPTED)


if __name__ == "__main__":
    raise SystemExit(exit_process(run(sys.argv[1:])))
