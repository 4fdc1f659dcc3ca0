"""PPO (run_ppo.py) on the tiny model against a reward model trained by run_reward.py: the
learning signal, the two placements, DeepSpeed, resume, EMA, ptx mixing and bad input."""

import json
import math
import os
import random
import shutil

import pytest
import torch

from helpers.commands import REPO, TRAINING, assert_ok, check_refused, options_to_argv, refuse, run_script
from helpers.corpora import CHINESE, ENGLISH
from helpers.generation_probe import recorded
from helpers.kill_points import resume_proof
from helpers.run_outputs import adapter_weights, log_history

PPO_SCRIPT = os.path.join(TRAINING, "run_ppo.py")
RM_SCRIPT = os.path.join(TRAINING, "run_reward.py")
GENERATION_PROBE = os.path.join(REPO, "tests", "helpers", "generation_probe.py")
GENERATION_RECORD = "generation_batches.jsonl"
MARKER = "很好"
STEP_KEYS = {"reward_mean", "reward_std", "score_mean", "kl", "entropy", "response_length", "policy_clipfrac",
             "value_loss", "policy_loss", "approx_kl", "time_generation", "time_training", "kl_coef"}
# Compared between runs that must agree: every logged number of a step that training shapes.
COMPARED = ("loss", "policy_loss", "value_loss", "reward_mean", "score_mean", "kl", "kl_coef", "entropy")


def sentence(rng, words, low, high):
    return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))


def marker_anywhere_pairs(count, seed):
    """The chosen answer is the rejected one with the marker word inserted somewhere: the only
    difference the reward model can learn, and one the tiny policy can learn to produce."""
    rng = random.Random(seed)
    words = ENGLISH + [w for w in CHINESE if w != MARKER]
    pairs = []
    for _ in range(count):
        answer = sentence(rng, words, 3, 9).split()
        marked = list(answer)
        marked.insert(rng.randint(0, len(answer)), MARKER)
        pairs.append({"prompt": sentence(rng, words, 3, 8), "chosen": " ".join(marked), "rejected": " ".join(answer)})
    return pairs


@pytest.fixture(scope="module")
def reward_adapter(tiny_model_dir, tmp_path_factory):
    """A reward adapter trained by run_reward.py to prefer answers holding the marker word
    (held-out pair accuracy 1.0 within 40 steps)."""
    root = tmp_path_factory.mktemp("ppo_rm")
    train, valid = root / "train.jsonl", root / "valid.jsonl"
    train.write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in marker_anywhere_pairs(400, 0)))
    valid.write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in marker_anywhere_pairs(60, 1)))
    options = {"model_name_or_path": tiny_model_dir, "data_path": train, "validation_file": valid,
               "template": "human_assistant", "output_dir": root / "out", "data_cache_dir": root / "cache",
               "max_steps": 40, "learning_rate": 1e-2, "per_device_train_batch_size": 8, "lora_rank": 8,
               "lora_alpha": 16, "lora_dropout": 0.0, "torch_dtype": "float32", "report_to": "none",
               "save_strategy": "no", "max_seq_length": 128, "logging_steps": 10, "seed": 42}
    assert_ok(run_script(["--do_train", "--use_cpu"] + options_to_argv(options), script=RM_SCRIPT))
    assert json.loads((root / "out" / "eval_results.json").read_text())["eval_accuracy"] >= 0.95
    return str(root / "out" / "rm_lora_model")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    rng = random.Random(7)
    words = ENGLISH + [w for w in CHINESE if w != MARKER]
    path = tmp_path_factory.mktemp("ppo_prompts") / "prompts.jsonl"
    records = [{"instruction": sentence(rng, words, 3, 8)} for _ in range(128)]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")
    return str(path)


def ppo_args(model_dir, reward_dir, prompts, output_dir, **overrides):
    options = {
        "actor_model_name_or_path": model_dir, "reward_model_name_or_path": model_dir,
        "reward_lora_model": reward_dir, "data_path": prompts, "template": "human_assistant",
        "max_prompt_seq_len": 32, "max_answer_seq_len": 16, "per_device_generation_batch_size": 8,
        "per_device_training_batch_size": 8, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "trainable": "q_proj,v_proj", "torch_dtype": "float32", "report_to": "none", "save_strategy": "no",
        "logging_steps": 1, "max_steps": 2, "output_dir": output_dir, "seed": 1, **overrides,
    }
    return ["--use_cpu"] + options_to_argv(options)


def step_logs(output_dir):
    return [entry for entry in log_history(output_dir) if "loss" in entry]


def assert_same_steps(expected, actual, tolerance):
    assert [e["step"] for e in expected] == [e["step"] for e in actual]
    for first, second in zip(expected, actual, strict=True):
        for key in COMPARED:
            assert abs(first[key] - second[key]) <= tolerance * max(1.0, abs(first[key])), (key, first, second)


