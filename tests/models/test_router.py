"""Mixture-of-experts routers (lorakit.models.router, lorakit.trainers.router_monitor): the stages' own losses carry the
router load-balancing term exactly as transformers' loss does (SFT's chunked loss, DPO's policy pass, the RL actor's
pass), and the router statistics: figures and warnings from hand-made counts, summed over processes, and from a tiny
Qwen3-MoE whose router is collapsed (warns) or random (does not)."""

import logging
import types

import pytest
import torch

from lorakit.models.router import (
    MIN_TOKENS_TO_WARN,
    RouterCounter,
    find_routers,
    overload_threshold,
    overloads,
    router_aux_coef,
    router_figures,
)

VOCAB = 300


# Tiny configs of the three kinds (transformers 5: fused experts behind a TopKRouter at mlp.gate); Qwen2-MoE adds a
# shared expert gated by a one-unit Linear, shared_expert_gate, which is no router.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 16}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 4, "moe_intermediate_size": 16,
                                                           "shared_expert_intermediate_size": 32}),
}


def moe_config(family: str = "qwen3_moe", **overrides):
    import transformers

    config_class, _, options = FAMILIES[family]
    options = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 16, "num_experts_per_tok": 2, "intermediate_size": 64, "vocab_size": VOCAB,
               "max_position_embeddings": 128, "router_aux_loss_coef": 0.001, **options, **overrides}
    return getattr(transformers, config_class)(**options)


def with_lora(model, **options):
    """The model under a LoRA whose B is not zero (as after training), so the adapter changes the routing too."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                  init_lora_weights=False, **options))
    return peft_model.float()


def tiny_moe(family: str = "qwen3_moe"):
    """A tiny causal LM of the family, random weights in float32, under LoRA."""
    import transformers

    torch.manual_seed(0)
    return with_lora(getattr(transformers, FAMILIES[family][1])(moe_config(family)))


def training_args(tmp_path, **overrides):
    from lorakit.trainers.arguments import CausalLMTrainingArguments

    options = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none", "save_strategy": "no",
               "seed": 0, "disable_tqdm": True, "chunked_loss": True, **overrides}
    return CausalLMTrainingArguments(**options)


def sft_batch(seed: int = 3, rows: int = 3, width: int = 20) -> dict:
    """Right-padded rows, labels -100 on a prompt and on the padding."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (rows, width), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, width - 6:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ----------------------------------------------------------------------------- the aux loss


def test_which_models_have_a_router_aux_loss():
    """Qwen3-MoE's causal LM and DPO's head class on it: the config's coefficient; a dense model, a router that
    balances without an aux loss (DeepSeek-V3) and a sequence classifier (the reward model): none."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    from lorakit.models.heads import answer_logps_model_class, reward_model_class

    config = moe_config()
    assert router_aux_coef(tiny_moe()) == config.router_aux_loss_coef == 0.001
    assert router_aux_coef(with_lora(answer_logps_model_class(config)(config))) == 0.001
    assert router_aux_coef(reward_model_class(config)(moe_config(num_labels=1))) == 0.0
    assert router_aux_coef(tiny_moe().get_base_model().__class__(moe_config(router_aux_loss_coef=0.0))) == 0.0
    dense = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=VOCAB))
    assert router_aux_coef(dense) == 0.0 and find_routers(dense) == []
    deepseek = DeepseekV3ForCausalLM(DeepseekV3Config(
        hidden_size=32, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, vocab_size=VOCAB, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8))
    assert router_aux_coef(deepseek) == 0.0
    assert [site.name for site in find_routers(deepseek)] == ["model.layers.1.mlp.gate"]  # still monitored


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sft_chunked_loss_equals_transformers_loss_with_the_router_term(family, tmp_path):
    """CausalLMTrainer's chunked loss of an MoE batch equals transformers' own with output_router_logits (mean
    cross-entropy + coef * aux_loss, <= 1e-5), with the Trainer's token count and with a per-batch mean, and differs
    from the loss without the router term; the eval loss (perplexity's) has no router term. One router per layer."""
    from lorakit.trainers.causal_lm import build_trainer

    model = tiny_moe(family)
    assert [site.name.rsplit("layers.", 1)[-1] for site in find_routers(model)] == ["0.mlp.gate", "1.mlp.gate"]
    trainer = build_trainer(model, training_args(tmp_path), None, None, None, None, [])
    batch = sft_batch()
    model.train()
    with_router = model(**batch, output_router_logits=True).loss
    without = model(**batch).loss
    assert (with_router - without).abs() > 1e-4
    counted = (batch["labels"][:, 1:] != -100).sum()
    for items in (counted, None):
        loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=items)
        assert trainer.chunked_loss_exact
        torch.testing.assert_close(loss, with_router, atol=1e-5, rtol=0)
    model.eval()
    torch.testing.assert_close(trainer.compute_loss(model, dict(batch)), without, atol=1e-5, rtol=0)


