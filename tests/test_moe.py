"""Mixtures of experts (helpers/families.py's MOE_FAMILIES: Qwen3-MoE, Mixtral and Qwen2-MoE with a shared expert,
each with its family's real tokenizer and template): --trainable all-linear reaches the fused experts
(transformers 5's mlp.experts.gate_up_proj / down_proj, no nn.Linear) and every expert's LoRA weights move; an
explicit --trainable list that would leave them frozen is refused unless --lora_experts no says so; every stage runs
on Qwen3-MoE, one after the other.

The scripts run in this process through run_cli, as their command line runs them (a process start costs ~11 s)."""

import json
import os

import pytest
import torch

from helpers.commands import PT_SCRIPT, REPO, SFT_SCRIPT, TRAINING, check_refused, options_to_argv, run_in_process
from helpers.families import MOE_FAMILIES
from helpers.run_outputs import adapter_weights, losses_of
from lorakit.core.model_files import expert_parameter_targets
from test_family_stages import TRAINING_OPTIONS, assert_ran, data_files, training_args  # noqa: F401 (a fixture)

RM_SCRIPT = os.path.join(TRAINING, "run_reward.py")
DPO_SCRIPT = os.path.join(TRAINING, "run_dpo.py")
PPO_SCRIPT = os.path.join(TRAINING, "run_ppo.py")
GRPO_SCRIPT = os.path.join(TRAINING, "run_grpo.py")
MERGE_SCRIPT = os.path.join(REPO, "scripts", "merge", "merge_llama_with_lora.py")
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SFT_STEPS = 4


def expert_lora_b(weights: dict) -> dict:
    """name -> lora_B of each expert wrapper in an adapter (peft's ParamWrapper: [out, rank x experts])."""
    return {name: value for name, value in weights.items() if ".experts." in name and "lora_B" in name}


def test_expert_targets_read_the_same_whichever_peft_wrote_them():
    """peft 0.22 records Qwen2-MoE's experts under two spellings (ours and the bare tail): read as one list, and a
    bare name marks no module as an expert wrapper, so the Linear layers beside it keep their shape check."""
    from lorakit.core.model_files import adapter_updates, expert_wrapper

    written_by_0_22 = ["gate_up_proj", "mlp.experts.down_proj", "mlp.experts.gate_up_proj", "down_proj"]
    assert expert_parameter_targets(written_by_0_22) == sorted(EXPERT_WEIGHTS)
    assert expert_parameter_targets(EXPERT_WEIGHTS) == sorted(EXPERT_WEIGHTS) == expert_parameter_targets(
        set(written_by_0_22))
    assert expert_parameter_targets(None) == [] and expert_parameter_targets(["down_proj"]) == ["down_proj"]
    config = {"target_parameters": written_by_0_22}
    assert expert_wrapper("model.layers.0.mlp.experts.base_layer", config)
    assert not expert_wrapper("model.layers.0.self_attn.q_proj", config)
    assert not expert_wrapper("model.layers.0.self_attn.q_proj", {"target_parameters": ["down_proj"]})
    tensors = {f"base_model.model.model.layers.0.self_attn.q_proj.lora_{part}.weight": {"shape": shape}
               for part, shape in (("A", [8, 32]), ("B", [64, 8]))}
    assert adapter_updates(config, tensors) == {"model.layers.0.self_attn.q_proj.weight": (64, 32)}


@pytest.fixture(scope="module")
def moe_sft(family_model_dir, data_files, tmp_path_factory):  # noqa: F811 (data_files is the imported fixture)
    """name -> (output dir, log) of a few SFT steps with the family's own template, --trainable all-linear and the
    default --lora_dropout (0.05)."""
    root = tmp_path_factory.mktemp("moe_sft")
    runs = {}
    for name in MOE_FAMILIES:
        options = {**TRAINING_OPTIONS, "lora_dropout": 0.05, "max_steps": SFT_STEPS, "max_seq_length": 128,
                   "per_device_train_batch_size": 8}
        args = ["--do_train", "--use_cpu"] + options_to_argv(
            {"model_name_or_path": family_model_dir(name), "output_dir": root / name, "data_cache_dir": root / "cache",
             "data_path": data_files["sft"], **options})
        runs[name] = (root / name, assert_ran(run_in_process(SFT_SCRIPT, args)))
    return runs


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_sft_trains_every_expert_of_every_layer(name, moe_sft):
    out, log = moe_sft[name]
    weights = adapter_weights(out / "sft_lora_model")
    experts = expert_lora_b(weights)
    config = json.loads((out / "sft_lora_model" / "adapter_config.json").read_text())
    # peft 0.21 records our two names; 0.22 adds their bare tails on Qwen2-MoE (expert_parameter_targets): the same
    # two weights either way.
    assert set(config["target_parameters"]) - set(EXPERT_WEIGHTS) <= {"gate_up_proj", "down_proj"}
    assert expert_parameter_targets(config["target_parameters"]) == sorted(EXPERT_WEIGHTS)
    assert config["lora_dropout"] == 0.0
    # Two wrappers (gate_up_proj, down_proj) in each of the 2 layers.
    assert len(experts) == 4, sorted(experts)
    count = MOE_FAMILIES[name].config.get("num_experts") or MOE_FAMILIES[name].config["num_local_experts"]
    for key, value in experts.items():
        per_expert = value.reshape(value.shape[0], -1, count).abs().amax(dim=(0, 1))
        assert bool((per_expert > 0).all()), f"{key}: experts {per_expert.tolist()} (0: untrained)"
    assert all(torch.isfinite(value).all() for value in weights.values())
    assert "--lora_dropout 0.05 -> 0 for this adapter" in log
    kinds = log.split("trainable parameters by kind (mixture of experts): ")[1].splitlines()[0]
    assert "experts 0" not in kinds.replace("shared experts", "") and "attention 0" not in kinds
    shared = "shared experts 0" not in kinds
    assert shared == (name == "qwen2-moe"), kinds
    losses = losses_of(out)
    assert len(losses) == SFT_STEPS and losses[-1] < losses[0]


