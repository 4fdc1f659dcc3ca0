"""The bad-input contract every script keeps: an InputError becomes one line on stderr naming
file, line and field, and exit status 2, with no traceback. Kept free of heavy imports so the
merge tools, which start with torch alone, share it with the training scripts."""

import logging
import os
import sys
from typing import Callable


class InputError(Exception):
    """Bad input from the user: reported as one line naming file, line and field, exit status 2."""


def run_cli(main: Callable[[], None]) -> None:
    """Run a script's main(); turn an InputError into one clear line on stderr and exit 2."""
    try:
        main()
        leave_process_group()
    except InputError as err:
        message = " ".join(str(err).split())  # one line, whatever the message's origin
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def leave_process_group() -> None:
    """In a multi-process run, every rank waits for the others at the end, then the process ends
    at once. Left to interpreter exit (or to destroy_process_group), a rank can tear gloo's and
    DeepSpeed's C++ state down while a peer still talks to it and abort ("terminate called
    without an active exception", exit -6) after a complete run, failing the whole torchrun.
    Everything the run writes is on disk once every rank has passed the barrier, so skipping the
    teardown loses nothing. torch is looked up, not imported: the merge tools never load it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    torch.distributed.barrier()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
