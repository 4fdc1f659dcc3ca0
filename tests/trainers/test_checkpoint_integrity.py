"""Checkpoint integrity and run identity: a checkpoint counts only once its completion marker is written, after
everything else (a save cut short is skipped, named in the log, and --save_total_limit never removes the last
complete one for it); a resume refuses a checkpoint written by another run (model, data, seed, a shape-changing
setting; PPO's seed and --enable_ema) with exit 2 and nothing written; --overwrite_output_dir removes the earlier
checkpoints once training starts, never before a refusal; and with several nodes rank 0 decides, so a node that
cannot read the checkpoint makes every rank refuse instead of hanging."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from helpers.commands import (
    PT_SCRIPT,
    TRAINING,
    assert_ok,
    check_refused,
    free_port,
    options_to_argv,
    run_in_process,
    script_env,
)
from helpers.run_outputs import adapter_weights, snapshot
from helpers.tiny_runs import tiny_pt_args

PPO_SCRIPT = os.path.join(TRAINING, "run_ppo.py")
LAUNCHER = os.path.join(TRAINING, "launch.py")
MARKER = "checkpoint_complete.json"
# Four steps, a checkpoint every two, only the newest kept: the straight run leaves checkpoint-4 alone.
RUN = {"max_steps": 4, "save_steps": 2, "save_total_limit": 1, "validation_split_percentage": 0}


@pytest.fixture(scope="module")
def straight(tiny_model_dir, pretrain_dir, tmp_path_factory):
    """(root, arguments of a run into root/OUT): one uninterrupted run in root/straight; root/cache is the data
    cache every run of this module shares."""
    root = tmp_path_factory.mktemp("integrity")

    def args(output_dir, model_dir=tiny_model_dir, data_dir=pretrain_dir, **overrides):
        return tiny_pt_args(model_dir, data_dir, output_dir, root / "cache", **{**RUN, **overrides})

    assert_ok(run_in_process(PT_SCRIPT, args(root / "straight")))
    return root, args


def copy_of_straight(straight, tmp_path):
    root, _ = straight
    return shutil.copytree(root / "straight", tmp_path / "out")


class SimulatedCrash(Exception):
    pass


def test_a_save_cut_short_keeps_the_last_complete_checkpoint_and_the_rerun_resumes_from_it(straight, tmp_path,
                                                                                            monkeypatch):
    from lorakit.trainers import checkpoints

    root, args = straight
    out = tmp_path / "crashed"
    write_adapter = checkpoints.save_adapter

    def crash_in_checkpoint_4(model, tokenizer, path, is_main_process):
        if "checkpoint-4" in path:
            raise SimulatedCrash  # after the Trainer's files and its --save_total_limit rotation, before the adapter
        write_adapter(model, tokenizer, path, is_main_process)

    monkeypatch.setattr(checkpoints, "save_adapter", crash_in_checkpoint_4)
    with pytest.raises(SimulatedCrash):
        run_in_process(PT_SCRIPT, args(out))
    monkeypatch.undo()
    assert (out / "checkpoint-4" / "trainer_state.json").is_file() and not (out / "checkpoint-4" / MARKER).exists()
    assert (out / "checkpoint-2" / MARKER).is_file()  # --save_total_limit 1 did not remove it for checkpoint-4

    resumed = run_in_process(PT_SCRIPT, args(out))
    assert_ok(resumed)
    assert f"skipping {out / 'checkpoint-4'}: no {MARKER}: its save did not finish" in resumed.stdout
    assert f"resuming from {out / 'checkpoint-2'}" in resumed.stdout
    expected, actual = adapter_weights(root / "straight" / "pt_lora_model"), adapter_weights(out / "pt_lora_model")
    assert expected.keys() == actual.keys() and all(torch.equal(expected[k], actual[k]) for k in expected)
    # Saved again whole; the rotation then removed checkpoint-2.
    assert (out / "checkpoint-4" / MARKER).is_file() and not (out / "checkpoint-2").exists()
    marker = json.loads((out / "checkpoint-4" / MARKER).read_text())
    assert marker["files"]["pt_lora_model/adapter_model.safetensors"] > 0 and marker["identity"]["--seed"] == 42


def other_copy(source, target):
    return str(shutil.copytree(source, target))


@pytest.mark.parametrize("case", ["model", "data", "seed", "lora_rank", "explicit_resume_batch"])
def test_a_resume_of_another_run_is_refused_and_writes_nothing(case, straight, tiny_model_dir, pretrain_dir,
                                                               tmp_path):
    root, args = straight
    out = copy_of_straight(straight, tmp_path)
    checkpoint = out / "checkpoint-4"
    if case == "model":
        model = other_copy(tiny_model_dir, tmp_path / "model_copy")
        expected = (f'--model_name_or_path "{os.path.realpath(tiny_model_dir)}" (checkpoint) '
                    f'vs "{os.path.realpath(model)}"')
        run = args(out, model_dir=model)
    elif case == "data":
        data = other_copy(pretrain_dir, tmp_path / "data_copy")
        with open(os.path.join(data, "part1.txt"), "a", encoding="utf-8") as handle:
            handle.write("一行新的文字 a new line\n")
        run, expected = args(out, data_dir=data), f"{checkpoint}: written by a run on other data: data pt-"
    elif case == "seed":
        run, expected = args(out, seed=43), "--seed 42 (checkpoint) vs 43 (now)"
    elif case == "lora_rank":
        run, expected = args(out, lora_rank=4), "--lora_rank 8 (checkpoint) vs 4 (now)"
    else:
        out = tmp_path / "elsewhere"
        run = args(out, resume_from_checkpoint=checkpoint, per_device_train_batch_size=2)
        expected = "--per_device_train_batch_size 4 (checkpoint) vs 2 (now)"
    before = snapshot(tmp_path, root / "cache")
    result = run_in_process(PT_SCRIPT, run)
    check_refused(result, expected)
    assert "pass --overwrite_output_dir" in result.stderr
    assert snapshot(tmp_path, root / "cache") == before


@pytest.fixture(scope="module")
def ppo_run(tiny_model_dir, tmp_path_factory):
    """(arguments of a PPO run into OUT, its finished output directory): one iteration, checkpoint-1, on an
    untrained reward adapter (only its score head's presence is checked)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("ppo_integrity")
    reward = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    get_peft_model(reward, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
                   ).save_pretrained(str(root / "rm"))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": f"问题 {n} question"}) + "\n" for n in range(8)))

    def args(output_dir, **overrides):
        options = {"actor_model_name_or_path": tiny_model_dir, "reward_model_name_or_path": tiny_model_dir,
                   "reward_lora_model": root / "rm", "data_path": prompts, "template": "human_assistant",
                   "max_prompt_seq_len": 16, "max_answer_seq_len": 8, "per_device_generation_batch_size": 4,
                   "per_device_training_batch_size": 4, "lora_rank": 4, "lora_dropout": 0.0,
                   "trainable": "q_proj,v_proj", "torch_dtype": "float32", "report_to": "none", "max_steps": 1,
                   "save_strategy": "steps", "save_steps": 1, "output_dir": output_dir, "seed": 1,
                   "data_cache_dir": root / "cache", **overrides}
        return ["--use_cpu"] + options_to_argv(options)

    assert_ok(run_in_process(PPO_SCRIPT, args(root / "out")))
    return args, root / "out"


@pytest.mark.parametrize("case", ["seed", "enable_ema"])
def test_ppo_refuses_a_checkpoint_of_another_seed_or_without_the_ema(case, ppo_run, tmp_path):
    args, finished = ppo_run
    out = shutil.copytree(finished, tmp_path / "out")
    if case == "seed":
        run, expected = args(out, seed=2), "--seed 1 (checkpoint) vs 2 (now)"
    else:  # today's PPO would restart the average from the resumed actor, silently
        run, expected = args(out, enable_ema=True), "--enable_ema false (checkpoint) vs true (now)"
    before = snapshot(tmp_path)
    result = run_in_process(PPO_SCRIPT, run)
    check_refused(result, expected)
    assert f"{out / 'checkpoint-1'}: written by a run that differs from this one" in result.stderr
    assert snapshot(tmp_path) == before


def test_overwrite_removes_the_earlier_checkpoints_only_once_training_starts(straight, tmp_path):
    _, args = straight
    out = copy_of_straight(straight, tmp_path)
    refused = run_in_process(PT_SCRIPT, args(out, overwrite_output_dir=True, block_size=1000))
    check_refused(refused, "--block_size 1000 exceeds the model's max_position_embeddings 256")
    assert (out / "checkpoint-4" / MARKER).is_file()  # a refusal removes nothing

    rerun = run_in_process(PT_SCRIPT, args(out, overwrite_output_dir=True, max_steps=1, save_strategy="no"))
    assert_ok(rerun)
    assert f"--overwrite_output_dir: removing 1 checkpoint(s) of an earlier run in {out}: checkpoint-4" in rerun.stdout
    assert not [name for name in os.listdir(out) if name.startswith("checkpoint-")]


@pytest.mark.slow
def test_a_node_that_cannot_read_rank_zeros_checkpoint_makes_every_rank_refuse(straight, tiny_model_dir,
                                                                               pretrain_dir, tmp_path):
    """Two torchrun "nodes" on this machine, each in its own directory with its own relative --output_dir: node 0's
    holds checkpoint-4, node 1's is empty (an output directory that is not shared). Both refuse, one line each."""
    root, _ = straight
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(root / "straight", nodes[0] / "out")
    (nodes[1] / "out").mkdir(parents=True)
    before = snapshot(nodes[0] / "out")
    port = free_port()
    launchers = []
    for rank, node in enumerate(nodes):
        args = tiny_pt_args(tiny_model_dir, pretrain_dir, "out", node / "cache", **RUN)
        command = [sys.executable, LAUNCHER, "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
                   "--master_addr", "127.0.0.1", "--master_port", str(port), PT_SCRIPT, *args]
        launchers.append(subprocess.Popen(command, cwd=node, env=script_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    started = time.time()
    try:
        results = [launcher.communicate(timeout=240) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill()
    assert time.time() - started < 240
    expected = ("out/checkpoint-4: rank 0 resumes from it, but rank(s) 1 cannot (out/checkpoint-4: no such "
                "directory): every node must see the same --output_dir")
    for launcher, (stdout, stderr) in zip(launchers, results, strict=True):
        result = type("Result", (), {"returncode": launcher.returncode, "stdout": stdout, "stderr": stderr})
        check_refused(result, expected)
    assert os.listdir(nodes[1] / "out") == [] and snapshot(nodes[0] / "out") == before


# Two ranks mark checkpoint-2 complete while rank 0, the saving rank, is still writing into it (as it writes the
# adapter, under temporary names renamed away): no rank may walk the checkpoint to sync it before every rank has
# finished writing, or a listed file can be gone by the time it is opened.
MARK_WHILE_RANK_ZERO_WRITES = """
import os, sys, time
from types import SimpleNamespace
import torch.distributed as dist
from lorakit.core.atomic import write_json_atomically
from lorakit.trainers import checkpoints

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
written = os.path.join(out, "checkpoint-2", "adapter", "written-last-by-rank-0.json")
sync_tree = checkpoints.sync_tree

def sync_once_all_have_written(directory):
    assert os.path.exists(written), f"rank {rank} synced the checkpoint while rank 0 was still writing it"
    sync_tree(directory)

checkpoints.sync_tree = sync_once_all_have_written
if rank == 0:
    time.sleep(1.5)
    write_json_atomically(written, {}, make_parents=True)
checkpoints.mark_checkpoint_complete(SimpleNamespace(output_dir=out, should_save=rank == 0, save_total_limit=None),
                                     SimpleNamespace(global_step=2, best_model_checkpoint=None))
dist.destroy_process_group()
"""


def test_no_rank_syncs_the_checkpoint_before_the_saving_rank_has_written_it(tmp_path):
    os.makedirs(tmp_path / "checkpoint-2")  # the Trainer makes it before any on_save
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, "-c", MARK_WHILE_RANK_ZERO_WRITES, str(rank), port, str(tmp_path)],
                              env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [process.communicate(timeout=120)[0] for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0], "\n".join(output[-2000:] for output in outputs)
    with open(tmp_path / "checkpoint-2" / MARKER) as handle:
        marker = json.load(handle)
    assert marker["step"] == 2 and list(marker["hashes"]) == ["adapter/written-last-by-rank-0.json"]