def dpo_features(rows: int = 2) -> list[dict]:
    generator = torch.Generator().manual_seed(7)
    features = []
    for row in range(rows):
        prompt = torch.randint(5, VOCAB, (6 + row,), generator=generator).tolist()
        chosen = prompt + torch.randint(5, VOCAB, (4,), generator=generator).tolist()
        rejected = prompt + torch.randint(5, VOCAB, (3 + 2 * row,), generator=generator).tolist()
        features.append({"chosen_input_ids": chosen, "rejected_input_ids": rejected,
                         "chosen_answer_start": len(prompt), "rejected_answer_start": len(prompt)})
    return features


def test_dpo_policy_pass_carries_transformers_router_aux_loss(tmp_path):
    """DPO's policy pass (two rows per pair) gives the aux loss transformers' forward gives on the same rows, its
    shared-prefix rows an aux loss too (and router counts without their padding), and DPOTrainer's loss is the
    preference loss + coef * that aux loss."""
    from lorakit.core.pair_segments import PAIR_PADDING
    from lorakit.models.heads import answer_logps_model_class
    from lorakit.trainers.dpo_config import DPOArguments
    from lorakit.trainers.dpo_trainer import DataCollatorForAnswerLogps, DPOTrainer, policy_answers

    torch.manual_seed(0)
    config = moe_config()
    model = with_lora(answer_logps_model_class(config)(config)).train()
    batch = DataCollatorForAnswerLogps(0, 1, share_prefix=False)(dpo_features())
    own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    answers = policy_answers(model, batch, routed=True)
    torch.testing.assert_close(answers.router_aux, own.aux_loss, atol=1e-6, rtol=0)
    assert policy_answers(model, batch).router_aux is None
    shared = DataCollatorForAnswerLogps(0, 1, share_prefix=True)(dpo_features())
    counter = RouterCounter(model, find_routers(model))  # a pair row's padding is found from its segments
    assert torch.isfinite(policy_answers(model, shared, routed=True).router_aux)
    real_tokens = int((shared["pair_segments"] != PAIR_PADDING).sum())
    assert real_tokens < shared["input_ids"].numel() and counter.take("cpu")[:, -1].tolist() == [real_tokens] * 2
    counter.remove()

    args = DPOArguments(output_dir=str(tmp_path / "dpo"), use_cpu=True, report_to="none", loss_type="simpo",
                        disable_tqdm=True)
    trainer = DPOTrainer(model=model, args=args, data_collator=None)
    assert trainer.router_aux_coef == 0.001
    loss = trainer.compute_loss(model, dict(batch))
    trainer.router_aux_coef = 0.0
    plain = trainer.compute_loss(model, dict(batch))
    torch.testing.assert_close(loss - plain, 0.001 * own.aux_loss, atol=1e-6, rtol=0)


