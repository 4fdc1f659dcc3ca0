"""The rollout engine (rl.rollout): decoding on the actor's adapter merged into the base weights
equals decoding on the unmerged adapter, and leaves every weight bit-identical to before."""

import logging
import types

import pytest
import torch


def shared_base_policy(model_dir):
    """A SharedBasePolicy with three non-trivial adapters (actor, critic, reward) on one fp32 base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorakit.rl.role_policy import SharedBasePolicy

    torch.manual_seed(0)
    causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = {"target_modules": ["q_proj", "v_proj", "down_proj"], "init_lora_weights": False, "lora_dropout": 0.0}
    peft_model = get_peft_model(causal_lm, LoraConfig(**lora))
    for name in ("critic", "reward"):
        peft_model.add_adapter(name, LoraConfig(**lora))
    hidden = causal_lm.config.hidden_size
    return SharedBasePolicy(peft_model, torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, 1), None, "unused").eval()


def weights(module):
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def lora_layers(module):
    from peft.tuners.lora import LoraLayer

    return [layer for layer in module.modules() if isinstance(layer, LoraLayer)]


def engine(policy, merge, name="eager", max_prompt_len=None):
    from lorakit.rl.rollout import rollout_engine

    args = types.SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, world_size=1, chunked_loss=True,
                                 generation_gather="auto", device=torch.device("cpu"), enable_hybrid_engine=merge,
                                 rollout_engine=name)
    eos = policy.generator().config.eos_token_id
    return rollout_engine(policy, args, pad_id=0, answer_end_id=eos, max_answer_len=12, deepspeed_engine=lambda: None,
                          max_prompt_len=max_prompt_len)


PROMPTS = [[5, 17, 42, 9], [33, 8, 12, 14], [101, 7, 64, 12], [21, 30, 31, 40]]


def test_merged_decoding_equals_unmerged_and_restores_every_weight_bit_for_bit(tiny_model_dir, caplog):
    from lorakit.rl.experience import left_pad
    from lorakit.rl.rollout import merged_adapters

    policy = shared_base_policy(tiny_model_dir)
    before = weights(policy)
    prompt_ids, prompt_mask = left_pad(PROMPTS, 4, 0)
    generator = policy.generator()
    with torch.no_grad():
        greedy = generator.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=False,
                                    max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        mask = torch.ones_like(greedy)
        unmerged = generator(input_ids=greedy, attention_mask=mask).logits
        with merged_adapters(generator) as merged:
            assert merged.layers == 3 * generator.config.num_hidden_layers
            assert all(layer.merged for layer in lora_layers(generator))
            merged_logits = generator(input_ids=greedy, attention_mask=mask).logits
            merged_greedy = generator.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=False,
                                               max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    assert (merged_logits - unmerged).abs().max().item() <= 1e-5
    # Greedy tokens agree wherever the top-2 margin exceeds the logits' difference.
    top2 = unmerged[:, 3:-1].topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 1e-5
    assert decided.float().mean() > 0.9
    assert torch.equal(merged_greedy[:, 4:][decided], greedy[:, 4:][decided]) or torch.equal(merged_greedy, greedy)
    after = weights(policy)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(layer.merged for layer in lora_layers(generator))
    # The critic and reward roles read the unmerged base with their own adapter after the rollout.
    ids = greedy[:, :8]
    with torch.no_grad():
        values = policy.answer_values(ids, torch.ones_like(ids), 4)
        fresh = shared_base_policy(tiny_model_dir)
        fresh.load_state_dict(before)
        assert torch.equal(values, fresh.answer_values(ids, torch.ones_like(ids), 4))


def test_the_merging_engine_samples_what_the_unmerged_one_samples(tiny_model_dir, caplog):
    from lorakit.rl.experience import left_pad

    policy = shared_base_policy(tiny_model_dir)
    before = weights(policy)
    prompt_ids, prompt_mask = left_pad(PROMPTS, 4, 0)
    results = {}
    for merge in (False, True):
        torch.manual_seed(3)
        with torch.no_grad(), caplog.at_level(logging.INFO, logger="lorakit.rl.rollout"):
            results[merge] = engine(policy, merge).sample(prompt_ids, prompt_mask)
    assert torch.equal(results[True].tokens, results[False].tokens)
    torch.testing.assert_close(results[True].logprobs, results[False].logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(results[True].entropy, results[False].entropy, atol=1e-5, rtol=0)
    assert all(torch.equal(before[k], value) for k, value in weights(policy).items())
    assert "decodes on its adapter merged into the base weights (6 layers" in caplog.text


def test_a_group_shares_one_prefill_and_samples_what_rows_prefilled_one_by_one_sample(tiny_model_dir):
    """GRPO's rows: each prompt repeated once per answer. The distinct prompts but their last token run through the
    decoder stack once and the KV cache is repeated to every row: the rows sample the same tokens with the same
    log-probs (to float rounding) as rows generate() prefills one by one, with prompts of two lengths (padding)."""
    from lorakit.rl.experience import left_pad
    from lorakit.rl.role_policy import backbone_of

    policy = shared_base_policy(tiny_model_dir)
    prompt_ids, prompt_mask = left_pad([PROMPTS[0]] * 4 + [PROMPTS[2][1:]] * 4, 4, 0)
    sampler = engine(policy, merge=False)
    widths = []
    hook = backbone_of(policy.generator()).register_forward_hook(
        lambda module, args, kwargs, output: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    with torch.no_grad():
        torch.manual_seed(3)
        shared = sampler.sample(prompt_ids, prompt_mask)
        hook.remove()
        sampler.shared_prompt_cache = lambda *args: None  # every row prefilled by generate()
        torch.manual_seed(3)
        own = sampler.sample(prompt_ids, prompt_mask)
    # The prefill: 2 distinct prompts of 3 tokens; then every step runs all 8 rows, one token each.
    assert widths[0] == (2, 3) and set(widths[1:]) == {(8, 1)} and len(widths) == own.tokens.shape[1] + 1
    assert torch.equal(shared.tokens, own.tokens)
    torch.testing.assert_close(shared.logprobs, own.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.entropy, own.entropy, atol=1e-5, rtol=0)
    # Rows of distinct prompts: nothing to share, generate() prefills them.
    assert sampler.__class__.shared_prompt_cache(sampler, policy.generator(), *left_pad(PROMPTS, 4, 0)) is None


def test_a_group_s_answers_share_one_pass_of_their_prompt_with_the_same_log_probs_and_gradients(tiny_model_dir):
    """The training pass of GRPO's rows (rl.role_policy.RolePolicy.prompt_shared_hidden): each distinct prompt runs once
    and its rows' answers run on from its keys and values. Log-probs and the adapter's gradients equal one pass over
    every row's whole sequence, with rows of two prompts (of two lengths) in mixed order and answers of two lengths."""
    from lorakit.rl.experience import left_pad
    from lorakit.rl.role_policy import backbone_of

    policy = shared_base_policy(tiny_model_dir)
    prompts, prompt_mask = left_pad([PROMPTS[0], PROMPTS[2][1:], PROMPTS[0], PROMPTS[2][1:], PROMPTS[0]], 4, 0)
    answers = torch.randint(3, 200, (5, 6), generator=torch.Generator().manual_seed(0))
    answer_mask = torch.ones_like(answers)
    answer_mask[1, 4:] = answer_mask[4, 2:] = 0  # answers that ended early: padding after them
    ids, mask = torch.cat([prompts, answers * answer_mask], 1), torch.cat([prompt_mask, answer_mask], 1)
    trained = [param for name, param in policy.named_parameters() if ".default." in name]  # the actor's adapter
    results, rows_per_pass = {}, []
    hook = backbone_of(policy.generator()).register_forward_hook(
        lambda module, args, kwargs, output: rows_per_pass.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    for share in (False, True):
        policy.share_prompts = share
        policy.zero_grad()
        logprobs = policy.answer_logprobs("actor", ids, mask, 4)
        (logprobs * answer_mask).sum().backward()
        results[share] = logprobs.detach(), [param.grad.clone() for param in trained]
    hook.remove()
    # One pass over 5 whole rows; then 2 distinct prompts, and the 5 rows' answers.
    assert rows_per_pass == [(5, 10), (2, 4), (5, 6)]
    torch.testing.assert_close(results[True][0], results[False][0], atol=1e-5, rtol=0)
    assert max(grad.abs().max().item() for grad in results[False][1]) > 1e-3
    for shared, whole in zip(results[True][1], results[False][1], strict=True):
        torch.testing.assert_close(shared, whole, atol=1e-5, rtol=1e-4)


def test_a_quantized_base_decodes_unmerged_and_says_so_once(tiny_model_dir, caplog):
    policy = shared_base_policy(tiny_model_dir)
    policy.causal_lm.is_loaded_in_4bit = True  # what merge_blocker reads of a bitsandbytes base
    before = weights(policy)
    from lorakit.rl.experience import left_pad

    prompt_ids, prompt_mask = left_pad(PROMPTS, 4, 0)
    sampler = engine(policy, merge=True)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="lorakit.rl.rollout"):
        for _ in range(2):
            sampler.sample(prompt_ids, prompt_mask)
    assert caplog.text.count("decodes with its adapter unmerged: the base is quantized") == 1
    assert all(torch.equal(before[k], value) for k, value in weights(policy).items())


