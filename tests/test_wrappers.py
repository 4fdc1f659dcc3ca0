"""The run_*.sh wrappers: torchrun on the GPUs visible (not a fixed 8), the multi-node variables
passed through, and bad input still one line with exit status 2 through the wrapper."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from helpers.commands import REPO, free_port

WRAPPERS = {"run_pt.sh": "run_clm_pt_with_peft.py", "run_sft.sh": "run_sft_with_peft.py",
            "run_rm.sh": "run_reward.py", "run_ppo.sh": "run_ppo.py", "run_dpo.sh": "run_dpo.py"}
REQUIRED = {"MODEL": "m", "DATA": "d", "ACTOR": "a", "REWARD": "r", "CRITIC": "c", "SFT_MODEL": "s"}


def wrapper_command(name: str, env: dict, *args: str) -> list:
    """The torchrun command a wrapper would run (DRY_RUN=1), as a list of arguments."""
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "NPROC", "NNODES")}
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "training", name), *args],
                            env={**base, **REQUIRED, "DRY_RUN": "1", **env}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout)


def option(command: list, name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_process_count_follows_the_visible_gpus(name):
    command = wrapper_command(name, {"CUDA_VISIBLE_DEVICES": "0,1,2"}, "--max_steps", "5")
    assert os.path.basename(command[1]) == "launch.py" and option(command, "--nproc_per_node") == "3"
    script = next(arg for arg in command[2:] if arg.endswith(".py"))
    assert os.path.basename(script) == WRAPPERS[name]
    assert command[-2:] == ["--max_steps", "5"]  # the user's arguments come last and win
    assert option(wrapper_command(name, {"CUDA_VISIBLE_DEVICES": ""}), "--nproc_per_node") == "1"
    assert option(wrapper_command(name, {"CUDA_VISIBLE_DEVICES": "0,1", "NPROC": "4"}), "--nproc_per_node") == "4"


def test_multi_node_variables_pass_through():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "NNODES": "2", "NODE_RANK": "1",
           "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29611"}
    command = wrapper_command("run_sft.sh", env)
    assert [option(command, f) for f in ("--nnodes", "--node_rank", "--master_addr", "--master_port")] == \
        ["2", "1", "10.0.0.7", "29611"]
    assert option(command, "--nproc_per_node") == "8"


def test_bad_input_through_a_wrapper(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    data.mkdir()
    good = json.dumps({"instruction": "q", "output": "a"})
    (data / "sft.jsonl").write_text(good + "\n{broken\n")
    output = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "MODEL": str(tiny_model_dir),
           "DATA": str(data), "OUTPUT": str(output), "MASTER_PORT": "29617"}
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "training", "run_sft.sh"),
                             "--bf16", "False", "--torch_dtype", "float32", "--use_cpu", "--max_seq_length", "128"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {data / 'sft.jsonl'}:2: not valid JSON (Expecting property name enclosed in double "
                      "quotes at column 2)"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (output / "sft_lora_model").exists()


@pytest.mark.slow
def test_bad_input_with_two_processes_is_one_line_and_exit_2(tmp_path, tiny_model_dir):
    """Under torchrun every rank meets the same bad input: the user still sees one line and exit 2, not a line
    per rank followed by torchrun's ChildFailedError report and exit 1."""
    data = tmp_path / "pairs"
    data.mkdir()
    (data / "pairs.jsonl").write_text("")
    output = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "NPROC": "2",
           "MODEL": str(tiny_model_dir), "DATA": str(data), "OUTPUT": str(output), "MASTER_PORT": str(free_port())}
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "training", "run_rm.sh"),
                             "--bf16", "False", "--torch_dtype", "float32", "--use_cpu", "--max_seq_length", "128"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {data / 'pairs.jsonl'}: file holds no records (empty)"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    assert "exitcode" not in result.stderr and "closing signal" not in result.stderr, result.stderr[-3000:]
    # The wrapper's default cache lies next to OUTPUT: neither is created.
    assert not output.exists() and not (tmp_path / "data_cache").exists()


@pytest.mark.slow
def test_a_diverged_two_process_run_is_one_line_and_exit_3(tmp_path, tiny_model_dir, pretrain_dir):
    """Every rank sees the same (all-reduced) NaN loss and stops at the same step: one line, the run's own exit
    status, and nothing saved after the last finite checkpoint."""
    output = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "NPROC": "2",
           "MODEL": str(tiny_model_dir), "DATA": pretrain_dir, "OUTPUT": str(output), "MASTER_PORT": str(free_port())}
    # Adam moves each weight by about the learning rate: finite after step 1, overflowing from step 2 on.
    overrides = {"bf16": "False", "torch_dtype": "float32", "block_size": "32", "per_device_train_batch_size": "2",
                 "gradient_accumulation_steps": "1", "learning_rate": "1e30", "lr_scheduler_type": "constant",
                 "warmup_steps": "0", "logging_steps": "1", "save_steps": "1", "max_steps": "8", "lora_rank": "4",
                 "lora_alpha": "8", "lora_dropout": "0", "preprocessing_num_workers": "1", "report_to": "none"}
    args = [token for name, value in overrides.items() for token in (f"--{name}", value)]
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "training", "run_pt.sh"), "--use_cpu", *args],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "at 3 logged step(s) in a row (steps 2, 3, 4;" in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    assert sorted(p.name for p in output.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]
    assert not (output / "pt_lora_model").exists()


def test_a_misspelled_flag_through_a_wrapper_is_one_line(tmp_path, tiny_model_dir):
    """The user's flags pass through the wrapper and torchrun to the script, which names the mistake once; an
    abbreviation is not taken for the flag it abbreviates (the data, broken here, is never read)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "sft.jsonl").write_text("{broken\n")
    output = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "MODEL": str(tiny_model_dir),
           "DATA": str(data), "OUTPUT": str(output), "MASTER_PORT": str(free_port())}
    result = subprocess.run(["bash", os.path.join(REPO, "scripts", "training", "run_sft.sh"), "--use_cpu",
                             "--learning_rat", "3e-4"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --learning_rat is not an argument of this script (did you mean --learning_rate?)"], \
        result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not output.exists() and not (tmp_path / "data_cache").exists()