def test_rl_actor_pass_carries_transformers_router_aux_loss():
    """The RL training pass (rl.role_policy.RolePolicy.forward) returns the actor's router aux loss, transformers' own
    on the same rows (left-padded prompts, padded answers); the no-grad old-policy pass and a policy without the
    coefficient return none; RLTrainer.add_router_aux adds coef * it to the loss and logs it."""
    from lorakit.models.positions import positions_from_mask
    from lorakit.rl.experience import SumStats
    from lorakit.rl.rl_trainer import RLTrainer
    from lorakit.rl.role_policy import SharedBasePolicy

    peft_model = tiny_moe()
    hidden = peft_model.config.hidden_size
    policy = SharedBasePolicy(peft_model, torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, 1), None, "unused")
    policy.group_by_length, policy.router_aux_coef = False, router_aux_coef(policy.generator())
    batch = sft_batch(seed=5, rows=4, width=14)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    mask[0, :3] = 0  # a left-padded prompt
    expected = peft_model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                          output_router_logits=True).aux_loss
    outputs = policy(ids, mask, 6, values=False)
    torch.testing.assert_close(outputs["router_aux_loss"], expected, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert "router_aux_loss" not in policy(ids, mask, 6, values=False)
    policy.router_aux_coef = 0.0
    assert "router_aux_loss" not in policy(ids, mask, 6, values=False)

    trainer = types.SimpleNamespace(train_stats=SumStats(), router_aux_coef=0.5)
    loss = RLTrainer.add_router_aux(trainer, torch.tensor(1.0), outputs)
    torch.testing.assert_close(loss, 1.0 + 0.5 * outputs["router_aux_loss"])
    assert trainer.train_stats.sums["router_aux_loss"] == [pytest.approx(outputs["router_aux_loss"].item()), 1.0]


# ----------------------------------------------------------------------------- router statistics


def counts_of(*layers: list[int]) -> torch.Tensor:
    """RouterCounter's layout from per-expert counts and each layer's tokens (the last number)."""
    return torch.tensor(layers, dtype=torch.long)


def test_figures_and_warnings_from_hand_made_counts():
    """Two routers of 4 experts, top-2, 100 tokens each: one sent every token to expert 0 and none to expert 3, the
    other balanced. The worst layer's share is 1, an eighth of the experts took nothing, and only the first layer is
    over its threshold (halfway from the uniform 0.5 to 1: 0.75); too few tokens warn of nothing."""
    counts = counts_of([100, 60, 40, 0, 100], [50, 50, 50, 50, 100])
    figures = router_figures(counts, [4, 4])
    assert figures.max_expert_share == pytest.approx(1.0)
    assert figures.unused_expert_share == pytest.approx(1 / 8)
    assert overload_threshold(0.5) == 0.75 and overload_threshold(2 / 128) == pytest.approx(0.5078125)
    (found,) = overloads(counts, [4, 4])
    assert (found.index, found.expert, found.share, found.uniform, found.threshold) == (0, 0, 1.0, 0.5, 0.75)
    assert not overloads(counts_of([74, 60, 40, 26, 100]), [4])  # 0.74: under the threshold
    assert not overloads(counts_of([MIN_TOKENS_TO_WARN - 1, 0, MIN_TOKENS_TO_WARN - 1, 0, MIN_TOKENS_TO_WARN - 1]),
                         [4])
    # A layer of 2 experts beside one of 4, and a router that saw nothing: neither counts against the other.
    figures = router_figures(counts_of([30, 30, 0, 0, 30], [0, 0, 0, 0, 0]), [2, 4])
    assert figures == (pytest.approx(1.0), 0.0)
    assert router_figures(counts_of([0, 0, 0, 0, 0]), [4]) is None


def test_the_monitor_sums_every_process_counts_before_its_figures(caplog):
    """RouterMonitor reduces each step's counts (here a reduce that adds a second process's) before the warning and
    the logged figures: this process alone is balanced, the sum is not; the figures span the steps since the last
    log."""
    from lorakit.trainers.router_monitor import RouterMonitor

    balanced, other_process = counts_of([50, 50, 50, 50, 100]), counts_of([300, 0, 0, 300, 300])
    counter = types.SimpleNamespace(experts=[4], sites=[types.SimpleNamespace(name="model.layers.0.mlp.gate")],
                                    take=lambda device: balanced.clone())
    state = types.SimpleNamespace(global_step=7, is_world_process_zero=True)
    alone = RouterMonitor(counter, lambda counts: counts, "cpu")
    with caplog.at_level(logging.WARNING, logger="lorakit.trainers.router_monitor"):
        alone.on_step_end(None, state, None)
        assert not caplog.records
        summed = RouterMonitor(counter, lambda counts: counts + other_process, "cpu")
        summed.on_step_end(None, state, None)
    (record,) = caplog.records
    assert record.getMessage().startswith("step 7: router model.layers.0.mlp.gate sent 87.5% of its 400 tokens to ")
    assert summed.pop_figures() == {"router/max_expert_share": 0.875, "router/unused_expert_share": 0.0}
    assert alone.pop_figures() == {"router/max_expert_share": 0.5, "router/unused_expert_share": 0.0}
    assert alone.pop_figures() == {}  # nothing since the last log
    state.is_world_process_zero = False  # another rank: its counts are reduced, no warning of its own
    caplog.clear()
    summed.on_step_end(None, state, None)
    summed.on_step_end(None, state, None)
    assert not caplog.records
    assert summed.pop_figures()["router/max_expert_share"] == 0.875


def collapse_routers(model) -> None:
    """Every token to expert 0 (and its second pick among the rest): a large constant in the embeddings' first
    dimension that the residual stream carries to every layer, and routers that read that dimension only."""
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 4.0
        for site in find_routers(model):
            site.module.weight.zero_()
            site.module.weight[0, 0] = 10.0


def train_briefly(model, tmp_path, steps: int = 3):
    from transformers import default_data_collator

    from lorakit.trainers.causal_lm import build_trainer

    rows = []
    for index in range(steps):  # a step's 2 rows: 74 real tokens
        batch = sft_batch(seed=index, rows=2, width=40)
        rows.extend({name: value[row] for name, value in batch.items()} for row in range(2))
    args = training_args(tmp_path, per_device_train_batch_size=2, max_steps=steps, logging_steps=1,
                         learning_rate=1e-3)
    trainer = build_trainer(model, args, None, rows, None, default_data_collator, [])
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_a_collapsed_router_warns_and_a_random_one_does_not(tmp_path, caplog):
    """A few SFT steps of a tiny Qwen3-MoE: routers that send every token to one expert log a max share of 1, half
    of the experts unused, and a warning each step naming it and the worst router; random routers (the false-positive
    check) log shares near the uniform 0.5 and no warning."""
    collapsed = tiny_moe()
    collapse_routers(collapsed)
    with caplog.at_level(logging.WARNING, logger="lorakit.trainers.router_monitor"):
        logs = train_briefly(collapsed, tmp_path / "collapsed")
    warnings = [record.getMessage() for record in caplog.records if record.name.endswith("router_monitor")]
    assert [log["router/max_expert_share"] for log in logs] == [1.0, 1.0, 1.0]
    assert [log["router/unused_expert_share"] for log in logs] == [0.5, 0.5, 0.5]
    assert len(warnings) == 3
    for step, message in enumerate(warnings, start=1):
        assert message.startswith(f"step {step}: router base_model.model.model.layers.0.mlp.gate sent 100.0% of its ")
        assert "1 other router(s) too" in message

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lorakit.trainers.router_monitor"):
        logs = train_briefly(tiny_moe(), tmp_path / "random")
    assert not [record for record in caplog.records if record.name.endswith("router_monitor")]
    assert all(0.5 < log["router/max_expert_share"] < 0.75 and log["router/unused_expert_share"] == 0 for log in logs)


def test_counts_skip_padding_and_passes_without_grad():
    """The counter counts each real token once per router in a forward with grad: not the padding, not a no-grad
    pass (evaluation, reference, generation), not the recomputation of a checkpointed layer in the backward pass."""
    model = tiny_moe()
    counter = RouterCounter(model, find_routers(model))
    batch = sft_batch()
    real_tokens = int(batch["attention_mask"].sum())
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    model.get_base_model().activation_checkpointing_enable()
    model.train()
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.sum().backward()
    counts = counter.take("cpu")
    assert counts[:, -1].tolist() == [real_tokens, real_tokens]
    assert counts[:, :-1].sum(dim=1).tolist() == [2 * real_tokens, 2 * real_tokens]  # top-2
    model(input_ids=batch["input_ids"]).logits.sum()  # no mask: every position
    assert counter.take("cpu")[:, -1].tolist() == [batch["input_ids"].numel()] * 2
    counter.remove()
