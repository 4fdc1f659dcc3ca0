"""Argument files: `script.py my.yaml --flag value` takes the file first and lets the command line
win, also behind the `--local_rank=N` the DeepSpeed launcher puts first; bad files are one line."""

import json

import pytest

from cli import InputError, parse_args
from model_utils import ModelArguments
from training_utils import ToolkitTrainingArguments

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