def max_difference(first_dir, second_dir):
    first, second = adapter_weights(first_dir), adapter_weights(second_dir)
    assert first.keys() == second.keys()
    return max((first[k] - second[k]).abs().max().item() for k in first)


@pytest.mark.slow
def test_held_out_reward_rises_while_kl_stays_bounded(tiny_model_dir, reward_adapter, prompt_file, tmp_path):
    out = tmp_path / "out"
    # 30 iterations of 32 answers, 2 PPO epochs: 60 optimizer steps; 32 held-out prompts
    # evaluated with a fixed sampling seed every 10 iterations.
    args = ppo_args(tiny_model_dir, reward_adapter, prompt_file, out, max_steps=60,
                    trainable="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                    per_device_generation_batch_size=16, generation_batches=2, per_device_training_batch_size=32,
                    ppo_epochs=2, actor_learning_rate=2e-3, critic_learning_rate=1e-3, lr_scheduler_type="constant",
                    kl_ctl=0.2, validation_split_percentage=25, eval_strategy="steps", eval_steps=20,
                    eval_on_start=True, logging_steps=2)
    assert_ok(run_script(args, script=PPO_SCRIPT))
    history = log_history(out)
    evals = [e for e in history if "eval_score_mean" in e]
    assert [e["step"] for e in evals] == [0, 20, 40, 60]
    start, late = evals[0], evals[2:]
    # Scores run from about -6.7 (no marker) to +6.7 (marker): the share of held-out answers
    # with the marker must grow by well over a fifth of all answers.
    assert sum(e["eval_score_mean"] for e in late) / 2 > start["eval_score_mean"] + 2.5, evals
    assert sum(e["eval_reward_mean"] for e in late) / 2 > start["eval_reward_mean"] + 2.0, evals
    steps = step_logs(out)
    assert len(steps) == 30 and all(STEP_KEYS <= set(e) for e in steps)
    assert max(e["kl"] for e in steps) < 8 and max(e["eval_kl"] for e in evals) < 8, [e["kl"] for e in steps]
    assert all(e["iteration"] == e["step"] // 2 for e in steps)  # two optimizer steps per iteration
    for name in ("ppo_lora_model", "critic"):
        assert (out / name / "adapter_model.safetensors").is_file() and (out / name / "tokenizer.json").is_file()
    # The final evaluation (same seed, same policy as the one at step 60) lands in eval_results.json.
    final = json.loads((out / "eval_results.json").read_text())
    assert final["eval_score_mean"] == pytest.approx(evals[-1]["eval_score_mean"], abs=1e-6)


@pytest.fixture(scope="module")
def short_runs(tiny_model_dir, reward_adapter, prompt_file, pretrain_dir, tmp_path_factory):
    """Two iterations in each placement, and the shared one again with ptx mixing, with
    gradient checkpointing, with the hybrid engine (merged decode) and the sampler correction, and with the
    compiled engine (static KV cache, torch.compile: on the CPU when asked for by name)."""
    root = tmp_path_factory.mktemp("ppo_short")
    runs = {
        "shared": {"shared_base": "true"},
        "separate": {"shared_base": "false"},
        "ptx": {"unsupervised_dataset_dir": pretrain_dir, "unsup_coef": 0.5, "data_cache_dir": root / "cache"},
        "checkpointed": {"gradient_checkpointing": True},
        "hybrid": {"enable_hybrid_engine": True, "sampler_correction": True},
        "compiled": {"enable_hybrid_engine": True, "rollout_engine": "compiled"},
    }
    for name, extra in runs.items():
        result = run_script(ppo_args(tiny_model_dir, reward_adapter, prompt_file, root / name, **extra),
                            script=PPO_SCRIPT)
        assert_ok(result)
        runs[name] = root / name
        (root / name / "stdout.txt").write_text(result.stdout + result.stderr)
        if name in ("shared", "separate"):
            assert f"placement: {'shared base' if name == 'shared' else 'separate models'}" in result.stdout
    return runs


@pytest.mark.slow
def test_shared_base_and_separate_models_give_the_same_iterations(short_runs):
    shared, separate = step_logs(short_runs["shared"]), step_logs(short_runs["separate"])
    assert len(shared) == 2 and shared[0]["value_loss"] > 0 and shared[1]["kl"] != 0
    assert_same_steps(shared, separate, tolerance=1e-4)
    # Both write the actor adapter in the same layout, trained alike.
    assert max_difference(short_runs["shared"] / "ppo_lora_model", short_runs["separate"] / "ppo_lora_model") < 1e-5


@pytest.mark.slow
def test_each_iterations_first_update_starts_at_ratio_one_and_the_sampler_gap_is_logged(short_runs):
    """One optimizer step per iteration (8 rows, one micro-batch, one epoch): each step is its iteration's only
    update, whose own detached log-probs are the old policy (no pass before it), so its ratio is exactly 1
    (approx_kl 0, nothing clipped), whichever engine sampled; the update measures the sampler gap, ~0 in fp32.
    The merged decode samples what the unmerged one does; the correction's weights are ~1 in fp32."""
    for name in ("shared", "separate", "hybrid"):
        for entry in step_logs(short_runs[name]):
            assert entry["approx_kl"] == 0 and entry["policy_clipfrac"] == 0, (name, entry)
            assert entry["sampler_gap/logprob_abs"] < 1e-5 and 0 <= entry["sampler_gap/kl"] < 1e-9, (name, entry)
        log = (short_runs[name] / "stdout.txt").read_text()
        assert "old policy: each rollout trains one optimizer step, whose own log-probs serve" in log
    hybrid = step_logs(short_runs["hybrid"])
    assert all(abs(e["sampler_correction/weight_mean"] - 1) < 1e-5 for e in hybrid), hybrid
    assert "sampler_correction/weight_mean" not in step_logs(short_runs["shared"])[0]
    assert_same_steps(step_logs(short_runs["shared"]), hybrid, tolerance=1e-4)


@pytest.mark.slow
def test_the_compiled_engine_trains_what_the_eager_one_trains(short_runs):
    """PPO's own path (shared base, merged adapter, the script's generation settings) through the compiled decode:
    the same two iterations as the eager hybrid run, the sampler gap ~0, one compile for its one shape."""
    compiled = step_logs(short_runs["compiled"])
    assert all(e["sampler_gap/logprob_abs"] < 1e-5 and e["approx_kl"] < 1e-13 for e in compiled), compiled
    assert_same_steps(step_logs(short_runs["hybrid"]), compiled, tolerance=1e-4)
    log = (short_runs["compiled"] / "stdout.txt").read_text()
    assert log.count("decoding step compiled for 8 rows x a KV cache of 48 (prompt bucket 32)") == 1, log[-3000:]


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_each_role_under_its_own_adapter(short_runs):
    # The shared base switches adapters between the actor and critic passes of one step; the
    # backward recomputation of a checkpointed layer must replay the role that ran it.
    assert_same_steps(step_logs(short_runs["shared"]), step_logs(short_runs["checkpointed"]), tolerance=1e-5)
    for name in ("ppo_lora_model", "critic"):
        assert max_difference(short_runs["shared"] / name, short_runs["checkpointed"] / name) < 1e-6, name


@pytest.mark.slow
def test_ptx_loss_is_mixed_into_the_actor_loss(short_runs):
    plain, mixed = step_logs(short_runs["shared"]), step_logs(short_runs["ptx"])
    first_plain, first_mixed = plain[0], mixed[0]
    # Same experience and losses in the first step; the total gains unsup_coef x the LM loss.
    for key in ("policy_loss", "value_loss", "reward_mean"):
        assert first_mixed[key] == pytest.approx(first_plain[key], abs=1e-5)
    assert 0.5 < first_mixed["ptx_loss"] < 8  # a real next-token loss on pretraining blocks
    for entry in mixed:
        expected = entry["policy_loss"] + entry["value_loss"] + 0.5 * entry["ptx_loss"]
        assert entry["loss"] == pytest.approx(expected, rel=1e-4)
    assert first_mixed["loss"] - first_plain["loss"] == pytest.approx(0.5 * first_mixed["ptx_loss"], rel=1e-4)
    assert "ptx_loss" not in first_plain


@pytest.fixture(scope="module")
def zero_stage_runs(tiny_model_dir, reward_adapter, prompt_file, tmp_path_factory):
    """Three iterations on two processes under ZeRO-2 and under ZeRO-3: {config: (output dir, stdout)}. The ZeRO-3
    run samples each generation batch a second time per layer (helpers/generation_probe.py, GENERATION_RECORD)."""
    root, runs = tmp_path_factory.mktemp("ppo_zero_stages"), {}
    for config in ("ds_zero2_no_offload", "ds_zero3_no_offload"):
        out = root / config
        args = ppo_args(tiny_model_dir, reward_adapter, prompt_file, out, max_steps=3, save_strategy="steps",
                        save_steps=2, per_device_generation_batch_size=4, per_device_training_batch_size=4,
                        deepspeed=os.path.join(REPO, "ds_configs", f"{config}.json"))
        probe = [GENERATION_PROBE, "--record", str(root / GENERATION_RECORD)] if "zero3" in config else None
        result = run_script(args, nproc=2, script=PPO_SCRIPT, wrapper=probe)
        assert_ok(result)
        runs[config] = (out, result.stdout)
    return runs


@pytest.mark.slow
def test_deepspeed_zero2_and_zero3_two_processes(zero_stage_runs):
    runs = {}
    for config, (out, _) in zero_stage_runs.items():
        runs[config] = out
        steps = step_logs(out)
        assert len(steps) == 3 and all(STEP_KEYS <= set(e) for e in steps)
        weights = adapter_weights(out / "ppo_lora_model")
        assert weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 64)
        assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in weights.items())
        critic = adapter_weights(out / "critic")
        assert critic["base_model.model.score.weight"].shape == (1, 64)
        state = json.loads((out / "checkpoint-2" / "ppo_state.json").read_text())
        assert state["iteration"] == 2
    # Partitioning is an implementation detail: both stages train the same numbers.
    assert_same_steps(step_logs(runs["ds_zero2_no_offload"]), step_logs(runs["ds_zero3_no_offload"]), tolerance=1e-4)


