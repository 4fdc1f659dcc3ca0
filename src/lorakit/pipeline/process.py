"""A stage's process: started in a session (and process group) of its own, its output streamed to the console and
its log, and the signals that stop the launcher passed on to it. Without its own group a Ctrl-C reached the stage
through the terminal but a SIGTERM (a scheduler's, a `kill`) stopped the launcher alone and left torchrun and its
workers training; with it, the launcher forwards SIGTERM and SIGINT to the stage's group (torchrun passes them on
to its workers), waits for it to end, and exits with 128 + the signal's number. A second signal kills the stage's
processes at once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from types import FrameType
from typing import BinaryIO, NamedTuple

from lorakit.core.cli import ReportedError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(ReportedError):
    """The launcher was told to stop (SIGTERM, SIGINT): its exit status is 128 + the signal's number."""

    def __init__(self, signum: int, stage: str | None) -> None:
        during = f" during stage '{stage}'; a rerun resumes it" if stage else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{during}")
        self.signum = signum
        self.exit_status = 128 + signum


def descendants(pid: int) -> list[int]:
    """Every process below pid, from /proc (empty where there is none): torchrun starts each worker in a session
    of its own, out of reach of a signal to the stage's group."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(name))
    found, pending = [], [pid]
    while pending:
        below = children.get(pending.pop(), [])
        found += below
        pending += below
    return found


def signal_stage(process: subprocess.Popen, signum: int) -> None:
    """signum to the stage's process group; SIGKILL to every process below the stage as well."""
    targets = descendants(process.pid) if signum == signal.SIGKILL else []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


class SignalForwarding:
    """The launcher's SIGTERM and SIGINT handler: while a stage runs, the signal goes to it (the launcher carries
    on reading its output until it ends); between stages, the launcher stops at once (Stopped)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.process: subprocess.Popen | None = None
        self.starting = False  # between deciding to start a stage and knowing its process

    def handle(self, signum: int, frame: FrameType | None) -> None:
        again = self.signum is not None
        self.signum = signum
        if self.process is not None:
            signal_stage(self.process, signal.SIGKILL if again else signum)
        elif not self.starting:
            raise Stopped(signum, None)

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalForwarding]:
        """The handler for the block (the previous ones restored after: tests run the launcher in-process)."""
        previous = {signum: signal.signal(signum, self.handle) for signum in STOP_SIGNALS}
        self.signum = None
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around a stage's start and run: a signal while it starts is passed on once its process exists."""
        self.starting = True
        try:
            yield
        finally:
            self.process, self.starting = None, False

    def started(self, process: subprocess.Popen) -> None:
        self.process = process
        if self.signum is not None:
            signal_stage(process, self.signum)


FORWARDING = SignalForwarding()


class StageOutput(NamedTuple):
    """How a stage's process ended, and everything it wrote to stdout and stderr."""

    status: int
    output: str


def stream(command: list[str], stdin: str | None, log: BinaryIO) -> StageOutput:
    """Run command in a session of its own, copying its output as it comes (progress bars included) to stdout and
    log; FORWARDING passes the launcher's stop signals on to it."""
    with FORWARDING.running():
        process = subprocess.Popen(command, stdin=subprocess.PIPE if stdin is not None else None,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        FORWARDING.started(process)
        assert process.stdout is not None  # stdout=PIPE above
        if stdin is not None:
            assert process.stdin is not None  # stdin=PIPE above when there is input
            with contextlib.suppress(BrokenPipeError):  # a stage that ended first says why in its output
                process.stdin.write(stdin.encode())
                process.stdin.close()
        output = bytearray()
        while True:
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                break
            output += chunk
            log.write(chunk)
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return StageOutput(process.wait(), output.decode(errors="replace"))