def test_a_list_that_would_freeze_the_experts_is_refused(family_model_dir, data_files, tmp_path):  # noqa: F811
    args = training_args(family_model_dir("qwen3-moe"), tmp_path / "out", tmp_path / "cache",
                         data_path=data_files["sft"], trainable="q_proj,v_proj", max_steps=1)
    check_refused(run_in_process(SFT_SCRIPT, args),
                  "--trainable q_proj,v_proj leaves the experts of this mixture-of-experts model frozen "
                  "(mlp.experts.gate_up_proj, mlp.experts.down_proj): add --lora_experts yes")
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    dense = training_args(family_model_dir("qwen3"), tmp_path / "out", tmp_path / "cache",
                          data_path=data_files["sft"], lora_experts="yes", max_steps=1)
    check_refused(run_in_process(SFT_SCRIPT, dense), "--lora_experts yes: this model has no fused expert weights")


def test_lora_experts_no_trains_only_the_list(family_model_dir, data_files, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    assert_ran(run_in_process(SFT_SCRIPT, training_args(
        family_model_dir("qwen3-moe"), out, tmp_path / "cache", data_path=data_files["sft"], trainable="q_proj,v_proj",
        lora_experts="no", max_steps=1, max_seq_length=128)))
    weights = adapter_weights(out / "sft_lora_model")
    assert weights and not expert_lora_b(weights)
    assert {key.split(".")[-3] for key in weights if "lora_A" in key} == {"q_proj", "v_proj"}


# What SFT trains of "Four." under each family's template: the answer and its turn end (Qwen3's template, thinking
# by default, opens the answer with an empty think block, trained with it).
TRAINED_ANSWER = {"qwen3-moe": "<think>\n\n</think>\n\nFour.<|im_end|>", "mixtral": "Four.</s>",
                  "qwen2-moe": "Four.<|im_end|>"}


def test_sft_masks_the_answers_with_the_family_template(family_model_dir):
    """The trained labels are each answer and its turn end, as the family's real template renders them."""
    from transformers import AutoTokenizer

    from lorakit.data.conversation_tokenizer import ConversationTokenizer

    for name in MOE_FAMILIES:
        tokenizer = AutoTokenizer.from_pretrained(family_model_dir(name))
        conversation = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]
        row = ConversationTokenizer(tokenizer, tokenizer.chat_template, 256)("t", conversation)
        trained = tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"], strict=True)
                                    if label != -100])
        assert trained.strip() == TRAINED_ANSWER[name], (name, trained)


@pytest.fixture(scope="module")
def qwen3_moe_chain(family_model_dir, data_files, pretrain_dir, tmp_path_factory):  # noqa: F811
    """Every stage on Qwen3-MoE, each from what the one before saved: pretraining, SFT, the reward model, DPO, PPO
    (shared base: the actor's and the reward model's expert adapters on one model) and GRPO. stage -> (output
    dir, log)."""
    root, base = tmp_path_factory.mktemp("qwen3_moe_chain"), family_model_dir("qwen3-moe")
    pairs = os.path.join(REPO, "data", "rm_sample", "pairs.jsonl")
    prompts = os.path.join(REPO, "data", "ppo_sample", "prompts.jsonl")
    runs = {}

    def run(stage: str, script: str, args: list) -> None:
        runs[stage] = (root / stage, assert_ran(run_in_process(script, args)))

    common = {"max_steps": 2, "per_device_train_batch_size": 2}
    run("pt", PT_SCRIPT, training_args(base, root / "pt", root / "cache", dataset_dir=pretrain_dir, block_size=64,
                                       **common))
    run("sft", SFT_SCRIPT, training_args(base, root / "sft", root / "cache", data_path=data_files["sft"],
                                         max_seq_length=128, **common))
    run("reward", RM_SCRIPT, training_args(base, root / "reward", root / "cache", data_path=pairs, max_seq_length=256,
                                           **common))
    run("dpo", DPO_SCRIPT, training_args(base, root / "dpo", root / "cache", data_path=pairs, max_seq_length=256,
                                         peft_path=root / "sft" / "sft_lora_model", **common))
    rl = {"reward_model_name_or_path": base, "reward_lora_model": root / "reward" / "rm_lora_model",
          "data_path": prompts, "max_prompt_seq_len": 96, "max_answer_seq_len": 8, "max_steps": 2,
          "lora_dropout": 0.0, "torch_dtype": "float32", "report_to": "none", "save_strategy": "no",
          "logging_steps": 1, "seed": 1}
    run("ppo", PPO_SCRIPT, ["--use_cpu"] + options_to_argv(
        {**rl, "actor_model_name_or_path": base, "actor_lora_model": root / "sft" / "sft_lora_model",
         "shared_base": "true", "per_device_generation_batch_size": 4, "per_device_training_batch_size": 4,
         "output_dir": root / "ppo"}))
    run("grpo", GRPO_SCRIPT, ["--use_cpu"] + options_to_argv(
        {**rl, "model_name_or_path": base, "peft_path": root / "sft" / "sft_lora_model", "num_generations": 2,
         "per_device_train_batch_size": 4, "output_dir": root / "grpo"}))
    return runs