@pytest.mark.slow
def test_zero3_generation_gathers_the_actor_once_per_batch_and_samples_what_per_layer_gathering_samples(
        zero_stage_runs):
    """The tiny actor fits the device: each generation batch gathers its weights once (the all-gathers of one
    zero3.gathered of every actor parameter), not every layer at every generated token, and draws the same answers,
    log-probs and entropies as the per-layer path from the same random state."""
    out, stdout = zero_stage_runs["ds_zero3_no_offload"]
    assert "generation under ZeRO-3: parameters gathered once per batch" in stdout
    batches = recorded(str(out.parent / GENERATION_RECORD))
    assert sorted(batch["rank"] for batch in batches) == [0, 0, 0, 1, 1, 1]  # 3 iterations of one batch, 2 ranks
    for batch in batches:
        # At most what fetching every parameter once costs (fewer where some were still held from the last phase).
        assert 0 < batch["gathers"] <= batch["one_gather"], batch
        # Per layer: the two decoder layers' weights (at least) are fetched again at every generated token.
        assert batch["steps"] >= 2 and batch["per_layer_gathers"] >= 2 * batch["steps"] + batch["one_gather"], batch
        assert batch["same_tokens"] and batch["logprob_diff"] <= 1e-5 and batch["entropy_diff"] <= 1e-5, batch


