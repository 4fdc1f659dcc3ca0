"""Precision: a merged model is saved in its base's dtype; PPO's frozen roles run in the training
precision; trainable weights on a half-precision model are kept in float32, so an update below
half precision's resolution survives (it would round away in bfloat16 or float16)."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from lorakit.core.model_files import checkpoint_shapes
from lorakit.models.arguments import ModelArguments
from lorakit.models.loader import load_model, load_model_config
from lorakit.trainers.arguments import ToolkitTrainingArguments

# One AdamW step moves each weight by about the learning rate: far below bfloat16's resolution
# (2^-8 of a weight) and float16's (2^-11) at the tiny model's weights, far above float32's.
TINY_LEARNING_RATE = 1e-7


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def bf16_model_dir(tiny_model_dir, tokenizer, tmp_path_factory):
    """The tiny model saved in bfloat16, as most published checkpoints are."""
    out = tmp_path_factory.mktemp("tiny_bf16")
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def reward_adapter_dir(tiny_model_dir, tokenizer, tmp_path_factory):
    """A reward adapter (LoRA + score head) with non-zero LoRA updates, as run_reward.py saves one."""
    model = load_model(ModelArguments(model_name_or_path=tiny_model_dir, torch_dtype="float32", lora_dropout=0.0),
                       None, tokenizer, task="reward")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    out = tmp_path_factory.mktemp("rm_adapter") / "rm_lora_model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def stored_dtypes(model_dir) -> set:
    return {dtype for dtype, _ in checkpoint_shapes(str(model_dir)).values()}


def stored_tensors(model_dir) -> dict:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def test_merged_reward_model_is_saved_in_the_base_dtype(bf16_model_dir, tokenizer, reward_adapter_dir, tmp_path):
    """The stage's merge (the streaming merge tool, in a child process; its scores are checked against base +
    adapter in tests/trainers/test_reward.py) keeps a bfloat16 base's dtype, score head included."""
    from lorakit.commands.reward import save_merged

    assert stored_dtypes(bf16_model_dir) == {"BF16"}
    out = tmp_path / "reward"
    shutil.copytree(reward_adapter_dir, out / "rm_lora_model")
    model_args = ModelArguments(model_name_or_path=bf16_model_dir, lora_dropout=0.0)
    save_merged(model_args, SimpleNamespace(output_dir=str(out)))
    merged_dir = out / "rm_merged_model"
    assert stored_dtypes(merged_dir) == {"BF16"}
    assert json.loads((merged_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert stored_tensors(merged_dir)["score.weight"].dtype == torch.bfloat16


def ppo_arguments(tmp_path, actor_dir, reward_adapter_dir, shared_base):
    from lorakit.rl.ppo_config import PPOArguments, PPOModelArguments

    model_args = PPOModelArguments(actor_model_name_or_path=actor_dir, reward_model_name_or_path=actor_dir,
                                   reward_lora_model=reward_adapter_dir, lora_dropout=0.0, shared_base=shared_base)
    training_args = PPOArguments(output_dir=str(tmp_path / "ppo"), bf16=True, use_cpu=True, report_to="none")
    config = load_model_config(ModelArguments(model_name_or_path=actor_dir))
    return model_args, training_args, {"actor": config, "reward": config}


def answer_batch(tokenizer) -> tuple:
    """Two left-padded rows of prompt and answer, the answer starting at position 6."""
    ids = tokenizer(["我们 今天 学习 the quick fox", "北京 天气 很好"])["input_ids"]
    width = max(len(row) for row in ids)
    input_ids = torch.tensor([[tokenizer.eos_token_id] * (width - len(row)) + row for row in ids])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    return input_ids, mask


def test_ppo_frozen_roles_run_in_the_training_precision(tiny_model_dir, tokenizer, reward_adapter_dir, tmp_path):
    from lorakit.rl.ppo_policy import load_separate_policy

    assert stored_dtypes(tiny_model_dir) == {"F32"}
    model_args, training_args, configs = ppo_arguments(tmp_path, tiny_model_dir, reward_adapter_dir, shared_base=False)
    policy = load_separate_policy(model_args, training_args, tokenizer, configs)
    for role in ("reference", "reward"):
        assert {p.dtype for p in policy.frozen[role].parameters()} == {torch.bfloat16}, role
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {torch.float32}
    input_ids, mask = answer_batch(tokenizer)
    with torch.no_grad():
        scores = policy.scores(input_ids, mask)
        reference = policy.answer_logprobs("reference", input_ids, mask, 6)
    assert torch.isfinite(scores).all() and torch.isfinite(reference).all()


def one_tiny_step(trainable: dict, loss, scaler=None) -> dict:
    """{name: change} of one AdamW step at TINY_LEARNING_RATE on loss (through --fp16's grad scaler if given)."""
    before = {name: param.detach().clone() for name, param in trainable.items()}
    optimizer = torch.optim.AdamW(trainable.values(), lr=TINY_LEARNING_RATE, weight_decay=0.0)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # refuses float16 gradients
        scaler.step(optimizer)
    return {name: param.detach() - before[name] for name, param in trainable.items()}, before


def assert_update_survives_only_in_float32(change, before, half_dtype) -> None:
    """The float32 weight moved; the same update on the weight stored in half_dtype rounds away."""
    moved = change != 0
    assert moved.sum() > 0
    half = before.to(half_dtype)
    kept_in_half = (half.float() + change).to(half_dtype) != half
    assert kept_in_half[moved].float().mean() < 0.1


@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
def test_trained_copies_stay_float32_and_a_tiny_update_survives(half_dtype, bf16_model_dir, tokenizer, tmp_path):
    name = str(half_dtype).split(".")[1]
    model = load_model(
        ModelArguments(model_name_or_path=bf16_model_dir, torch_dtype=name, lora_dropout=0.0,
                       modules_to_save="embed_tokens,lm_head"),
        ToolkitTrainingArguments(output_dir=str(tmp_path), bf16=half_dtype == torch.bfloat16, use_cpu=True,
                                 report_to="none"),
        tokenizer)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    copies = [n for n in trainable if ".modules_to_save." in n]
    assert len(copies) == 2 and {p.dtype for p in trainable.values()} == {torch.float32}
    assert model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.dtype == half_dtype
    input_ids, _ = answer_batch(tokenizer)
    with torch.no_grad():  # outside autocast too (as PPO's generation runs): half-precision logits
        assert model(input_ids=input_ids).logits.dtype == half_dtype
    with torch.autocast("cpu", dtype=half_dtype):  # as the Trainer's --bf16 / --fp16 run it
        loss = model(input_ids=input_ids, labels=input_ids).loss
    scaler = torch.amp.GradScaler("cpu") if half_dtype == torch.float16 else None
    change, before = one_tiny_step(trainable, loss, scaler)
    for name in copies:
        assert_update_survives_only_in_float32(change[name], before[name], half_dtype)


def test_ppo_value_head_stays_float32_and_a_tiny_update_survives(bf16_model_dir, tokenizer, reward_adapter_dir,
                                                                 tmp_path):
    from lorakit.rl.ppo_policy import load_shared_policy

    model_args, training_args, configs = ppo_arguments(tmp_path, bf16_model_dir, reward_adapter_dir, shared_base=True)
    policy = load_shared_policy(model_args, training_args, tokenizer, configs)
    assert policy.value_head.weight.dtype == torch.float32 and policy.value_head.weight.requires_grad
    assert policy.score_head.weight.dtype == torch.bfloat16  # frozen: the base's precision
    input_ids, mask = answer_batch(tokenizer)
    values = policy.answer_values(input_ids, mask, 6)  # outside autocast, as experience is made
    change, before = one_tiny_step({"value_head": policy.value_head.weight}, values.pow(2).mean())
    assert_update_survives_only_in_float32(change["value_head"], before["value_head"], torch.bfloat16)
