"""Argument files: `script.py my.yaml --flag value` takes the file first and lets the command line
win, also behind the `--local_rank=N` the DeepSpeed launcher puts first; bad files are one line."""

import json

import pytest

from lorakit.commands import module_of_script
from lorakit.core.cli import InputError, parse_args
from lorakit.models.arguments import ModelArguments
from lorakit.trainers.arguments import ToolkitTrainingArguments

CONFIG = """\
model_name_or_path: base
lora_rank: 16
learning_rate: 1e-4          # YAML reads this as a string: it is parsed like a typed flag
bf16: false
evaluation_strategy: steps   # an old flag, mapped as on the command line
output_dir: out
"""


def parsed(argv):
    return parse_args((ModelArguments, ToolkitTrainingArguments), argv)


@pytest.mark.parametrize("launcher", [[], ["--local_rank=0"], ["--local_rank", "0"]])
def test_file_then_command_line(tmp_path, launcher):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    model_args, training_args = parsed(launcher + [str(path), "--learning_rate", "3e-4", "--lora_rank", "8"])
    assert (model_args.model_name_or_path, model_args.lora_rank) == ("base", 8)
    assert training_args.learning_rate == 3e-4 and training_args.output_dir == "out"
    assert training_args.eval_strategy == "steps"
    assert training_args.local_rank == (0 if launcher else -1)


def test_json_file_alone(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model_name_or_path": "base", "output_dir": "out", "trainable": "q_proj,v_proj",
                                "num_train_epochs": 2}))
    model_args, training_args = parsed([str(path)])
    assert model_args.trainable == "q_proj,v_proj" and training_args.num_train_epochs == 2


@pytest.mark.parametrize("text, message", [
    ("model_name_or_path: base\nlora_rnak: 8\n", "run.yaml: field 'lora_rnak' is not an argument of this script"),
    ("- a\n- b\n", "run.yaml: argument file must hold a mapping"),
    ("model_name_or_path: [base\n", "run.yaml:2: argument file is not valid YAML"),
])
def test_bad_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=message.replace("[", r"\[")):
        parsed([str(path), "--output_dir", "o"])


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="nope.yaml: argument file does not exist"):
        parsed([str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize("script", ["run_clm_pt_with_peft", "run_sft_with_peft", "run_reward", "run_ppo",
                                    "run_dpo"])
@pytest.mark.parametrize("launcher", [[], ["--local_rank=0"]])
def test_every_training_script_takes_a_file_and_overrides(tmp_path, script, launcher):
    """Each script's own argument table (ARGUMENT_CLASSES, what main() parses): the file first, the
    command line wins, behind the launcher's --local_rank too. PPO maps model_name_or_path to its actor."""
    import importlib

    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    classes = importlib.import_module(module_of_script(script + ".py")).ARGUMENT_CLASSES
    needed = ["--reward_model_name_or_path", "rm"] if script == "run_ppo" else []  # PPO's one required flag
    model_args, _, training_args = parse_args(classes, launcher + [str(path), "--learning_rate", "3e-4",
                                                                   "--lora_rank", "8", *needed])
    model = getattr(model_args, "actor_model_name_or_path", None) or model_args.model_name_or_path
    assert (model, model_args.lora_rank, training_args.learning_rate) == ("base", 8, 3e-4)
    assert training_args.output_dir == "out" and training_args.local_rank == (0 if launcher else -1)
