"""torchrun, keeping the bad-input contract through the launcher: when every failed process
exited 2 (an InputError, already reported as one line naming file, line and field), the job
exits 2 without torchrun's own traceback and failure report. Any other failure is torchrun's."""

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

INPUT_ERROR_STATUS = 2


def main() -> None:
    try:
        run(parse_args(sys.argv[1:]))
    except ChildFailedError as err:
        if {failure.exitcode for failure in err.failures.values()} == {INPUT_ERROR_STATUS}:
            sys.exit(INPUT_ERROR_STATUS)
        raise


if __name__ == "__main__":
    main()
