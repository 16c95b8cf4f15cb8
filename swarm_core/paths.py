"""Where SilentSwarm keeps things on disk, and atomic writes."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

import platformdirs


def swarm_home() -> Path:
    """Root for local state: ``SWARM_HOME`` or the user's data dir."""
    env = os.environ.get("SWARM_HOME")
    return Path(env) if env else Path(platformdirs.user_data_dir("silentswarm"))


def default_state_dir() -> Path:
    return swarm_home() / "leader"


def local_cluster_dir() -> Path:
    return swarm_home() / "local-cluster"


def dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a directory (the nearest part of it that exists is not one, or
    cannot be looked at); None if it is one or can be made."""
    part = path
    try:
        while not part.exists() and part != part.parent:
            part = part.parent
        if part.exists() and not part.is_dir():
            return f"{part} is not a directory"
    except OSError as exc:  # (exists() raises on a directory we may not search)
        return f"cannot look at {part}: {exc.strerror}"
    return None


class UnsafeDir(OSError):
    """A directory that others may write, offered to hold what must be private."""


def private_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot hold private state (a token, a database, shards): what
    :func:`dir_problem` finds, or an existing directory that its group or others can write
    (they could replace what is in it). None if it is fit or can be made."""
    problem = dir_problem(path)
    if problem:
        return problem
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot look at {path}: {exc.strerror}"
    if mode & 0o022:
        who = " and ".join(w for w, bit in (("its group", 0o020), ("others", 0o002))
                           if mode & bit)
        return (f"{path} is writable by {who} (mode {mode:04o}); give a directory only its "
                "owner can write, or a new one (made 0700)")
    return None


def ensure_private_dir(path: Path) -> Path:
    """``path``, made 0700 when it is new. An existing directory keeps its mode: it may be
    /tmp or a home, which a chmod would break for everyone else (as root, silently); one that
    others can write is refused (UnsafeDir), not fixed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        problem = private_dir_problem(path) or (
            None if path.is_dir() else f"{path} is not a directory")  # (a dangling link)
        if problem:
            raise UnsafeDir(problem) from None
        return path
    os.chmod(path, 0o700)  # (ours, just made: a umask can only have narrowed it, even to 0)
    return path


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write via a temp file in the same directory, fsync, rename, fsync the directory:
    readers never see half, and after a power loss the file is the old one or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable: a new name is on disk only once the directory's own
    blocks are (POSIX). Nothing where a directory cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # (some filesystems refuse fsync on a directory)
            os.fsync(fd)
    finally:
        os.close(fd)