# The hybrid engine (merged decode) on: its restore by copy keeps the resumed run bit-identical.
RESUMED = {"enable_hybrid_engine": True, "max_steps": 4, "save_strategy": "steps", "save_steps": 1, "enable_ema": True,
           "ema_beta": 0.5,
           "target_kl": 0.01, "kl_horizon": 100, "per_device_generation_batch_size": 4, "generation_batches": 2,
           "per_device_training_batch_size": 4, "gradient_accumulation_steps": 2}


def ppo_resume_proof(nproc, tiny_model_dir, reward_adapter, prompt_file, root, **extra):
    def args_for(output_dir):
        return ppo_args(tiny_model_dir, reward_adapter, prompt_file, output_dir, **RESUMED, **extra)

    return resume_proof(nproc, PPO_SCRIPT, args_for, root, seed=f"ppo-{nproc}", total=RESUMED["max_steps"],
                        save_steps=RESUMED["save_steps"], mid_save=False)


@pytest.fixture(scope="module")
def ppo_resume(tiny_model_dir, reward_adapter, prompt_file, tmp_path_factory):
    """An uninterrupted run and the same run killed at seeded random iterations, while writing a checkpoint and as
    it ends, rerun after each kill until it finished, each process forked (helpers/kill_points.py)."""
    return ppo_resume_proof(1, tiny_model_dir, reward_adapter, prompt_file, tmp_path_factory.mktemp("ppo_resume"))


@pytest.fixture(scope="module")
def ppo_zero3_resume(tiny_model_dir, reward_adapter, prompt_file, tmp_path_factory):
    """The same under torchrun with ZeRO-3 on two processes, killed once at a seeded random iteration."""
    return ppo_resume_proof(2, tiny_model_dir, reward_adapter, prompt_file, tmp_path_factory.mktemp("ppo_zero3"),
                            deepspeed=os.path.join(REPO, "ds_configs", "ds_zero3_no_offload.json"))


@pytest.fixture(scope="module")
def uninterrupted(ppo_resume):
    return ppo_resume.root / "reference"


@pytest.mark.parametrize("proof", ["ppo_resume", "ppo_zero3_resume"])
@pytest.mark.slow
def test_resume_after_kills_at_random_iterations_runs_only_the_remaining_ones_and_continues_identically(proof,
                                                                                                       request):
    """Each rerun ran only the iterations after the last checkpoint (its own step log, iteration counter
    included), and the run logs the same numbers and saves the same weights as the uninterrupted one."""
    proof = request.getfixturevalue(proof)
    proof.check_processes_after_random_kills()
    assert "starting at iteration" in proof.resumed_output()
    expected, actual = step_logs(proof.root / "reference"), step_logs(proof.root / "crashed")
    # The adaptive KL coefficient moved every iteration: the resumed run continued from its saved value.
    assert len({e["kl_coef"] for e in expected}) == 4
    assert_same_steps(expected, actual, tolerance=0)
    for name in ("ppo_lora_model", "actor_ema", "critic"):
        proof.check_bit_identical(name)