def experience_maker(policy):
    """(args, an ExperienceMaker) for policy: merged decode, 6 prompts in micro-batches of 3, fp32."""
    from lorakit.rl.experience import ExperienceMaker

    args = types.SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, world_size=1, chunked_loss=True,
                                 generation_gather="auto", device=torch.device("cpu"), enable_hybrid_engine=True,
                                 rollout_engine="eager",
                                 per_device_generation_batch_size=4, per_device_training_batch_size=3, seed=5,
                                 process_index=0, ppo_epochs=1, missing_eos_penalty=None, clip_reward_value=5.0,
                                 gamma=1.0, lam=0.95)
    eos = policy.generator().config.eos_token_id
    return args, ExperienceMaker(policy, args, 0, eos, [], max_answer_len=10)


def test_the_first_update_sees_the_old_policy_it_was_given_and_the_sampler_gap_is_near_zero(tiny_model_dir):
    """Old log-probs from a no-grad pass of the training forward over the micro-batches the first update sees: that
    update's ratio is 1 within 1e-6 (fp32), while the sampler (the merged decode, KV cache) differs by rounding only."""
    from lorakit.rl.experience import epoch_chunks, micro_batches, training_metrics

    policy = shared_base_policy(tiny_model_dir)
    args, maker = experience_maker(policy)
    prompts = PROMPTS + [[9, 8, 7], [44, 45]]
    experience = maker.make(prompts, seed=1, kl_coef=0.1, row_chunks=epoch_chunks(len(prompts), 0, 0, args))
    metrics = training_metrics(experience, 0.1, torch.device("cpu"))
    assert metrics["sampler_gap/logprob_abs"] < 1e-5 and 0 <= metrics["sampler_gap/kl"] < 1e-10
    policy.train()
    for batch in micro_batches(experience, 0, args, None):
        outputs = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         prompt_length=batch["prompt_length"])
        mask = batch["response_mask"].bool()
        ratio = torch.exp(outputs["logprobs"] - batch["old_logprobs"])[mask]
        assert outputs["logprobs"].requires_grad and (ratio - 1).abs().max().item() < 1e-6


