"""One pipeline run per output directory and node: OUTPUT/.pipeline/lock/node-<rank>.json names the run that
holds it (pid, host, since when, the process's start time). Two shells, a requeued job, or two nodes both given
node_rank 0 would otherwise train into the same stage directories at once.

Taking it: the record is written whole under a name of its own, then hard-linked to the lock's name, which fails
if the name exists (link(2) is atomic, on NFS too, and a reader never sees a half-written lock). A lock whose
process is gone -- on this host, its pid no longer running, or running another program since (a pid reused, told
by its start time) -- is taken over, said in one line; the check and the takeover happen under flock(2) on a
guard file beside it, so two runs taking over the same stale lock cannot both win. A lock held on another host
cannot be checked from here: the refusal says to remove it if that run is gone."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from lorakit.core.atomic import write_json_atomically
from lorakit.core.cli import InputError

LOCK_DIR = os.path.join(".pipeline", "lock")


def lock_path(output_dir: str, node_rank: int) -> str:
    return os.path.join(output_dir, LOCK_DIR, f"node-{node_rank}.json")


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat's 22nd field), None where unknown:
    with the pid, it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None


def process_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: running
    now = process_start(pid)
    return start is None or now is None or now == start


def holder_text(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, since {holder.get('since', '?')}"


def is_stale(holder: dict[str, Any]) -> bool:
    """Whether the lock's process is known to be gone: only a process of this host can be checked."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    return not process_alive(pid, holder.get("process_start"))


def read_holder(path: str) -> dict[str, Any] | None:
    """The lock's record; None when there is no lock; {} for a file that is no record of ours."""
    try:
        with open(path, encoding="utf-8") as handle:
            holder = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


@contextlib.contextmanager
def guard(path: str) -> Iterator[None]:
    """flock(2) on path for the block: serializes the stale-lock takeover. A filesystem that refuses locks
    (ENOLCK on some network mounts) leaves the takeover unguarded; taking a free lock stays atomic."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            pass
        yield


def link_or_create(source: str, target: str) -> None:
    """Hard-link source to target, failing with FileExistsError when target exists. A filesystem without hard links
    gets an exclusive create (O_EXCL) with source's content, which a reader may see half-written for a moment:
    such a lock reads as held by an unknown run."""
    try:
        os.link(source, target)
    except FileExistsError:
        raise
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        with open(source, "rb") as handle:
            content = handle.read()
        with open(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as handle:
            handle.write(content)


class OutputLock:
    """The lock of one output directory for one node rank, held for a `with` block."""

    def __init__(self, output_dir: str, node_rank: int) -> None:
        self.path = lock_path(output_dir, node_rank)
        self.output_dir = output_dir
        self.record: dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%d %H:%M:%S %z"), "process_start": process_start(os.getpid()),
                       "token": secrets.token_hex(8)}

    @property
    def token(self) -> str:
        """This run's id (in the lock, and in the stage markers it writes)."""
        return self.record["token"]

    def claim(self) -> dict[str, Any] | None:
        """Link our record to the lock's name: None when taken, else the holder's record."""
        own = f"{self.path}.{self.token}"
        write_json_atomically(own, self.record)
        try:
            for _ in range(3):  # a holder that ends between our link and our read: try again
                try:
                    link_or_create(own, self.path)
                    return None
                except FileExistsError:
                    holder = read_holder(self.path)
                    if holder is not None:
                        return holder
            return {}
        finally:
            os.unlink(own)

    def refuse(self, holder: dict[str, Any]) -> InputError:
        where = "" if holder.get("host") == socket.gethostname() else "; if that run is gone, remove the lock"
        return InputError(f"{self.output_dir} is in use by another pipeline run: {holder_text(holder)} "
                          f"(its lock: {self.path}{where}); wait for it to end, or stop it")

    def check_free(self) -> None:
        """Refuse at once, writing nothing, when a live run holds the lock (before the minutes of planning)."""
        holder = read_holder(self.path)
        if holder is not None and not is_stale(holder):
            raise self.refuse(holder)

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with guard(self.path + ".guard"):
            holder = self.claim()
            if holder is not None and is_stale(holder):
                print(f"pipeline: taking over the lock of {holder_text(holder)}: that process is gone", flush=True)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                holder = self.claim()
        if holder is not None:
            raise self.refuse(holder)

    def release(self) -> None:
        if (read_holder(self.path) or {}).get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()
