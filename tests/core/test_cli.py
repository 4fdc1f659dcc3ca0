"""Argument files: `script.py my.yaml --flag value` takes the file first and lets the command line
win, also behind the `--local_rank=N` the DeepSpeed launcher puts first; bad files are one line."""

import json
import re

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
    ("model_name_or_path: base\nlora_rnak: 8\n",
     "run.yaml: field 'lora_rnak' is not an argument of this script (did you mean 'lora_rank'?)"),
    ("- a\n- b\n", "run.yaml: argument file must hold a mapping"),
    ("model_name_or_path: [base\n", "run.yaml:2: argument file is not valid YAML"),
])
def test_bad_files_are_one_line(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=re.escape(message)):
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


# ----------------------------------------------------------------------------- unknown and abbreviated flags

REPO_SCRIPTS = {"run_clm_pt_with_peft": "training", "run_sft_with_peft": "training", "run_reward": "training",
                "run_dpo": "training", "run_ppo": "training", "estimate_memory": "training", "chat": "inference",
                "openai_api_server": "inference", "merge_llama_with_lora": "merge", "merge_tokenizers": "merge"}
# Per script: a prefix of one of its flags (argparse's abbreviation matching took it silently) and that flag.
ABBREVIATED = {"estimate_memory": ("--model_name_or_pat", "--model_name_or_path"),
               "chat": ("--base_mod", "--base_model"), "openai_api_server": ("--base_mod", "--base_model"),
               "merge_llama_with_lora": ("--base_mod", "--base_model"),
               "merge_tokenizers": ("--base_tok", "--base_tokenizer")}
FLAG_CASES = [(script, case) for script in REPO_SCRIPTS for case in ("unknown", "abbreviated")]


@pytest.mark.parametrize("script,case", FLAG_CASES, ids=[f"{script}-{case}" for script, case in FLAG_CASES])
def test_an_unknown_or_abbreviated_flag_is_one_line_naming_the_closest(tmp_path, script, case):
    """Every entry script, in-process through run_cli: `--bogus_flag 1` was HfArgumentParser's ValueError traceback
    (exit 1); a prefix of a flag was taken for it without a word. Refused before anything is read or written."""
    from helpers.commands import REPO, check_refused, run_in_process

    flag, meant = ABBREVIATED.get(script, ("--learning_rat", "--learning_rate"))
    args = ["--bogus_flag", "1"] if case == "unknown" else [flag, "1"]
    result = run_in_process(f"{REPO}/scripts/{REPO_SCRIPTS[script]}/{script}.py",
                            args + ["--output_dir", str(tmp_path / "out")])
    expected = ("--bogus_flag is not an argument of this script (--help lists them)" if case == "unknown"
                else f"{flag} is not an argument of this script (did you mean {meant}?)")
    check_refused(result, expected)
    assert not (tmp_path / "out").exists()


def test_a_misspelled_flag_is_named_before_a_required_one_is_missed():
    """The merge's --base_model is required: `--base_modle` is named as the mistake, not `--base_model` as missing."""
    from lorakit.merge.merge_config import parse_args as merge_args

    with pytest.raises(InputError, match=r"--base_modle is not an argument of this script \(did you mean "
                                         r"--base_model\?\)"):
        merge_args(["--base_modle", "b", "--lora_model", "l", "--output_dir", "o"])
    with pytest.raises(InputError, match="unexpected argument 'extra'"):
        merge_args(["--base_model", "b", "--lora_model", "l", "--output_dir", "o", "extra"])
    # A value that looks like a flag is still a value where argparse takes it as one: a negative number.
    args = merge_args(["--base_model", "b", "--lora_model", "l", "--output_dir", "o", "--chunk_mb", "-2"])
    assert args.chunk_mb == -2


def test_the_launcher_refuses_its_own_unknown_flags_and_passes_the_scripts_on():
    from lorakit.commands.launch import parse_launch_args

    with pytest.raises(InputError, match=r"--nproc is not an argument of the launcher \(torchrun\) \(did you mean "
                                         r"--nproc-per-node or --nproc_per_node\?\)"):
        parse_launch_args(["--nproc", "2", "run_sft_with_peft.py"])
    args = parse_launch_args(["--nproc_per_node", "2", "run_sft_with_peft.py", "--learning_rat", "1"])
    assert args.training_script_args == ["--learning_rat", "1"]  # the script's own, which it refuses itself


def test_command_line_after_a_file_is_checked_too(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    with pytest.raises(InputError, match=r"--lora_rnak is not an argument of this script \(did you mean "
                                         r"--lora_rank\?\)"):
        parsed([str(path), "--lora_rnak", "8"])


def test_an_argument_file_alone_with_a_misspelled_key_is_one_line(tmp_path):
    """The file as the single argument of a real process: one line naming the file and the closest name, exit 2."""
    from helpers.commands import SFT_SCRIPT, check_refused, run_script

    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model_name_or_path": "base", "output_dir": str(tmp_path / "out"),
                                "learning_rat": 1e-4}))
    check_refused(run_script([path], script=SFT_SCRIPT),
                  f"{path}: field 'learning_rat' is not an argument of this script (did you mean 'learning_rate'?)")
    assert not (tmp_path / "out").exists()


def test_the_pipeline_launcher_refuses_unknown_and_abbreviated_flags():
    """The launcher's own flags follow the same rule (its overrides are key=value, never flags)."""
    from lorakit.commands.pipeline import parse_args as pipeline_args

    with pytest.raises(InputError, match=r"--dry_rn is not an argument of this script \(did you mean --dry_run\?\)"):
        pipeline_args(["pipeline.yaml", "--dry_rn"])
    with pytest.raises(InputError, match=r"--from_st is not an argument of this script \(did you mean --from_stage"):
        pipeline_args(["pipeline.yaml", "--from_st", "sft"])
    args = pipeline_args(["pipeline.yaml", "--dry_run", "sft.learning_rate=1e-4"])
    assert args.dry_run and args.overrides == ["sft.learning_rate=1e-4"]