def test_a_rollout_that_trains_one_step_takes_the_old_policy_from_that_update_with_no_pass_before_it(
        tiny_model_dir):
    """old_from_update (one optimizer step per rollout): make() runs no training forward for the old policy; the
    KL penalty is shaped with the sampler's log-probs, which differ from the training forward's by rounding only in
    fp32, so rewards, advantages and returns match the experience made with the pass; the update's own log-probs
    are the ones that pass would have given (within 1e-6)."""
    from lorakit.rl.experience import epoch_chunks, micro_batches, training_metrics

    policy = shared_base_policy(tiny_model_dir)
    args, maker = experience_maker(policy)
    prompts = PROMPTS + [[9, 8, 7], [44, 45]]
    chunks = epoch_chunks(len(prompts), 0, 0, args)
    forward, calls = policy.forward, []
    policy.forward = lambda *a, **k: calls.append(k.get("values")) or forward(*a, **k)
    experiences = {}
    for old_from_update in (False, True):
        calls.clear()
        experiences[old_from_update] = maker.make(prompts, seed=1, kl_coef=0.1, row_chunks=chunks,
                                                  old_from_update=old_from_update)
        assert calls == ([] if old_from_update else [False, False])  # no pass, or one per micro-batch of 3
    passed, reused = experiences[False], experiences[True]
    assert torch.equal(passed.input_ids, reused.input_ids) and torch.equal(reused.old_logprobs,
                                                                          reused.sampler_logprobs)
    for name in ("kl", "rewards", "advantages", "returns"):
        torch.testing.assert_close(getattr(reused, name), getattr(passed, name), atol=1e-5, rtol=0)
    assert "sampler_gap/kl" not in training_metrics(reused, 0.1, torch.device("cpu"))  # the update measures it
    del policy.forward
    policy.train()
    for batch, passed_batch in zip(micro_batches(reused, 0, args, None), micro_batches(passed, 0, args, None),
                                   strict=True):
        assert batch["old_from_update"] and not passed_batch["old_from_update"]
        outputs = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         prompt_length=batch["prompt_length"])
        mask = batch["response_mask"].bool()
        assert (outputs["logprobs"] - passed_batch["old_logprobs"])[mask].abs().max().item() < 1e-6


