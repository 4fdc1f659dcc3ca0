"""Group-relative RL (run_grpo.py) on the tiny model with a reward function: the learning signal for each
estimator, the roles it loads, TRL's reward-function convention through the real script, and bad input."""

import json
import math
import os
import random
import textwrap

import pytest

from helpers.commands import (
    REPO,
    TRAINING,
    assert_ok,
    check_refused,
    options_to_argv,
    refuse,
    run_in_process,
    run_script,
)
from helpers.corpora import CHINESE, ENGLISH
from helpers.kill_points import resume_proof
from helpers.run_outputs import adapter_weights, log_history

GRPO_SCRIPT = os.path.join(TRAINING, "run_grpo.py")
MARKER = "很好"
# A rule reward as a TRL user writes one: 1 for an answer holding the marker word, 0 otherwise.
MARKER_REWARD = textwrap.dedent(f'''
    def marker(completions, **kwargs):
        return [1.0 if "{MARKER}" in completion else 0.0 for completion in completions]

    def broken(completions, **kwargs):
        return [float("nan") if index == 2 else 0.0 for index, _ in enumerate(completions)]

    def exits(completions, **kwargs):
        import sys

        sys.exit(0)
''')


@pytest.fixture(scope="module")
def grpo_inputs(tmp_path_factory):
    """(prompt file, reward function file): 128 prompts of the tiny model's words, and the marker reward."""
    root = tmp_path_factory.mktemp("grpo_inputs")
    rng = random.Random(7)
    words = ENGLISH + [w for w in CHINESE if w != MARKER]
    records = [{"instruction": " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))} for _ in range(128)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")
    (root / "rewards.py").write_text(MARKER_REWARD)
    return root / "prompts.jsonl", root / "rewards.py"


def grpo_args(model_dir, inputs, output_dir, **overrides):
    prompts, rewards = inputs
    options = {
        "model_name_or_path": model_dir, "data_path": prompts, "template": "human_assistant",
        "reward_funcs": f"{rewards}:marker", "max_prompt_seq_len": 32, "max_completion_length": 16,
        "num_generations": 4, "per_device_train_batch_size": 16, "lora_rank": 8, "lora_alpha": 16,
        "trainable": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "torch_dtype": "float32",
        "learning_rate": 2e-3, "lr_scheduler_type": "constant", "report_to": "none", "save_strategy": "no",
        "logging_steps": 1, "max_steps": 2, "output_dir": output_dir, "seed": 1, **overrides,
    }
    return ["--use_cpu"] + options_to_argv(options)


def step_logs(output_dir):
    return [entry for entry in log_history(output_dir) if "loss" in entry]


def trained_figures(steps):
    """The step logs without their wall-clock phase times and the Trainer's epoch (an endless experience stream has
    no epochs for a resumed Trainer to count on from)."""
    return [{key: value for key, value in entry.items() if not key.startswith("time_") and key != "epoch"}
            for entry in steps]


def early_and_late_reward(steps):
    """Mean reward of the first and of the last third of the steps."""
    third = len(steps) // 3
    rewards = [entry["reward_mean"] for entry in steps]
    return sum(rewards[:third]) / third, sum(rewards[-third:]) / third


@pytest.mark.slow
def test_grpo_with_a_trl_style_reward_function_raises_the_reward(tiny_model_dir, grpo_inputs, tmp_path):
    """30 rollouts of 4 prompts x 4 answers, the marker reward (a TRL-style function in the user's file): the share
    of answers holding the marker rises by well over a tenth; the actor alone is loaded (beta 0: no reference)."""
    out = tmp_path / "out"
    result = run_script(grpo_args(tiny_model_dir, grpo_inputs, out, max_steps=30), script=GRPO_SCRIPT)
    assert_ok(result)
    assert "roles: the actor on one base" in result.stdout + result.stderr
    steps = step_logs(out)
    assert len(steps) == 30 and all(entry["kl"] == 0 and "reward/marker_mean" in entry for entry in steps)
    early, late = early_and_late_reward(steps)
    assert late > early + 0.1, [round(entry["reward_mean"], 3) for entry in steps]
    assert (out / "grpo_lora_model" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
def test_rloo_and_reinforce_pp_learn_the_same_task(estimator, tiny_model_dir, grpo_inputs, tmp_path):
    """The same task with the leave-one-out baseline, and with REINFORCE++ paying the KL to the reference (the base
    alone, loaded because --beta > 0) in the reward: both raise the reward. Each ends with an evaluation of one
    answer per held-out prompt, scored by the same function."""
    out = tmp_path / "out"
    extra = {"beta": 0.05} if estimator == "reinforce_pp" else {}
    result = run_script(grpo_args(tiny_model_dir, grpo_inputs, out, max_steps=30, advantage_estimator=estimator,
                                  validation_split_percentage=10, eval_strategy="steps", eval_steps=30, **extra),
                        script=GRPO_SCRIPT)
    assert_ok(result)
    steps = step_logs(out)
    early, late = early_and_late_reward(steps)
    assert late > early + 0.1, [round(entry["reward_mean"], 3) for entry in steps]
    evaluations = [entry for entry in log_history(out) if "eval_reward_mean" in entry]
    assert evaluations and all(0 <= entry["eval_reward/marker_mean"] <= 1 for entry in evaluations), evaluations
    if estimator == "reinforce_pp":
        assert "roles: the actor, the reference (the base alone) on one base" in result.stdout + result.stderr
        # The KL it pays in the reward: none while the policy is its reference (the new adapter adds 0), then some.
        kl = [entry["reward_kl"] for entry in steps]
        assert len(kl) == len(steps) and abs(kl[0]) < 1e-4 < max(kl[-5:]), kl


@pytest.mark.parametrize("case", ["no_reward", "import", "missing_answer", "uneven_groups", "one_answer",
                                  "k1_in_loss", "save_inside_rollout", "non_finite", "generation_batch_0",
                                  "generation_batch_-1", "reward_timeout", "exit_in_reward",
                                  "stop_and_publish_on_alarm"])
def test_grpo_bad_input_is_refused_in_one_line(case, tiny_model_dir, grpo_inputs, tmp_path):
    """One line naming what is wrong, exit 2; a refusal before training writes nothing, a non-finite reward or a
    sys.exit(0) in the reward function (which ended the run with status 0 and no adapter) in the first rollout (the
    function named) publishes no adapter."""
    prompts, rewards = grpo_inputs
    out = tmp_path / "out"
    overrides, expected = {
        "no_reward": ({"reward_funcs": None}, "no reward: give --reward_funcs"),
        "import": ({"reward_funcs": "no_such_module:f"}, "--reward_funcs no_such_module:f: cannot import"),
        "missing_answer": ({"reward_funcs": "exact_match"}, f"{prompts}:1: field 'answer' is missing"),
        "uneven_groups": ({"num_generations": 3}, "is not a multiple of --num_generations 3"),
        "one_answer": ({"num_generations": 1}, "--num_generations 1: a group needs at least 2 answers"),
        "k1_in_loss": ({"beta": 0.1, "kl_estimator": "k1"}, "--kl_estimator k1 in the loss"),
        "save_inside_rollout": ({"num_iterations": 2, "max_steps": 10, "save_strategy": "steps", "save_steps": 0.3},
                                "--save_steps 0.3 (of --max_steps 10: every 3) must be a multiple of the 2"),
        "non_finite": ({"reward_funcs": f"{rewards}:broken"}, f"{prompts}:"),
        "generation_batch_0": ({"per_device_generation_batch_size": 0}, "--per_device_generation_batch_size 0: give"),
        "generation_batch_-1": ({"per_device_generation_batch_size": -1}, "--per_device_generation_batch_size -1:"),
        "reward_timeout": ({"reward_timeout": -1}, "--reward_timeout -1.0: give the seconds"),
        "stop_and_publish_on_alarm": ({"stop_on_alarm": True, "publish_on_alarm": True},
                                      "--stop_on_alarm and --publish_on_alarm: give one"),
        # In this process the Trainer's progress bar shares stderr: off, so that the error line starts its line.
        "exit_in_reward": ({"reward_funcs": f"{rewards}:exits", "disable_tqdm": "true"},
                           f"the reward function {rewards}:exits called sys.exit(0)"),
    }[case]
    args = grpo_args(tiny_model_dir, grpo_inputs, out, **overrides)  # a None option is left out
    result = refuse(GRPO_SCRIPT, args, in_process=case != "non_finite")
    check_refused(result, expected)
    if case == "non_finite":
        assert "the reward function " in result.stderr and "returned nan" in result.stderr
        assert not (out / "grpo_lora_model").exists()
    elif case == "exit_in_reward":
        assert not (out / "grpo_lora_model").exists()
    else:
        assert not out.exists()


def test_each_reward_function_is_logged_and_warned_of_apart(tiny_model_dir, grpo_inputs, tmp_path, monkeypatch):
    """Two files' functions named marker, the second returning None for every answer: logged as marker and marker_2
    (one label merged them and switched the reward-share alarms off), the second warned of once over two rollouts;
    each call gets --reward_timeout."""
    from lorakit.rl import grpo_trainer

    never = tmp_path / "never.py"
    never.write_text("def marker(completions, **kwargs):\n    return [None] * len(completions)\n")
    timeouts = []

    def probed(functions, batch, trainer_state=None, timeout=0):
        timeouts.append(timeout)
        return grpo_trainer_score(functions, batch, trainer_state, timeout)

    grpo_trainer_score = grpo_trainer.score_completions
    monkeypatch.setattr(grpo_trainer, "score_completions", probed)
    out = tmp_path / "out"
    args = grpo_args(tiny_model_dir, grpo_inputs, out, reward_funcs=None, reward_timeout=30,
                     per_device_train_batch_size=8, max_completion_length=8)
    result = run_in_process(GRPO_SCRIPT, args + ["--reward_funcs", f"{grpo_inputs[1]}:marker", f"{never}:marker"])
    assert_ok(result)
    log = result.stdout + result.stderr
    assert log.count(f"the reward function {never}:marker returned None for every one of 8 answers") == 1, log
    assert "reward_share/marker, reward_share/marker_2" in log
    steps = step_logs(out)
    assert len(steps) == 2 and all(entry["reward/marker_2_mean"] == 0 for entry in steps), steps
    assert all(entry["reward/marker_mean"] == pytest.approx(entry["reward_mean"]) for entry in steps), steps
    assert timeouts == [30.0, 30.0]


def test_a_reward_file_edited_in_place_is_refused_on_resume(grpo_inputs, tmp_path):
    """The reward file's content is in the run identity (renaming the function was refused, an edit in place resumed
    and its reward_mean jumped from 0.125 to 2.5); a checkpoint written before it was recorded resumes with one line
    naming it; built-ins have no file."""
    from transformers import HfArgumentParser

    from lorakit.rl.grpo_config import ARGUMENT_CLASSES
    from lorakit.trainers.checkpoints import check_identity, run_identity

    rewards = tmp_path / "rewards.py"
    rewards.write_text(MARKER_REWARD)

    def identity(*reward_funcs):
        argv = ["--output_dir", "unused", "--model_name_or_path", "hub/model", "--reward_funcs", *reward_funcs]
        return run_identity(*HfArgumentParser(ARGUMENT_CLASSES).parse_args_into_dataclasses(args=argv))

    before = identity(f"{rewards}:marker", "exact_match")
    rewards.write_text(MARKER_REWARD.replace('1.0 if "', '2.5 if "'))
    after = identity(f"{rewards}:marker", "exact_match")
    differences, note = check_identity("checkpoint-4", {"identity_version": 2, "identity": before}, after)
    assert note is None and [d.split(" {")[0] for d in differences] == ["--reward_funcs contents"], differences
    earlier = {name: value for name, value in before.items() if name != "--reward_funcs contents"}
    differences, note = check_identity("checkpoint-4", {"identity_version": 2, "identity": earlier}, after)
    assert differences == [] and note == ("checkpoint-4: written before --reward_funcs contents joined the run "
                                          "identity: resuming without checking them")
    assert "--reward_funcs contents" not in identity("exact_match", "think_format")


# Four rollouts, a checkpoint after each, two updates per rollout (the old policy from the no-grad pass), the EMA on.
RESUMED = {"max_steps": 8, "save_strategy": "steps", "save_steps": 2, "num_iterations": 2, "enable_ema": True,
           "ema_beta": 0.5, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "beta": 0.05}


@pytest.mark.slow
def test_grpo_resume_after_kills_continues_bit_for_bit(tiny_model_dir, grpo_inputs, tmp_path):
    """Killed at seeded random steps and rerun until done: each rerun starts at the last checkpoint, the step log
    and the saved adapters (grpo_lora_model, actor_ema) equal the uninterrupted run's bit for bit."""
    def args_for(output_dir):
        return grpo_args(tiny_model_dir, grpo_inputs, output_dir, **RESUMED)

    proof = resume_proof(1, GRPO_SCRIPT, args_for, tmp_path, seed="grpo-1", total=RESUMED["max_steps"],
                         save_steps=RESUMED["save_steps"])
    proof.check_processes_after_random_kills()
    assert "GRPO: 2 optimizer step(s) per iteration" in proof.resumed_output()
    expected, actual = (trained_figures(step_logs(proof.root / name)) for name in ("reference", "crashed"))
    assert len(expected) == 8 and expected == actual
    for name in ("grpo_lora_model", "actor_ema"):
        proof.check_bit_identical(name)
    proof.check_process_after_end_kill()


def test_qlora_grpo_with_ppo_flag_names_trains_on_a_4bit_base(tiny_model_dir, grpo_inputs, tmp_path):
    """--load_in_kbits 4 (QLoRA): two rollouts on the quantized base with the reference (--beta > 0, given by PPO's
    name --kl_ctl, mapped with a log line) log finite losses and a KL, and the adapter learns; the rollout decodes
    with the adapter unmerged on a quantized base, said once."""
    out = tmp_path / "out"
    args = grpo_args(tiny_model_dir, grpo_inputs, out, load_in_kbits=4, kl_ctl=0.1, enable_hybrid_engine=True,
                     model_name_or_path=None, actor_model_name_or_path=tiny_model_dir, max_steps=2)
    result = run_script(args, script=GRPO_SCRIPT)
    assert_ok(result)
    log = result.stdout + result.stderr
    assert "flag mapped: --kl_ctl 0.1 -> --beta" in log
    assert log.count("decodes with its adapter unmerged: the base is quantized") == 1
    steps = step_logs(out)
    assert len(steps) == 2 and all(math.isfinite(entry["loss"]) for entry in steps)
    assert steps[1]["kl"] > 0, steps
    actor = adapter_weights(out / "grpo_lora_model")
    assert any(key.endswith("lora_B.weight") and actor[key].abs().sum() > 0 for key in actor)


@pytest.mark.slow
def test_grpo_zero3_two_processes_resume_after_a_kill_bit_for_bit(tiny_model_dir, grpo_inputs, tmp_path):
    """Under torchrun with ZeRO-3 on two processes, killed once at a seeded random step and once while writing a
    checkpoint: the rerun starts at the last complete checkpoint and ends with the uninterrupted run's adapter."""
    def args_for(output_dir):
        return grpo_args(tiny_model_dir, grpo_inputs, output_dir, **RESUMED,
                         deepspeed=os.path.join(REPO, "ds_configs", "ds_zero3_no_offload.json"))

    proof = resume_proof(2, GRPO_SCRIPT, args_for, tmp_path, seed="grpo-2", total=RESUMED["max_steps"],
                         save_steps=RESUMED["save_steps"])
    proof.check_processes_after_random_kills()
    proof.check_process_after_mid_save_kill()
    expected, actual = (trained_figures(step_logs(proof.root / name)) for name in ("reference", "crashed"))
    assert expected == actual
    for name in ("grpo_lora_model", "actor_ema"):
        proof.check_bit_identical(name)


@pytest.mark.slow
def test_two_processes_equal_one_on_the_same_global_batch(tiny_model_dir, grpo_inputs, tmp_path):
    """Two processes of 2 prompts x 4 answers each and one process of 4 prompts x 4: the same prompts, the same
    answers sampled (a seed per generation batch), the same global statistics (the batch std of --scale_rewards
    batch, dapo's token count) and so the same two steps and adapter, within float summation order."""
    common = {"scale_rewards": "batch", "loss_type": "dapo", "per_device_generation_batch_size": 4, "max_steps": 2}
    runs = {1: {"per_device_train_batch_size": 16}, 2: {"per_device_train_batch_size": 8}}
    for nproc, batch in runs.items():
        args = grpo_args(tiny_model_dir, grpo_inputs, tmp_path / f"out{nproc}", **common, **batch)
        assert_ok(run_script(args, nproc=nproc, script=GRPO_SCRIPT))
    one, two = step_logs(tmp_path / "out1"), step_logs(tmp_path / "out2")
    assert len(one) == len(two) == 2
    for first, second in zip(one, two, strict=True):
        assert first["reward_mean"] == second["reward_mean"] and first["response_length"] == second["response_length"]
        for key in ("loss", "grad_norm", "entropy"):
            assert abs(first[key] - second[key]) <= 1e-5 * max(1.0, abs(first[key])), (key, first, second)
    assert one[0]["reward_std"] > 0  # a batch with signal to learn from
    first, second = (adapter_weights(tmp_path / f"out{nproc}" / "grpo_lora_model") for nproc in (1, 2))
    assert max((first[key] - second[key]).abs().max().item() for key in first) < 1e-5


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_the_reference_runs_only_where_its_kl_is_paid(beta, tiny_model_dir, grpo_inputs, tmp_path, monkeypatch):
    """A probe on the policy's log-prob passes: with --beta 0 no pass runs under the reference role (and no
    reference adapter is loaded); with --beta 0.1 every rollout runs one per answer batch."""
    from lorakit.rl.role_policy import RolePolicy

    roles = []
    original = RolePolicy.answer_logprobs

    def probed(self, role, *args, **kwargs):
        roles.append(role)
        return original(self, role, *args, **kwargs)

    monkeypatch.setattr(RolePolicy, "answer_logprobs", probed)
    out = tmp_path / "out"
    result = run_in_process(GRPO_SCRIPT, grpo_args(tiny_model_dir, grpo_inputs, out, beta=beta, max_steps=2))
    assert_ok(result)
    assert (roles.count("reference") > 0) == (beta > 0) and roles.count("actor") > 0, roles
    steps = step_logs(out)
    # The first update starts at the reference (a new adapter adds nothing): a KL only from the second step on.
    assert steps[0]["kl"] == 0 and (steps[1]["kl"] > 0) == (beta > 0), steps
    assert all(entry["reward/marker_std"] == pytest.approx(entry["reward_std"]) for entry in steps), steps


@pytest.mark.parametrize("masked", [False, True])
def test_truncated_answers_can_be_left_out_of_the_update(masked, tiny_model_dir, grpo_inputs, tmp_path):
    """--mask_truncated_completions (TRL's): answers cut at the 4-token limit are scored as usual but not trained on;
    the update trains on exactly the tokens of the answers that ended (all of them without the flag)."""
    out = tmp_path / "out"
    args = grpo_args(tiny_model_dir, grpo_inputs, out, max_completion_length=4, mask_truncated_completions=masked,
                     max_steps=1)
    assert_ok(run_in_process(GRPO_SCRIPT, args))
    (step,) = step_logs(out)
    assert 0 < step["clipped_share"] < 1 and "reward/marker_mean" in step, step
    if not masked:
        assert step["trained_token_share"] == 1
    else:
        # A cut answer holds all 4 tokens: the answers that ended hold the rest of the 16 answers' tokens.
        all_tokens = step["response_length"] * 16
        ended_tokens = all_tokens - 4 * step["clipped_share"] * 16
        assert step["trained_token_share"] == pytest.approx(ended_tokens / all_tokens), step
