"""The local cluster as the console sees it (no Textual): the record to follow when the cluster
is restarted under it, and the processes this console started, which are the only ones its
quit stops.

The record is ``swarm_core.local_cluster``'s (read, never rewritten here). ``swarm
restart-cluster`` replaces it with a new leader on a new port: a console that took its leader
from the record follows it there. A console that started a cluster (``--local``) owns the
processes of *that* record only; once the record names another cluster, quitting leaves that
one running.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Callable

from swarm_core.local_cluster import (
    ClusterError,
    ClusterRecord,
    process_alive,
    read_record,
    record_path,
    stop_processes,
    token_for,
)

LeaderAddress = tuple[str, str | None]  # url, token


def local_leader(token: str | None = None) -> LeaderAddress | None:
    """The leader the local cluster record names now (with its token, unless ``token`` was
    given outright); None without a readable record."""
    try:
        record = read_record()
        if record is None:
            return None
        return record.leader_url, token or token_for(record)
    except ClusterError:
        return None  # (being rewritten, or broken: the console keeps what it has)


def follower(token: str | None = None) -> Callable[[], LeaderAddress | None]:
    """What the console calls to find the local cluster's leader again."""
    return lambda: local_leader(token)


class OwnedCluster:
    """The local cluster this console started. Its processes are the pids of the record as it
    was written then; stopping them never touches a cluster started since."""

    def __init__(self, record: ClusterRecord) -> None:
        self.record = record

    @property
    def pids(self) -> list[int]:
        return [*(f.pid for f in self.record.fellows), self.record.leader.pid]

    def is_current(self) -> bool:
        """Does the record on disk still describe this cluster?"""
        try:
            now = read_record()
        except ClusterError:
            return False
        return now is not None and now.leader.pid == self.record.leader.pid \
            and now.started_at == self.record.started_at

    def running(self) -> bool:
        """Is any of its processes still alive (something for quitting to stop)?"""
        return any(process_alive(pid) for pid in self.pids)

    def stop_in_background(self) -> subprocess.Popen[bytes] | None:
        """Return at once; a detached helper stops its processes, kills what lingers and
        removes the record if it is still this cluster's (fellows take seconds to say goodbye
        to their leader: the terminal need not wait for that)."""
        if not self.running():
            self._forget()
            return None
        spec = json.dumps({"fellows": [f.pid for f in self.record.fellows],
                           "leader": self.record.leader.pid,
                           "started_at": self.record.started_at})
        return subprocess.Popen(
            [sys.executable, "-m", "swarm_tui.app.cluster", spec],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # outlives the console and its terminal's hangup

    def stop(self) -> None:
        """Stop its processes and wait for them (fellows first, to say goodbye to a leader that
        is still there)."""
        stop_own(self.record.leader.pid, [f.pid for f in self.record.fellows],
                 self.record.started_at)

    def _forget(self) -> None:
        if self.is_current():
            with contextlib.suppress(FileNotFoundError):
                record_path().unlink()


def stop_own(leader: int, fellows: list[int], started_at: float) -> None:
    """Stop these processes, but none the current record names when it is another cluster's
    (a pid reused by a restarted cluster stays), then remove the record if it is still ours."""
    try:
        now = read_record()
    except ClusterError:
        now = None
    ours = now is not None and now.leader.pid == leader and now.started_at == started_at
    theirs = set() if ours or now is None else {now.leader.pid, *(f.pid for f in now.fellows)}
    stop_processes([p for p in fellows if p not in theirs])
    stop_processes([p for p in [leader] if p not in theirs])
    if ours:
        with contextlib.suppress(FileNotFoundError):
            record_path().unlink()


def main(argv: list[str]) -> int:
    """``python -m swarm_tui.app.cluster SPEC``: the background stop of a console's cluster."""
    spec = json.loads(argv[0])
    stop_own(int(spec["leader"]), [int(p) for p in spec["fellows"]], float(spec["started_at"]))
    return 0


if __name__ == "__main__":  # pragma: no cover - run by stop_in_background
    sys.exit(main(sys.argv[1:]))