@pytest.mark.slow
def test_ppo_resume_after_a_kill_while_writing_a_checkpoint_starts_from_the_last_complete_one(ppo_resume):
    ppo_resume.check_process_after_mid_save_kill()


@pytest.mark.slow
def test_ppo_rerun_of_a_run_killed_after_its_last_step_trains_no_step_and_equals_uninterrupted(ppo_resume):
    ppo_resume.check_process_after_end_kill()
    for name in ("ppo_lora_model", "actor_ema", "critic"):
        ppo_resume.check_bit_identical(name, run_name="ended")


@pytest.mark.slow  # its run (25 s on 2 cores) is the resume proof's, which is slow
def test_ema_is_the_average_of_the_actor_steps(uninterrupted):
    beta = RESUMED["ema_beta"]
    ema = adapter_weights(uninterrupted / "actor_ema")
    steps = [adapter_weights(uninterrupted / f"checkpoint-{n}" / "ppo_lora_model") for n in range(1, 5)]
    assert ema.keys() == steps[-1].keys()
    assert json.loads((uninterrupted / "actor_ema" / "adapter_config.json").read_text())["r"] == 8
    for key in (k for k in ema if "lora_B" in k):
        # LoRA B starts at zero, so the average is sum over steps t of (1 - beta) beta^(4 - t) w_t.
        expected = sum((1 - beta) * beta ** (4 - t) * steps[t - 1][key] for t in range(1, 5))
        assert torch.allclose(ema[key], expected, atol=1e-7), key
        assert (ema[key] - steps[-1][key]).abs().max() > 1e-5  # and it lags the actor
    # The checkpoint's EMA is the one at that step.
    at_two = adapter_weights(uninterrupted / "checkpoint-2" / "actor_ema")
    key = next(k for k in ema if "lora_B" in k)
    assert torch.allclose(at_two[key], (1 - beta) * beta * steps[0][key] + (1 - beta) * steps[1][key], atol=1e-7)


def mismatched_reward_adapter(tmp_path, reward_adapter, extended_tokenizer_dir):
    adapter = tmp_path / "other_rm"
    shutil.copytree(reward_adapter, adapter)
    for name in os.listdir(extended_tokenizer_dir):
        shutil.copy(os.path.join(extended_tokenizer_dir, name), adapter / name)
    return adapter


@pytest.mark.parametrize("case", ["tokenizer_mismatch", "empty_prompts", "too_long", "base_as_reward"])
def test_ppo_bad_input_is_refused_cleanly(case, tiny_model_dir, reward_adapter, prompt_file, extended_tokenizer_dir,
                                          tmp_path):
    out = tmp_path / "out"
    overrides, expected = {}, None
    if case == "tokenizer_mismatch":
        adapter = mismatched_reward_adapter(tmp_path, reward_adapter, extended_tokenizer_dir)
        overrides["reward_lora_model"] = adapter
        expected = f"{adapter}: the reward model's tokenizer differs from the actor's (404 tokens vs the actor's 400)"
    elif case == "empty_prompts":
        (tmp_path / "empty.jsonl").write_text("")
        overrides["data_path"] = tmp_path / "empty.jsonl"
        expected = "empty.jsonl: file holds no records (empty)"
    elif case == "too_long":
        overrides.update(max_prompt_seq_len=200, max_answer_seq_len=100)
        expected = ("--max_prompt_seq_len 200 + --max_answer_seq_len 100 = 300 exceeds the actor model's "
                    "max_position_embeddings 256")
    else:
        overrides["reward_lora_model"] = None
        expected = f"{tiny_model_dir}: --reward_model_name_or_path is not a reward model (no score head"
    args = ppo_args(tiny_model_dir, reward_adapter, prompt_file, out, **overrides)
    # One case as a real process (the whole contract), the others in-process through run_cli.
    check_refused(refuse(PPO_SCRIPT, args, in_process=case != "tokenizer_mismatch"), expected)
    assert not out.exists()


