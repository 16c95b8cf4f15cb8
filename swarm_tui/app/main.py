"""Start the console: optionally an embedded local cluster first, then the app."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from pathlib import Path

from swarm_core.client import SwarmClient
from swarm_core.local_cluster import ClusterError
from swarm_tui.commands.base import CommandError, ExitCode, resolve_leader, warn


def run_console(args: argparse.Namespace) -> int:
    """``args``: leader_url, token, local (fellow count or None), read_only, configs,
    keymap, no_mouse."""
    from swarm_tui.app import keymap as keymaps
    from swarm_tui.app.app import SwarmApp

    try:  # before anything starts: a bad keymap changes nothing
        keymap = keymaps.load(Path(args.keymap) if getattr(args, "keymap", None) else None)
    except keymaps.KeymapError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    cluster = None
    note = ""
    follow = None
    if args.local is not None:
        from swarm_core.local_cluster import ClusterSpec, start_cluster, token_for
        from swarm_tui.app.cluster import OwnedCluster, follower

        warn(f"swarm-tui: starting a local cluster (leader + {args.local} fellows)…")
        record = start_cluster(ClusterSpec(fellows=args.local))
        url, token = record.leader_url, token_for(record)
        cluster = OwnedCluster(record)
        follow = follower()
        note = f"(local cluster, {args.local} fellows; stopped on exit)"
    else:
        url, token = resolve_leader(args)
        if not (getattr(args, "leader_url", None) or os.environ.get("SWARM_LEADER_URL")):
            from swarm_tui.app.cluster import follower

            # The leader came from the local cluster record: follow the record when a
            # restart-cluster moves the leader to another port.
            follow = follower(getattr(args, "token", None) or None)
    try:
        app = SwarmApp(SwarmClient(url, token), leader_url=url, read_only=args.read_only,
                       configs_dir=Path(args.configs) if args.configs else None, note=note,
                       cluster=cluster, follow=follow, keymap=keymap)
        # --no-mouse: the terminal keeps its own selection and scrolling (tmux, SSH).
        app.run(mouse=not getattr(args, "no_mouse", False))
        if app.return_code not in (None, 0):
            return int(app.return_code)
        return int(ExitCode.OK)
    finally:
        if cluster is not None and cluster.running():
            # The terminal may be gone (SSH dropped) and more signals may follow: finish the
            # cleanup regardless, and never fail on writing to a closed terminal. The stop
            # itself runs detached: the shell is back at once.
            for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(OSError, ValueError):
                    signal.signal(sig, signal.SIG_IGN)
            _say("swarm-tui: stopping the local cluster (in the background)…")
            try:
                cluster.stop_in_background()
            except OSError as exc:  # pragma: no cover - no helper process: stop it here
                _say(f"swarm-tui: stopping it here instead ({exc})")
                try:
                    cluster.stop()
                except (OSError, ClusterError) as err:
                    _say(f"swarm-tui: could not stop the local cluster: {err}")


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        warn(text)
