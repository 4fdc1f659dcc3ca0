"""Running the toolkit's scripts as users run them, and checking the contract of how they end.

    run_script(args, nproc, script)   python (or torchrun with nproc processes) in a subprocess
    run_in_process(script, args)      the script's main() through run_cli in this process: no interpreter start-up
    refuse(script, args, in_process)  a bad-input run, either way
    assert_ok(result)                 exit 0, or the output's tail in the failure
    check_refused(result, expected)   exit 2 with one `error:` line holding `expected`, no traceback

run_script and run_in_process both return what subprocess.run returns (returncode, stdout, stderr), so one check
serves both.
"""

import contextlib
import importlib
import io
import logging
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

from lorakit.commands import module_of_script

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINING = os.path.join(REPO, "scripts", "training")
PT_SCRIPT = os.path.join(TRAINING, "run_clm_pt_with_peft.py")
SFT_SCRIPT = os.path.join(TRAINING, "run_sft_with_peft.py")
KILL_WRAPPER = os.path.join(REPO, "tests", "helpers", "run_and_kill.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def options_to_argv(options: dict) -> list:
    args = []
    for key, value in options.items():
        if value is None:
            continue
        if value is True:
            args.append(f"--{key}")
        else:
            args += [f"--{key}", str(value)]
    return args


def run_script(args, nproc: int = 1, script: str = PT_SCRIPT, wrapper: list = None, timeout: int = 600):
    """Run a training script the way users do: python, or torchrun with nproc processes."""
    command = [sys.executable]
    if nproc > 1:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    command += (wrapper or []) + [script] + [str(a) for a in args]
    return subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=timeout)


def run_in_process(script: str, args: list) -> SimpleNamespace:
    """A script's main() run through run_cli in this process with args as its argv: returncode, stdout and
    stderr as run_script gives them. A process start with transformers, peft and DeepSpeed imported costs
    ~11 s; the subprocess tests prove the same contract end to end."""
    from lorakit.core.cli import run_cli

    module = importlib.import_module(module_of_script(script))
    root = logging.getLogger()
    saved_argv, saved_handlers, saved_level = sys.argv, root.handlers[:], root.level
    stdout, stderr = io.StringIO(), io.StringIO()
    sys.argv = [script] + [str(a) for a in args]
    try:
        # The script's logging binds the root logger to these buffers: restored below for later tests.
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            run_cli(module.main)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.argv = saved_argv
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    return SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())


def refuse(script: str, args: list, in_process: bool):
    """Run a bad-input case: in a subprocess (the whole contract, interpreter included) or in-process through
    the same run_cli (fast)."""
    return run_in_process(script, args) if in_process else run_script(args, script=script)


def assert_ok(result) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def check_refused(result, expected: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and expected in error_lines[0], result.stderr[-3000:]