@pytest.mark.slow
def test_every_stage_runs_on_qwen3_moe_one_after_the_other(qwen3_moe_chain):
    """Each stage trains (finite losses) and saves adapters whose experts trained (lora_B moved), PPO with the
    actor's and the reward model's expert adapters on one shared base."""
    saved = {}
    for stage, (out, log) in qwen3_moe_chain.items():
        losses = losses_of(out)
        assert losses and all(torch.isfinite(torch.tensor(losses))), (stage, losses)
        assert "trainable parameters by kind (mixture of experts)" in log, stage
        saved[stage] = sorted(path.parent.name for path in out.glob("*/adapter_model.safetensors"))
        for name in saved[stage]:
            experts = expert_lora_b(adapter_weights(out / name))
            assert experts and any(value.abs().max() > 0 for value in experts.values()), (stage, name)
    assert "placement: shared base" in qwen3_moe_chain["ppo"][1]
    assert all(saved.values()), saved


@pytest.mark.slow
def test_roles_training_other_experts_take_separate_models(qwen3_moe_chain, family_model_dir, data_files,  # noqa: F811
                                                           tmp_path):
    """An actor adapter that leaves the experts frozen (--lora_experts no) beside a reward adapter that trains them:
    peft cannot hold both on one base, so PPO places the roles on separate models, saying why; GRPO, whose reward
    adapter sits on the actor's base, refuses in one line."""
    base = family_model_dir("qwen3-moe")
    assert_ran(run_in_process(SFT_SCRIPT, training_args(
        base, tmp_path / "sft", tmp_path / "cache", data_path=data_files["sft"], trainable="q_proj,v_proj",
        lora_experts="no", max_steps=1, max_seq_length=128)))
    reward = qwen3_moe_chain["reward"][0] / "rm_lora_model"
    rl = {"reward_model_name_or_path": base, "reward_lora_model": reward, "lora_experts": "no",
          "data_path": os.path.join(REPO, "data", "ppo_sample", "prompts.jsonl"), "max_prompt_seq_len": 96,
          "max_answer_seq_len": 8, "max_steps": 1, "torch_dtype": "float32", "report_to": "none",
          "save_strategy": "no", "logging_steps": 1, "seed": 1}
    log = assert_ran(run_in_process(PPO_SCRIPT, ["--use_cpu"] + options_to_argv(
        {**rl, "actor_model_name_or_path": base, "actor_lora_model": tmp_path / "sft" / "sft_lora_model",
         "per_device_generation_batch_size": 4, "per_device_training_batch_size": 4, "output_dir": tmp_path / "ppo"})))
    assert ("placement: separate models, as the actor's adapter trains the experts (none) and the reward model's "
            "mlp.experts.down_proj, mlp.experts.gate_up_proj") in log
    assert losses_of(tmp_path / "ppo")
    grpo = run_in_process(GRPO_SCRIPT, ["--use_cpu"] + options_to_argv(
        {**rl, "model_name_or_path": base, "peft_path": tmp_path / "sft" / "sft_lora_model", "num_generations": 2,
         "per_device_train_batch_size": 4, "output_dir": tmp_path / "grpo"}))
    check_refused(grpo, f"--reward_lora_model {reward} trains the experts mlp.experts.down_proj, "
                        "mlp.experts.gate_up_proj, the actor's adapter (none)")


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_the_merged_sft_adapter_reloads_with_peft_merges_logits(name, moe_sft, family_model_dir, tmp_path):
    """merge_llama_with_lora.py on each family's trained SFT adapter (experts included): the merged directory loads
    in transformers with the logits of peft's merge_and_unload."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, adapter, merged_dir = family_model_dir(name), moe_sft[name][0] / "sft_lora_model", tmp_path / "merged"
    assert_ran(run_in_process(MERGE_SCRIPT, ["--base_model", base, "--lora_model", adapter, "--output_dir",
                                             merged_dir]))
    ids = torch.randint(10, 5000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                             adapter).merge_and_unload()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(input_ids=ids).logits
    assert (merged - expected).abs().max() <= 1e-4
    assert (merged - plain).abs().max() > 1e-3