def test_separate_placement_under_zero3_is_refused_where_the_whole_frozen_roles_do_not_fit(
        tiny_model_dir, reward_adapter, prompt_file, tmp_path, monkeypatch):
    """Without --shared_base the reference and reward models are loaded whole into every process: under ZeRO-3,
    with 1 MB free (the tiny roles take about 1 MB in float32: more than half of it), the run is refused before
    anything is written, pointing to --shared_base."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from lorakit.rl import ppo_policy

    monkeypatch.setattr(ppo_policy, "free_memory_bytes", lambda device: 10**6)
    out = tmp_path / "out"
    args = ppo_args(tiny_model_dir, reward_adapter, prompt_file, out, shared_base="false",
                    deepspeed=os.path.join(REPO, "ds_configs", "ds_zero3_no_offload.json"))
    try:
        result = refuse(PPO_SCRIPT, args, in_process=True)
    finally:
        unset_hf_deepspeed_config()  # a ZeRO-3 config registers itself process-wide: not for the tests that follow
    check_refused(result, "--shared_base false under ZeRO-3: the frozen reference and reward models take 0.00")
    assert "more than half its share of the available CPU memory (0.001 GB" in result.stderr
    assert "use --shared_base true" in result.stderr
    assert not out.exists()


def test_prompts_come_from_every_sft_format_without_their_answers(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from lorakit.data.prompts import read_prompts, tokenize_prompts
    from lorakit.records.chat_templates import named_template

    path = os.path.join(REPO, "data", "ppo_sample", "prompts.jsonl")
    prompts = read_prompts([path], None, 3, 42)
    assert len(prompts) == 20 and all(prompt.messages[-1]["role"] == "user" for prompt in prompts)
    by_line = {prompt.where.rsplit(":", 1)[1]: prompt.messages for prompt in prompts}
    assert by_line["18"][-1]["content"] == "Why is it cheaper than full fine-tuning?" and len(by_line["18"]) == 3
    assert by_line["19"] == [{"role": "user", "content": "用简单的话解释什么是强化学习。"}]  # its answer dropped
    assert by_line["13"][0] == {"role": "system", "content": "你是一位耐心的健康顾问。"}
    # DeepSpeed-Chat's --data_split: phase 3 takes its own share of the records.
    assert len(read_prompts([path], "2,4,4", 3, 42)) == 8
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    template = named_template("human_assistant", tokenizer)
    full = tokenize_prompts(prompts, tokenizer, template, 10_000, "all")
    cut = tokenize_prompts(prompts, tokenizer, template, 12, "cut")
    for whole, kept in zip(full, cut, strict=True):
        assert kept == whole[-12:]  # truncated from the left: the generation prompt stays
    text = tokenizer.decode(full[0])
    assert text.rstrip().endswith("Assistant:")


def test_a_prompt_carries_its_reference_answer_and_its_other_fields(tmp_path):
    """For the rewards that check an answer: "answer", else an alpaca "output", else a final assistant turn (each
    dropped from the prompt); every field the prompt is not built from travels with it, by name."""
    from lorakit.data.prompts import read_prompts

    records = [{"prompt": "2 + 40?", "answer": 42, "difficulty": "easy"},
               {"instruction": "3 + 4?", "input": "show the steps", "output": "#### 7"},
               {"messages": [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}]},
               {"conversations": [{"from": "human", "value": "hello"}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    prompts = read_prompts([str(path)], None, 3, 42)
    assert [prompt.fields["answer"] for prompt in prompts] == [42, "#### 7", "5", None]
    assert prompts[0].fields == {"answer": 42, "difficulty": "easy"}
    assert prompts[1].fields == {"answer": "#### 7", "output": "#### 7"}
    assert prompts[2].messages == [{"role": "user", "content": "2 + 3?"}] and prompts[2].where.endswith(":3")


def test_length_grouped_passes_equal_one_pass_over_the_padded_batch(tiny_model_dir):
    """Left-padded prompts of mixed lengths and answers of mixed lengths, run as one padded batch
    and in length groups cut to their own widths: the same log-probs and values on every real
    answer token, and the same gradients."""
    from transformers import AutoModelForCausalLM

    from lorakit.rl.experience import left_pad
    from lorakit.rl.role_policy import RolePolicy, backbone_of

    class OneModelPolicy(RolePolicy):
        def __init__(self, causal_lm):
            super().__init__()
            self.lm = causal_lm
            self.value_head = torch.nn.Linear(causal_lm.config.hidden_size, 1)

        def hidden(self, role, input_ids, attention_mask, position_ids):
            return backbone_of(self.lm)(input_ids=input_ids, attention_mask=attention_mask,
                                        position_ids=position_ids, use_cache=False).last_hidden_state

        def head(self, role):
            return self.lm.get_output_embeddings() if role in ("actor", "reference") else self.value_head

    torch.manual_seed(0)
    policy = OneModelPolicy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    rng = random.Random(0)
    prompt_lengths, answer_lengths = [3, 17, 4, 20, 5, 18, 2, 19], [6, 6, 2, 6, 3, 6, 6, 1]
    prompts = [[rng.randrange(5, 200) for _ in range(n)] for n in prompt_lengths]
    width, answer_width = max(prompt_lengths), max(answer_lengths)
    prompt_ids, prompt_mask = left_pad(prompts, width, 0)
    answers = torch.tensor([[rng.randrange(5, 200) for _ in range(answer_width)] for _ in prompts])
    answer_mask = (torch.arange(answer_width)[None, :] < torch.tensor(answer_lengths)[:, None]).long()
    input_ids, attention_mask = torch.cat([prompt_ids, answers], 1), torch.cat([prompt_mask, answer_mask], 1)

    results = {}
    for grouped in (False, True):
        policy.zero_grad()
        policy.group_by_length = grouped
        outputs = policy(input_ids, attention_mask, width)
        ((outputs["logprobs"] * answer_mask).sum() + (outputs["values"] * answer_mask).sum()).backward()
        grads = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
        results[grouped] = (outputs, grads)
    (whole, whole_grads), (grouped, grouped_grads) = results[False], results[True]
    real = answer_mask.bool()
    for name in ("logprobs", "values"):
        assert whole[name].shape == grouped[name].shape == (8, answer_width)
        torch.testing.assert_close(grouped[name][real], whole[name][real], atol=1e-5, rtol=1e-5)
    assert whole_grads.keys() == grouped_grads.keys() and len(whole_grads) > 10
    for name, grad in whole_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_generated_answers_are_scored_where_the_reward_model_was_trained_to_read(tiny_tokenizer_dir):
    """A rollout row (left-padded prompt, the answer up to its EOS, then generate's padding)
    closed by append_turn_end attends to exactly the reward stage's row of the same conversation
    (which ends with the template's turn end, where the score is read), at the same positions.
    An answer cut at the length limit, without EOS, is scored where it stops."""
    from transformers import AutoTokenizer

    from lorakit.data.conversation_tokenizer import ConversationTokenizer
    from lorakit.data.prompts import tokenize_prompts
    from lorakit.models.positions import positions_from_mask
    from lorakit.records.chat_templates import named_template
    from lorakit.rl.experience import answer_mask, append_turn_end, left_pad

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    template, eos = named_template("chatml", tokenizer), tokenizer.eos_token_id
    turn_end = ConversationTokenizer(tokenizer, template, 256).after_turn_end_ids()
    assert tokenizer.decode(turn_end).strip(" ") == "\n"
    reward_rows, prompt_rows, answers = [], [], []
    for prompt, answer in (("今天 天气", "很好 the fox jumps over"), ("the quick brown fox jumps", "我们")):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        reward_row = ConversationTokenizer(tokenizer, template, 256, keep_after_turn_end=True)("t", messages)
        reward_rows.append(reward_row["input_ids"])
        prompt_rows.append(tokenize_prompts([("t", messages[:1])], tokenizer, template, 256, "prompt")[0])
        assert reward_rows[-1][: len(prompt_rows[-1])] == prompt_rows[-1]
        answers.append(reward_rows[-1][len(prompt_rows[-1]) : len(reward_rows[-1]) - len(turn_end)])
        assert answers[-1][-1] == eos
    prompt_rows.append(prompt_rows[0])
    answers.append([tokenizer.convert_tokens_to_ids("▁the")] * (max(map(len, answers)) + 2))  # cut at the limit: no EOS
    width, answer_width = max(map(len, prompt_rows)), max(map(len, answers))
    prompt_ids, prompt_mask = left_pad(prompt_rows, width, eos)  # the pad id may be EOS
    answer_ids = torch.tensor([a + [eos] * (answer_width - len(a)) for a in answers])
    ids = torch.cat([prompt_ids, answer_ids], 1)
    mask = torch.cat([prompt_mask, answer_mask(answer_ids, eos)[0]], 1)

    closed_ids, closed_mask = append_turn_end(ids, mask, eos, turn_end)
    positions = positions_from_mask(closed_mask)
    for row, reward_row in enumerate(reward_rows):
        real = closed_mask[row].bool()
        assert closed_ids[row][real].tolist() == reward_row
        assert positions[row][real].tolist() == list(range(len(reward_row)))
    assert (closed_ids[2][closed_mask[2].bool()].tolist() == ids[2][mask[2].bool()].tolist()
            == prompt_rows[2] + answers[2])
    assert append_turn_end(ids, mask, eos, []) == (ids, mask)  # templates whose turns end at EOS


def test_training_and_evaluation_measure_reward_and_kl_alike():
    """Training's and evaluation's statistics of one Experience are one computation: the same
    reward (clipped score after the missing-EOS penalty, minus kl_coef x KL), KL and score, worked
    out here by hand; evaluation's row weights drop the rows that only fill its last batch."""
    from types import SimpleNamespace

    from lorakit.rl.experience import Rollout, RolloutScores, evaluation_metrics, shape_experience, training_metrics

    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 0]])
    rollout = Rollout(input_ids=torch.zeros(3, 5, dtype=torch.long), attention_mask=torch.ones(3, 5, dtype=torch.long),
                      prompt_length=2, response_mask=mask, has_eos=torch.tensor([True, False, True]),
                      logprobs=torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.4, -0.6], [-1.0, -1.0, 0.0]]),
                      entropy=mask.clone())
    scored = RolloutScores(ref_logprobs=torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.9, -0.1], [-1.0, -3.0, -0.5]]),
                           values=torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [0.0, 0.0, 9.0]]),
                           scores=torch.tensor([2.0, 10.0, -0.5]))
    settings = SimpleNamespace(missing_eos_penalty=1.0, clip_reward_value=5.0, gamma=1.0, lam=0.95)
    experience = shape_experience(rollout, scored, 0.1, settings)
    train = training_metrics(experience, 0.1, "cpu")
    evaluation = evaluation_metrics(experience, torch.ones(3), "cpu")
    assert set(evaluation) == {f"eval_{name}" for name in train if name != "kl_coef"}
    for name in ("reward_mean", "reward_std", "score_mean", "kl", "response_length", "eos_fraction"):
        assert evaluation[f"eval_{name}"] == pytest.approx(train[name], abs=1e-9), name
    # Sequence KL: 0.5 - 1 = -0.5; 0.5 - 0.5 = 0; 2 (row 2's padding is not counted).
    # Scores after the penalty: 2; 10 - 1 = 9 (no EOS), clipped to 5 in the reward; -0.5.
    # Rewards: 2 + 0.05 = 2.05; 5 - 0 = 5; -0.5 - 0.2 = -0.7.
    assert train["kl"] == pytest.approx(1.5 / 3) and train["score_mean"] == pytest.approx(10.5 / 3)
    assert train["reward_mean"] == pytest.approx(6.35 / 3)
    assert train["reward_std"] == pytest.approx(((2.05 ** 2 + 25 + 0.49) / 3 - (6.35 / 3) ** 2) ** 0.5)
    assert train["response_length"] == pytest.approx(8 / 3) and train["eos_fraction"] == pytest.approx(2 / 3)
    assert train["value_mean"] == pytest.approx(0.5) and train["entropy"] == pytest.approx(1.0)
    assert train["kl_coef"] == 0.1
    # Sampled and old log-probs are the same numbers here: no gap between sampler and trainer.
    assert train["sampler_gap/logprob_abs"] == 0 and train["sampler_gap/kl"] == 0
    # The last row only pads evaluation's batch: weighted out, the means are the first two rows'.
    first_two = evaluation_metrics(experience, torch.tensor([1.0, 1.0, 0.0]), "cpu", "held_out")
    assert first_two["held_out_reward_mean"] == pytest.approx((2.05 + 5) / 2)
    assert first_two["held_out_kl"] == pytest.approx(-0.25) and first_two["held_out_score_mean"] == pytest.approx(5.5)


