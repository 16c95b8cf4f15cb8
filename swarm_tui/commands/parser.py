"""The one parser of ``swarm`` and ``swarm-tui --cmd``: every command module registers its
actions here."""

from __future__ import annotations

import argparse
from typing import NoReturn

import swarm_core
from swarm_tui.commands.base import ExitCode, warn


class Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit 2."""

    def error(self, message: str) -> NoReturn:
        warn(f"{self.prog}: {message} (see '{self.prog} --help')")
        raise SystemExit(int(ExitCode.USAGE))


def build_parser(prog: str = "swarm") -> argparse.ArgumentParser:
    from swarm_tui.commands import MODULES

    parser = Parser(prog=prog, description="SilentSwarm: pipeline training over weak links.")
    parser.add_argument("--version", action="version", version=swarm_core.__version__)
    parser.add_argument("--leader-url", default=None,
                        help="leader URL (default: SWARM_LEADER_URL, then the local cluster's)")
    parser.add_argument("--token", default=None,
                        help="bearer token (default: SWARM_TOKEN, then the local cluster's)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in MODULES:
        module.register(sub)
    return parser
