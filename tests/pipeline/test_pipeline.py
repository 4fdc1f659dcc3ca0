"""scripts/run_pipeline.py: the whole path on the tiny fixtures in one command, chained for real
(vocabulary extension -> pretraining -> merge -> SFT -> reward -> PPO -> merge -> chat), its rerun
rules (skip, resume after SIGKILL, a changed stage reruns what follows) and its refusals."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from helpers.commands import REPO, assert_ok, check_refused, run_in_process, script_env
from helpers.corpora import generated_corpus, write_lines
from helpers.merge_tools import TOLERANCE
from helpers.pipeline_runs import PIPELINE, STEPS, actions, run_pipeline, words, write_config, write_jsonl


@pytest.fixture(scope="module")
def chain_data(tmp_path_factory, pretrain_dir):
    """Every stage's data: a corpus to extend the vocabulary on, pretraining text, alpaca records,
    preference pairs and prompts."""
    root, rng = tmp_path_factory.mktemp("pipeline_data"), random.Random(0)
    write_lines(root / "vocab" / "corpus.txt", generated_corpus(1500, seed=3))
    write_jsonl(root / "sft" / "train.jsonl",
                [{"instruction": words(rng, 2, 5), "output": words(rng, 2, 5)} for _ in range(48)])
    pairs = []
    for _ in range(48):
        answer = words(rng, 3, 6)
        pairs.append({"prompt": words(rng, 2, 5), "chosen": answer + " 很好", "rejected": answer})
    write_jsonl(root / "rm" / "pairs.jsonl", pairs)
    write_jsonl(root / "ppo" / "prompts.jsonl", [{"instruction": words(rng, 2, 5)} for _ in range(32)])
    return {"root": root, "pt": pretrain_dir}


def chain_config(data, model_dir, output_dir) -> dict:
    root = data["root"]
    return {
        "base_model": model_dir,
        "output_dir": str(output_dir),
        "deployment": {"mode": "single_node", "nproc_per_node": 1},
        "training_flags": {"use_cpu": True, "data_cache_dir": str(output_dir / "cache"), **STEPS},
        "stages": [
            {"stage": "vocabulary", "train_corpus": str(root / "vocab" / "corpus.txt"), "vocab_size": 400,
             "num_threads": 1},
            {"stage": "pretraining", "dataset_dir": data["pt"], "block_size": 32, "per_device_train_batch_size": 4,
             "modules_to_save": "embed_tokens,lm_head"},
            {"stage": "merge", "name": "pt_merged"},
            {"stage": "sft", "dataset_dir": str(root / "sft"), "template": "human_assistant",
             "max_seq_length": 64, "per_device_train_batch_size": 4},
            {"stage": "reward", "dataset_dir": str(root / "rm"), "template": "human_assistant",
             "max_seq_length": 64, "per_device_train_batch_size": 4},
            {"stage": "ppo", "data_path": str(root / "ppo" / "prompts.jsonl"), "template": "human_assistant",
             "max_prompt_seq_len": 24, "max_answer_seq_len": 8, "per_device_generation_batch_size": 4,
             "per_device_training_batch_size": 4, "max_steps": 1, "save_steps": 1},
            {"stage": "merge", "name": "final"},
            {"stage": "chat", "turns": ["今天 天气", "the river"], "max_new_tokens": 8},
        ],
    }


@pytest.fixture(scope="module")
def uninterrupted(chain_data, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline_run")
    config = chain_config(chain_data, tiny_model_dir, root / "out")
    path = write_config(root / "pipeline.yaml", config)
    result = run_pipeline(path)
    assert_ok(result)
    return {"root": root, "config": config, "config_path": path, "result": result}


@pytest.mark.slow
def test_the_chain_runs_every_stage_and_the_final_model_is_every_adapter_in_order(uninterrupted, tiny_model_dir):
    """vocabulary -> pretraining -> merge -> SFT -> reward -> PPO -> merge -> chat, each stage starting
    from the previous one's output: the final model carries the extended vocabulary and equals the
    base with the pretraining adapter and then the PPO adapter (which continues SFT's) applied."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = uninterrupted["root"] / "out"
    assert actions(uninterrupted["result"]) == {stage.get("name", stage["stage"]): "run"
                                                for stage in uninterrupted["config"]["stages"]}
    extended = AutoTokenizer.from_pretrained(out / "vocabulary")
    base_tokens = len(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert len(extended) > base_tokens
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.get_input_embeddings().weight.shape[0] == len(extended)
    assert len(AutoTokenizer.from_pretrained(out / "final")) == len(extended)

    expected = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    expected.resize_token_embeddings(len(extended))
    expected = PeftModel.from_pretrained(expected, out / "pretraining" / "pt_lora_model").merge_and_unload()
    expected = PeftModel.from_pretrained(expected, out / "ppo" / "ppo_lora_model").merge_and_unload()
    ids = torch.tensor([extended("今天 天气 很好 the river")["input_ids"]])
    with torch.no_grad():
        difference = (final(ids).logits - expected(ids).logits).abs().max().item()
    assert difference < TOLERANCE
    # Each stage started from the previous one's output, as the commands in its log say.
    sft_log = (out / "logs" / "sft.log").read_text()
    assert f"--model_name_or_path {out / 'pt_merged'}" in sft_log
    ppo_log = (out / "logs" / "ppo.log").read_text()
    assert f"--actor_lora_model {out / 'sft' / 'sft_lora_model'}" in ppo_log
    assert f"--reward_lora_model {out / 'reward' / 'rm_lora_model'}" in ppo_log
    transcript = (out / "chat" / "transcript.txt").read_text()
    assert transcript.count("User: ") == 2


@pytest.mark.slow
def test_a_rerun_skips_everything_and_a_changed_reward_stage_reruns_it_and_what_follows(uninterrupted, tmp_path):
    """On a copy of the finished run: a rerun skips every stage; a new reward learning rate reruns
    reward and PPO, leaves the stages before reward untouched, and leaves the final merge and chat
    to rerun (their inputs changed)."""
    from helpers.run_outputs import adapter_weights

    out = tmp_path / "out"
    shutil.copytree(uninterrupted["root"] / "out", out)
    path = write_config(tmp_path / "pipeline.yaml", chain_config_in(uninterrupted["config"], out))
    rerun = run_pipeline(path)
    assert_ok(rerun)
    assert set(actions(rerun).values()) == {"skip"}
    sft_written = (out / "sft" / "sft_lora_model" / "adapter_model.safetensors").stat().st_mtime_ns
    reward_before = adapter_weights(out / "reward" / "rm_lora_model")

    # Up to PPO (--stages): the final merge and chat rerun alike, and a dry run shows it.
    changed = run_pipeline(path, "reward.learning_rate=1e-2", "--stages",
                           "vocabulary,pretraining,pt_merged,sft,reward,ppo")
    assert_ok(changed)
    assert actions(changed) == {"vocabulary": "skip", "pretraining": "skip", "pt_merged": "skip", "sft": "skip",
                                "reward": "run", "ppo": "run"}
    assert actions(run_pipeline(path, "reward.learning_rate=1e-2", "--dry_run")) == {
        "vocabulary": "skip", "pretraining": "skip", "pt_merged": "skip", "sft": "skip", "reward": "skip",
        "ppo": "skip", "final": "run", "chat": "run"}
    assert (out / "sft" / "sft_lora_model" / "adapter_model.safetensors").stat().st_mtime_ns == sft_written
    reward_after = adapter_weights(out / "reward" / "rm_lora_model")
    assert max((reward_after[name] - reward_before[name]).abs().max().item() for name in reward_before) > 1e-3
    assert "--learning_rate 1e-2" in (out / "logs" / "reward.log").read_text().split("\n$ ")[-1]


KILL_JOB = os.path.join(REPO, "tests", "helpers", "kill_job")  # its sitecustomize.py crashes the job


@pytest.mark.slow
def test_killed_during_sft_a_rerun_skips_what_finished_resumes_sft_and_ends_with_the_same_weights(
        uninterrupted, tmp_path):
    """The finished stages before SFT are copied from the uninterrupted run (same config hashes), so
    this run starts at SFT; the whole job (pipeline, torchrun, worker) is SIGKILLed right after SFT's
    checkpoint-2 is written (helpers/kill_job). The rerun skips what finished, resumes SFT, runs
    reward, PPO and the final merge (--stages leaves out the chat), and its final model equals the
    uninterrupted run's."""
    from safetensors.torch import load_file

    source, out = uninterrupted["root"] / "out", tmp_path / "out"
    path = write_config(tmp_path / "pipeline.yaml", chain_config_in(uninterrupted["config"], out))
    (out / ".pipeline").mkdir(parents=True)
    for name in ("vocabulary", "pretraining", "pt_merged"):
        shutil.copytree(source / name, out / name)
        shutil.copy(source / ".pipeline" / f"{name}.json", out / ".pipeline" / f"{name}.json")
    until_final = ["--stages", "vocabulary,pretraining,pt_merged,sft,reward,ppo,final"]
    crash = {"PYTHONPATH": os.pathsep.join(filter(None, [KILL_JOB, os.environ.get("PYTHONPATH")])),
             "KILL_JOB_AFTER_SAVE": "2", "KILL_JOB_OUTPUT": "sft"}
    killed = subprocess.run([sys.executable, PIPELINE, path, *until_final], cwd=REPO, capture_output=True,
                            text=True, env={**script_env(), **crash}, timeout=600, start_new_session=True)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    assert (out / "sft" / "checkpoint-2" / "trainer_state.json").exists()
    assert not (out / "sft" / "checkpoint-4").exists()
    assert not json.loads((out / ".pipeline" / "sft.json").read_text())["complete"]
    assert not (out / "reward").exists()

    rerun = run_pipeline(path, *until_final)
    assert_ok(rerun)
    assert actions(rerun) == {"vocabulary": "skip", "pretraining": "skip", "pt_merged": "skip", "sft": "resume",
                              "reward": "run", "ppo": "run", "final": "run"}
    assert "resuming from" in (out / "logs" / "sft.log").read_text().split("\n$ ")[-1]
    expected, resumed = (load_file(directory / "final" / "model.safetensors") for directory in (source, out))
    assert expected.keys() == resumed.keys()
    for name in expected:
        assert (expected[name] - resumed[name]).abs().max().item() < 1e-5, name


def chain_config_in(config: dict, output_dir) -> dict:
    """The same config with another output_dir (the data cache stays where it was)."""
    return {**config, "output_dir": str(output_dir)}


BAD_CONFIGS = {
    "unknown stage": (lambda c: c["stages"].append({"stage": "distill"}), "unknown stage 'distill'"),
    "unknown flag": (lambda c: c["stages"][3].update(learning_rat=1e-4), "'learning_rat' is not a flag of"),
    "missing file": (lambda c: c["stages"][3].update(dataset_dir="/nonexistent/sft"), "does not exist"),
    "no reward before ppo": (lambda c: c["stages"].pop(4), "PPO needs a reward model"),
    "sft on an unmerged adapter": (lambda c: c["stages"].pop(2), "left an adapter unmerged"),
    "new rows untrained": (lambda c: c["stages"][1].pop("modules_to_save"), "would never be trained"),
    "output_dir is the pipeline's": (lambda c: c["stages"][3].update(output_dir="x"), "'output_dir' is the pipeline's"),
    "duplicate names": (lambda c: [c["stages"][i].pop("name") for i in (2, 6)], "stage name 'merge' is used twice"),
    "bad deployment": (lambda c: c["deployment"].update(mode="cluster"), "deployment.mode 'cluster'"),
    "merge with nothing to merge": (lambda c: c["stages"].insert(3, {"stage": "merge", "name": "again"}),
                                    "nothing to merge"),
    # A stage named logs would clear OUTPUT/logs/, every stage's log, on its first run.
    "the logs directory as a stage name": (lambda c: c["stages"][3].update(name="logs"),
                                           "stage name 'logs' is reserved"),
    # Each of these was a traceback, or a stage failing after the stages before it had run.
    "a NUL byte in a stage name": (lambda c: c["stages"][3].update(name="s\0ft"),
                                   "stages[4]: 'name' 's\\x00ft' holds a control character"),
    "a NUL byte in a path": (lambda c: c["stages"][3].update(dataset_dir="da\0ta"),
                             "stages[4] ('sft'): 'dataset_dir' holds a NUL byte"),
    "a list where a number belongs": (lambda c: c["stages"][3].update(learning_rate=[1e-4, 2e-4]),
                                      "stage 'sft': 'learning_rate' takes one value, not a list"),
    "a word where a number belongs": (lambda c: c["training_flags"].update(max_steps="many"),
                                      "stage 'pretraining': 'max_steps' takes a whole number, not 'many'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_configs_are_refused_before_anything_runs(case, chain_data, tiny_model_dir, tmp_path):
    """In-process through the same run_cli (a process per case would cost ~10 s of imports each); one
    case through a real process below."""
    config = chain_config(chain_data, tiny_model_dir, tmp_path / "out")
    change, expected = BAD_CONFIGS[case]
    change(config)
    check_refused(run_in_process(PIPELINE, [write_config(tmp_path / "bad.yaml", config)]), expected)
    assert not (tmp_path / "out").exists()


def test_a_bad_config_exits_2_with_one_line_from_a_real_process(chain_data, tiny_model_dir, tmp_path):
    config = chain_config(chain_data, tiny_model_dir, tmp_path / "out")
    config["stages"][3]["learning_rat"] = 1e-4
    check_refused(run_pipeline(write_config(tmp_path / "bad.yaml", config)), "'learning_rat' is not a flag of")
    assert not (tmp_path / "out").exists()


EXAMPLES = os.path.join(REPO, "configs", "pipeline")
# What each shipped example must turn into: torchrun options and flags every training command carries.
EXPECTED_EXAMPLE_COMMANDS = {
    "demo.yaml": ["--nproc_per_node 1 --standalone", "--use_cpu", "--torch_dtype float32"],
    "llama2_7b_chinese_zero2_8gpu.yaml": ["--nproc_per_node 8 --standalone", "--bf16",
                                          "--deepspeed ds_configs/ds_zero2_no_offload.json"],
    "llama2_13b_zero3_8gpu.yaml": ["--nproc_per_node 8 --standalone",
                                   "--deepspeed ds_configs/ds_zero3_no_offload.json"],
    "qlora_single_24gb.yaml": ["--nproc_per_node 1 --standalone", "--load_in_kbits 4"],
    "two_node_zero2.yaml": ["--nproc_per_node 8 --nnodes 2 --node_rank 0 --master_addr 10.0.0.1 "
                            "--master_port 29500", "--deepspeed ds_configs/ds_zero2_no_offload.json"],
}


def referenced_paths(config: dict) -> set:
    """The relative paths an example names (its model and data): made in a scratch directory."""
    from lorakit.pipeline.stages import PATH_FLAGS

    values = [config["base_model"]] + [stage.get(flag) for stage in config["stages"] for flag in PATH_FLAGS]
    return {value for value in values if isinstance(value, str) and not value.startswith("/")}


@pytest.mark.parametrize("name", sorted(EXPECTED_EXAMPLE_COMMANDS))
def test_the_shipped_example_configs_parse_and_dry_run_into_the_expected_commands(name, tmp_path, monkeypatch):
    """Every flag of every example is one its stage's script accepts (or the plan is refused), and
    the commands carry the deployment's torchrun options and the example's recipe."""
    assert sorted(os.listdir(EXAMPLES)) == sorted(EXPECTED_EXAMPLE_COMMANDS)
    config = yaml.safe_load(open(os.path.join(EXAMPLES, name), encoding="utf-8"))
    for path in referenced_paths(config):  # files end in an extension, directories do not
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch() if os.path.splitext(path)[1] else target.mkdir(exist_ok=True)
    shutil.copytree(os.path.join(REPO, "ds_configs"), tmp_path / "ds_configs")
    monkeypatch.chdir(tmp_path)
    result = run_in_process(PIPELINE, [os.path.join(EXAMPLES, name), "--dry_run"])
    assert_ok(result)
    commands = [line for line in result.stdout.splitlines() if line.startswith("pipeline: $ ")]
    assert len(commands) == len(config["stages"]) and set(actions(result).values()) == {"run"}
    training = [command for command in commands if "-m lorakit launch" in command]
    assert training and all(expected in command for command in training
                            for expected in EXPECTED_EXAMPLE_COMMANDS[name])
    for written in (".pipeline", "logs"):  # a dry run writes nothing
        assert not os.path.exists(os.path.join(config["output_dir"], written))


def command_name(words: list) -> str:
    """The toolkit command a stage's command line runs: the word after its last `-m lorakit`."""
    return words[max(i for i, word in enumerate(words) if word == "lorakit") + 1]


def test_dpo_stage_folds_the_sft_adapter_and_leaves_both_adapters_to_the_merge(chain_data, tiny_model_dir, tmp_path):
    """sft -> dpo -> merge -> chat, dry run: DPO starts from the base with the SFT adapter as --peft_path, the
    merge applies the SFT adapter and then DPO's, the chat loads the merged model. Without the merge the chat
    (which loads one adapter) is refused before anything runs."""
    import shlex

    out, pairs = tmp_path / "out", str(chain_data["root"] / "rm")
    stages = [{"stage": "sft", "dataset_dir": str(chain_data["root"] / "sft"), "template": "human_assistant"},
              {"stage": "dpo", "dataset_dir": pairs, "template": "human_assistant", "loss_type": "ipo"},
              {"stage": "merge"}, {"stage": "chat", "turns": ["今天 天气"]}]
    config = {"base_model": tiny_model_dir, "output_dir": str(out), "training_flags": {"use_cpu": True, **STEPS},
              "deployment": {"mode": "single_node", "nproc_per_node": 1}, "stages": stages}
    result = run_in_process(PIPELINE, [write_config(tmp_path / "dpo.yaml", config), "--dry_run"])
    assert_ok(result)
    commands = [shlex.split(line[len("pipeline: $ "):]) for line in result.stdout.splitlines()
                if line.startswith("pipeline: $ ")]
    flags = [{word: command[i + 1] for i, word in enumerate(command[:-1]) if word.startswith("--")}
             for command in commands]
    sft_adapter, dpo_adapter = str(out / "sft" / "sft_lora_model"), str(out / "dpo" / "dpo_lora_model")
    assert [command_name(c) for c in commands] == ["sft", "dpo", "merge", "chat"]
    assert flags[1]["--model_name_or_path"] == tiny_model_dir and flags[1]["--peft_path"] == sft_adapter
    assert flags[1]["--output_dir"] == str(out / "dpo") and flags[1]["--loss_type"] == "ipo"
    assert "--use_cpu" in commands[1] and "--nproc_per_node" in commands[1]
    assert flags[2]["--base_model"] == tiny_model_dir and flags[2]["--lora_model"] == f"{sft_adapter},{dpo_adapter}"
    assert flags[3]["--base_model"] == str(out / "merge") and "--lora_model" not in flags[3]
    assert not out.exists()  # a dry run writes nothing

    del stages[2]
    refused = run_in_process(PIPELINE, [write_config(tmp_path / "no_merge.yaml", config)])
    check_refused(refused, "stage 'chat': takes one adapter, but stage 'dpo' left two unmerged")
    assert not out.exists()


def test_grpo_stage_continues_the_sft_adapter_with_reward_functions_or_the_reward_stage(chain_data, tiny_model_dir,
                                                                                        tmp_path):
    """sft -> reward -> grpo -> merge, dry run: GRPO starts from the base with the SFT adapter as --peft_path,
    its reward functions given as a list; without them it takes the reward stage's adapter; without either it is
    refused before anything runs; the merge applies GRPO's adapter."""
    import shlex

    out, root = tmp_path / "out", chain_data["root"]
    rewards = tmp_path / "rewards.py"
    rewards.write_text("def marker(completions, **kwargs):\n    return [0.0 for _ in completions]\n")
    grpo = {"stage": "grpo", "data_path": str(root / "ppo" / "prompts.jsonl"), "template": "human_assistant",
            "reward_funcs": ["think_format", f"{rewards}:marker"], "num_generations": 4}
    stages = [{"stage": "sft", "dataset_dir": str(root / "sft"), "template": "human_assistant"},
              {"stage": "reward", "dataset_dir": str(root / "rm"), "template": "human_assistant"},
              grpo, {"stage": "merge"}]
    config = {"base_model": tiny_model_dir, "output_dir": str(out), "training_flags": {"use_cpu": True, **STEPS},
              "deployment": {"mode": "single_node", "nproc_per_node": 1}, "stages": stages}

    def dry_run(name):
        result = run_in_process(PIPELINE, [write_config(tmp_path / f"{name}.yaml", config), "--dry_run"])
        assert_ok(result)
        return [shlex.split(line[len("pipeline: $ "):]) for line in result.stdout.splitlines()
                if line.startswith("pipeline: $ ")]

    commands = dry_run("functions")
    assert [command_name(c) for c in commands] == ["sft", "reward", "grpo", "merge"]
    words = commands[2]
    assert words[words.index("--peft_path") + 1] == str(out / "sft" / "sft_lora_model")
    assert words[words.index("--reward_funcs") + 1 : words.index("--reward_funcs") + 3] == [
        "think_format", f"{rewards}:marker"]
    assert "--reward_lora_model" not in words
    assert commands[3][commands[3].index("--lora_model") + 1] == str(out / "grpo" / "grpo_lora_model")
    del grpo["reward_funcs"]
    words = dry_run("reward_model")[2]
    assert words[words.index("--reward_lora_model") + 1] == str(out / "reward" / "rm_lora_model")
    grpo["reward_funcs"] = [str(tmp_path / "missing.py") + ":marker"]
    refused = run_in_process(PIPELINE, [write_config(tmp_path / "missing_reward.yaml", config)])
    check_refused(refused, f"reward_funcs {tmp_path / 'missing.py'} does not exist")
    del stages[1], grpo["reward_funcs"]
    refused = run_in_process(PIPELINE, [write_config(tmp_path / "no_reward.yaml", config)])
    check_refused(refused, "stage 'grpo': GRPO needs a reward: give reward_funcs")
    assert not out.exists()