def test_qlora_ppo_trains_on_a_4bit_base_with_the_shared_flag_names(tiny_model_dir, reward_adapter, prompt_file,
                                                                    tmp_path):
    """--load_in_kbits 4 (QLoRA, the other stages' flag) reaches every PPO role: two iterations on the quantized
    shared base log finite losses, and the actor and critic adapters learn. The other stages' names of the actor
    and of the micro-batch size are accepted and mapped, with a log line."""
    out = tmp_path / "out"
    args = ppo_args(tiny_model_dir, reward_adapter, prompt_file, out, load_in_kbits=4,
                    actor_model_name_or_path=None, model_name_or_path=tiny_model_dir,
                    per_device_training_batch_size=None, per_device_train_batch_size=8)
    result = run_script(args, script=PPO_SCRIPT)
    assert_ok(result)
    assert f"flag mapped: --model_name_or_path {tiny_model_dir} -> --actor_model_name_or_path" in result.stdout
    assert "flag mapped: --per_device_train_batch_size 8 -> --per_device_training_batch_size" in result.stdout
    steps = step_logs(out)
    assert len(steps) == 2 and all(all(math.isfinite(e[key]) for key in COMPARED) for e in steps), steps
    # A learning signal: the critic's error is nonzero and the first update moved the policy off the reference.
    assert steps[0]["value_loss"] > 0 and steps[1]["kl"] != 0, steps
    actor = adapter_weights(out / "ppo_lora_model")
    assert any(key.endswith("lora_B.weight") and actor[key].abs().sum() > 0 for key in actor)
    assert any("lora_A" in key for key in adapter_weights(out / "critic"))


@pytest.mark.parametrize("argv, expected", [
    (["--model_name_or_path", "a", "--actor_model_name_or_path", "b", "--reward_model_name_or_path", "r"],
     "--model_name_or_path a and --actor_model_name_or_path b both given"),
    (["--actor_model_name_or_path", "a", "--reward_model_name_or_path", "r", "--learning_rate", "0.1",
      "--actor_learning_rate", "0.2"], "--learning_rate 0.1 and --actor_learning_rate 0.2 both given"),
    (["--reward_model_name_or_path", "r"], "--actor_model_name_or_path is required"),
])
def test_ppo_refuses_a_flag_given_under_both_names(argv, expected):
    from lorakit.core.cli import InputError, parse_args
    from lorakit.rl.ppo_config import PPOArguments, PPOModelArguments

    with pytest.raises(InputError, match=expected):
        parse_args((PPOModelArguments, PPOArguments), argv + ["--output_dir", "o", "--use_cpu"])
