"""A training script's main() run in a fresh process of its own, forked from a server process that imported the
toolkit once: a real process (its own memory, killable with SIGKILL, nothing carried over from the test process or
an earlier run) without the ~7 s of interpreter start and imports that each subprocess pays. The resume tests run
a reference and a chain of killed and resumed processes this way.

The server is multiprocessing's forkserver, started once per test session: a fresh interpreter, so no thread pool
exists when it forks (forking the test process itself, which has run OpenMP, hangs the child's first parallel op).

    run_forked(script, args, probes, log_path)   the script's main() through run_cli with argv args and
        helpers/step_probe.py's probes installed, its output in log_path: returncode (the negative signal number
        when killed) and stdout (stdout and stderr together), as run_script gives them
"""

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from types import SimpleNamespace

from helpers.commands import script_env
from helpers.step_probe import Probes, probes_installed
from lorakit.commands import COMMANDS, module_of_script
from lorakit.core.cli import run_cli

STAGE_MODULES = [COMMANDS[name].module for name in ("pt", "sft", "reward", "dpo", "ppo")]

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
context = multiprocessing.get_context("forkserver")
context.set_forkserver_preload(STAGE_MODULES + ["helpers.forked_runs"])


def main_in_this_process(script: str, args: list, probes: Probes, log_path: str) -> None:
    """The forked process's body: output to log_path, then the script as run_script runs it."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.argv = [script] + [str(arg) for arg in args]
    module = importlib.import_module(module_of_script(script))
    try:
        with probes_installed(probes):
            run_cli(module.main)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def start_server() -> None:
    """Start the server (once) in the environment run_script gives a subprocess. Its preload imports
    helpers.forked_runs from tests/ (pytest's rootdir for the tests, given here in PYTHONPATH) and the stages from
    the installed package."""
    saved = dict(os.environ)
    os.environ.update(script_env(), PYTHONPATH=TESTS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_forked(script: str, args: list, probes: Probes, log_path: str, timeout: int = 600) -> SimpleNamespace:
    start_server()
    process = context.Process(target=main_in_this_process, args=(script, args, probes, str(log_path)))
    process.start()
    process.join(timeout)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise TimeoutError(f"{script} ran over {timeout} s; its output is in {log_path}")
    with open(log_path, encoding="utf-8", errors="replace") as handle:
        output = handle.read()
    return SimpleNamespace(returncode=process.exitcode, stdout=output, stderr="")
