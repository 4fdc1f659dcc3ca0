"""torchrun, keeping the bad-input contract through the launcher: every process meets the same bad
input (or the same diverged loss), so each leaves its one-line message in torchrun's error file
(core.cli.hand_to_launcher) instead of printing it; when the job failed only on that (the other
processes exited with the same status or were stopped by torchrun after the first), the launcher
prints the first message once and exits with that status (2 for bad input), without torchrun's
traceback and failure report. Any other failure is torchrun's, reported in full."""

import argparse
import logging
import os
import signal
import sys
from typing import NamedTuple

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run

from lorakit.core.cli import LAUNCHER_REPORTS_INPUT_ERRORS, InputError, unknown_flag_error

INPUT_ERROR_STATUS = 2
# What torchrun's agent does to the other processes once one has failed: SIGTERM, then SIGKILL after a grace time.
STOPPED_BY_TORCHRUN = {-signal.SIGTERM, -signal.SIGKILL}
# The agent's own lines about the first failure and stopping the other processes: held back until the failure
# is known to be something other than bad input, which gets one line only.
AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"
AGENT_FAILURE_LINES = ("failed (exitcode", "Sending process")


class HeldBack(logging.Filter):
    """Keeps the agent's failure records instead of letting them through, for replay() to emit later."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(AGENT_FAILURE_LINES):
            return True
        self.records.append(record)
        return False

    def replay(self, logger: logging.Logger) -> None:
        logger.removeFilter(self)
        for record in self.records:
            logger.handle(record)


class ReportedFailure(NamedTuple):
    """How a job failed on what its processes reported themselves: the status to exit with, and the one-line
    message to print (None: every process has printed it already)."""

    status: int
    message: str | None


def reported_failure(err: ChildFailedError) -> ReportedFailure | None:
    """(exit status, message) when every process that failed by itself exited with one status and reported it
    (core.cli.hand_to_launcher: bad input, a diverged run), the message being the earliest one; (2, None) when
    they exited 2 without a message (an argument the parser refused, which every process has printed already);
    None for any other failure."""
    failures = [f for f in err.failures.values() if f.exitcode not in STOPPED_BY_TORCHRUN]
    statuses = {failure.exitcode for failure in failures}
    if len(statuses) != 1:
        return None
    status = statuses.pop()
    reported = [failure for failure in failures if isinstance(failure.message, str)
                and failure.error_file_data.get("message") == failure.message]
    if reported:
        earliest = min(reported, key=lambda failure: (failure.timestamp, failure.local_rank))
        return ReportedFailure(status, earliest.message)
    return ReportedFailure(status, None) if status == INPUT_ERROR_STATUS else None


def parse_launch_args(argv: list[str]) -> argparse.Namespace:
    """torchrun's arguments, without its prefix abbreviations; a flag before the script that torchrun does not know is
    an InputError naming the closest it does. What follows the script is the script's (it refuses its own)."""
    parser = get_args_parser()
    parser.allow_abbrev = False
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise unknown_flag_error(parser, unknown[0].split("=", 1)[0], owner="the launcher (torchrun)")
    return args


def main() -> None:
    try:
        args = parse_launch_args(sys.argv[1:])
    except InputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_status)
    os.environ[LAUNCHER_REPORTS_INPUT_ERRORS] = "1"
    agent_logger = logging.getLogger(AGENT_LOGGER)
    held_back = HeldBack()
    agent_logger.addFilter(held_back)
    try:
        run(args)
    except ChildFailedError as err:
        reported = reported_failure(err)
        if reported is None:
            raise
        held_back.records.clear()  # the agent's lines about it say nothing the message does not
        status, message = reported
        if message is not None:
            print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(status)
    finally:
        held_back.replay(agent_logger)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    main()


if __name__ == "__main__":
    entry_point()