def test_auto_picks_the_compiled_engine_on_cuda_only_and_a_bucket_is_a_power_of_two(tiny_model_dir):
    from lorakit.rl.rollout import prompt_bucket

    policy = shared_base_policy(tiny_model_dir)
    assert engine(policy, merge=False, name="auto").name == "eager"  # this machine: a CPU
    assert engine(policy, merge=False, name="compiled").name == "compiled"
    assert [prompt_bucket(width) for width in (1, 16, 17, 33, 64, 65, 300)] == [16, 16, 32, 64, 64, 128, 512]


@pytest.mark.slow
def test_the_compiled_engine_samples_what_the_eager_one_samples_and_compiles_once_per_shape(tiny_model_dir,
                                                                                             caplog):
    """Static KV cache and torch.compile (on the CPU when asked by name) on the merged adapter: the same tokens as
    the eager engine from the same seed, the same statistics within 1e-5 (fp32), every weight bit-identical after.
    Every cache is sized for the widest prompt bucket the run can meet (prompts of at most 20 tokens: bucket 32, +12
    answer tokens), so prompts of two buckets compile once per row count, and a second pass compiles nothing."""
    from lorakit.rl.experience import left_pad
    from lorakit.rl.rollout import compiled_graphs

    policy = shared_base_policy(tiny_model_dir)
    before = weights(policy)
    long_prompts = [[(7 * row + column) % 200 + 3 for column in range(17 + row)] for row in range(4)]
    batches = [left_pad(PROMPTS, 4, 0), left_pad(PROMPTS[:2], 4, 0), left_pad(long_prompts, 20, 0)]
    eager, compiled = engine(policy, merge=True), engine(policy, merge=True, name="compiled", max_prompt_len=20)
    graphs = compiled_graphs()
    for prompt_ids, prompt_mask in batches:
        results = {}
        for sampler in (eager, compiled):
            torch.manual_seed(3)
            with torch.no_grad(), caplog.at_level(logging.INFO, logger="lorakit.rl.rollout"):
                results[sampler.name] = sampler.sample(prompt_ids, prompt_mask)
        assert torch.equal(results["compiled"].tokens, results["eager"].tokens)
        torch.testing.assert_close(results["compiled"].logprobs, results["eager"].logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(results["compiled"].entropy, results["eager"].entropy, atol=1e-5, rtol=0)
    assert compiled.shapes == {(4, 32 + 12), (2, 32 + 12)} and compiled_graphs() > graphs
    graphs = compiled_graphs()
    for prompt_ids, prompt_mask in batches:
        with torch.no_grad():
            compiled.sample(prompt_ids, prompt_mask)
    assert compiled_graphs() == graphs and len(compiled.shapes) == 2  # the same shapes again: nothing recompiled
    assert "decoding step compiled for 4 rows x a KV cache of 44 (prompt bucket 16)" in caplog.text
    assert all(torch.equal(before[k], value) for k, value in weights(policy).items())
