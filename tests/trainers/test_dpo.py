"""DPO stage: answer log-probs from pair rows, learning a preference per loss, precomputed reference,
DeepSpeed, resume, merge, bad input."""

import json
import math
import os

import pytest
import torch
from transformers import AutoTokenizer

from helpers.commands import REPO, TRAINING, assert_ok, check_refused, refuse, run_in_process, run_script
from helpers.corpora import GOOD_PAIR, marker_pairs
from helpers.kill_points import resume_proof
from helpers.merge_tools import TOLERANCE
from helpers.run_outputs import adapter_weights, log_history
from helpers.tiny_runs import small_chunks_wrapper, tiny_sft_args

DPO_SCRIPT = os.path.join(TRAINING, "run_dpo.py")
MERGE_SCRIPT = os.path.join(REPO, "scripts", "merge", "merge_llama_with_lora.py")
SEQUENCE_WRAPPER = os.path.join(REPO, "tests", "helpers", "run_in_sequence.py")


def tiny_dpo_args(model_dir, output_dir, cache_dir, **overrides):
    options = {"template": "human_assistant", "lora_dropout": 0.0, **overrides}
    return tiny_sft_args(model_dir, output_dir, cache_dir, **options)


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_data")
    (root / "train.jsonl").write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in marker_pairs(240, 0)))
    (root / "valid.jsonl").write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in marker_pairs(40, 1)))
    return str(root / "train.jsonl"), str(root / "valid.jsonl")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One data cache for every run of the module: the pairs are tokenized once (the key covers the files,
    tokenizer, template and lengths, so the runs share it as users' runs do)."""
    return tmp_path_factory.mktemp("dpo_cache")


def full_logits_logps(model, sequences, starts):
    """Reference computation: each sequence alone, the full LM head, log_softmax, its answer tokens."""
    sums = []
    for ids, start in zip(sequences, starts, strict=True):
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        logps = logits[:-1].log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        sums.append(logps[start - 1:].sum())
    return torch.stack(sums)


def answer_logps_model(model_dir, tokenizer, tmp_path, chunked: bool):
    """The DPO stage's policy (task answer_logps, a LoRA whose B is made non-zero, as after training) and three
    pairs built by the reward stage's pipeline (shared prompt, answers sharing their first token, an answer
    extending the other)."""
    from lorakit.data.build_dataset import build_preference_dataset
    from lorakit.models.arguments import ModelArguments
    from lorakit.models.loader import load_model
    from lorakit.records.chat_templates import named_template
    from lorakit.trainers.arguments import ToolkitTrainingArguments

    data = tmp_path / "pairs.jsonl"
    records = [{"prompt": "北京 上海 天气 很好 人民 日报", "chosen": "我们 今天 学习", "rejected": "我们 经济"},
               {"prompt": "the quick fox", "chosen": "科学", "rejected": "科学 技术 发展"},
               {"prompt": "语言", "chosen": "the lazy dog jumps", "rejected": "模型 数据"}]
    data.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records))
    pairs = build_preference_dataset([str(data)], tokenizer, named_template("human_assistant", tokenizer), 256,
                                     str(tmp_path / "cache"))
    model = load_model(ModelArguments(model_name_or_path=model_dir, torch_dtype="float32", lora_dropout=0.0),
                       ToolkitTrainingArguments(output_dir="unused", use_cpu=True, report_to="none"), tokenizer,
                       task="answer_logps")
    model.get_base_model().chunked_loss = chunked
    with torch.no_grad():  # a trained-looking adapter: LoRA B starts at zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return model, [pairs[i] for i in range(len(pairs))]


def own_forward_logps(model, features):
    """Each answer's log-prob by the model's own forward on its sequence alone (full logits, log_softmax)."""
    with torch.no_grad():
        return full_logits_logps(model, [f["chosen_input_ids"] for f in features]
                                 + [f["rejected_input_ids"] for f in features],
                                 [f["chosen_answer_start"] for f in features]
                                 + [f["rejected_answer_start"] for f in features])


@pytest.mark.parametrize("chunked", [True, False])
def test_one_row_pairs_give_the_log_probs_loss_and_gradients_of_separate_rows(chunked, tiny_model_dir,
                                                                              tiny_tokenizer_dir, tmp_path,
                                                                              monkeypatch):
    """One row per pair and two rows per pair give each answer the log-prob of the sequence run alone through
    the full LM head, and the same DPO loss and LoRA gradients; with the chunked loss in chunks of 3
    positions (so that answers span chunks)."""
    from lorakit.models import chunked_loss
    from lorakit.models.dpo_losses import preference_loss
    from lorakit.trainers.dpo_trainer import DataCollatorForAnswerLogps, answer_logps

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model, features = answer_logps_model(tiny_model_dir, tokenizer, tmp_path, chunked)
    monkeypatch.setattr(chunked_loss, "LOGITS_PER_CHUNK", 3 * model.get_output_embeddings().weight.shape[0])
    expected = own_forward_logps(model, features)
    results = {}
    for share_prefix in (False, True):
        model.zero_grad()
        batch = DataCollatorForAnswerLogps(tokenizer.unk_token_id, 1, share_prefix=share_prefix)(features)
        sums, counts = answer_logps(model.train(), batch)
        chosen, rejected = sums.chunk(2)
        losses, _, _ = preference_loss("sigmoid", chosen, rejected, chosen.detach() - 0.3, rejected.detach() + 0.2,
                                       *counts.chunk(2), beta=0.5)
        losses.mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[share_prefix] = (sums.detach(), losses.mean().item(), grads, batch["input_ids"].numel())
    assert model.get_base_model().answer_head_exact
    (sums, loss, grads, tokens), (shared_sums, shared_loss, shared_grads, shared_tokens) = results.values()
    torch.testing.assert_close(sums, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared_sums, expected, atol=1e-5, rtol=1e-5)
    assert abs(shared_loss - loss) <= 1e-5
    assert grads.keys() == shared_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4)
    assert shared_tokens < tokens


@pytest.mark.slow
def test_answer_log_probs_of_a_soft_capping_gemma2_are_its_own(family_model_dir, tmp_path):
    """Gemma-2 soft-caps its logits after the head (30 tanh(logits / 30)): the answers' log-probs come from its
    own forward, in both layouts, not from the head alone, which here differs from it by more than 0.01."""
    from lorakit.trainers.dpo_trainer import DataCollatorForAnswerLogps, answer_logps

    model_dir = family_model_dir("gemma2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model, features = answer_logps_model(model_dir, tokenizer, tmp_path, chunked=True)
    with torch.no_grad():  # logits of a trained model's size, where the cap bends them
        model.get_output_embeddings().weight.mul_(50)
    assert model.config.final_logit_softcapping == 30.0
    expected = own_forward_logps(model, features)
    for share_prefix in (False, True):
        batch = DataCollatorForAnswerLogps(tokenizer.pad_token_id, 1, share_prefix=share_prefix)(features)
        with torch.no_grad():
            sums, _ = answer_logps(model.eval(), batch)
        torch.testing.assert_close(sums, expected, atol=1e-4, rtol=1e-5)
    assert model.get_base_model().answer_head_exact is False
    model.get_base_model().answer_head_exact = True  # what the head alone would give
    with torch.no_grad():
        head_only, _ = answer_logps(model, batch)
    assert (head_only - expected).abs().max() > 1e-2


def dpo_run(tiny_model_dir, pair_files, out, cache, **overrides):
    train, valid = pair_files
    options = {"data_path": train, "validation_file": valid, "max_steps": 40, "learning_rate": 1e-2,
               "per_device_train_batch_size": 8, "save_steps": 40, "logging_steps": 5, **overrides}
    return run_in_process(DPO_SCRIPT, tiny_dpo_args(tiny_model_dir, out, cache, **options))


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.5), ("ipo", 1.0), ("simpo", 2.0)])
def test_learns_a_marker_preference(loss_type, beta, tiny_model_dir, pair_files, data_cache, tmp_path):
    out = tmp_path / "out"
    assert_ok(dpo_run(tiny_model_dir, pair_files, out, data_cache, loss_type=loss_type, beta=beta,
                      save_strategy="no"))
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_rewards/accuracies"] >= 0.9, results
    assert results["eval_rewards/margins"] > 0
    first = next(e for e in log_history(out) if "loss" in e)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        assert name in first and f"eval_{name}" in results
    assert (out / "dpo_lora_model" / "adapter_model.safetensors").exists()
    assert AutoTokenizer.from_pretrained(out / "dpo_lora_model").chat_template


# The short live-reference run that the precomputed reference is compared with; the SIGKILL resume runs it too.
SHORT_RUN = {"max_steps": 6, "logging_steps": 1, "save_steps": 3, "max_eval_samples": 8}


@pytest.fixture(scope="module")
def short_run(tiny_model_dir, pair_files, data_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_short") / "out"
    assert_ok(dpo_run(tiny_model_dir, pair_files, out, data_cache, **SHORT_RUN))
    return out


def test_first_step_is_log_2_and_precomputed_reference_trains_the_same(short_run, tiny_model_dir, pair_files,
                                                                       data_cache, tmp_path):
    out = tmp_path / "precomputed"
    assert_ok(dpo_run(tiny_model_dir, pair_files, out, data_cache, **SHORT_RUN, precompute_ref_log_probs=True))
    (live_log, live), (pre_log, pre) = ((log_history(run), adapter_weights(run / "dpo_lora_model"))
                                        for run in (short_run, out))
    assert live_log[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert live_log[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert max((live[k] - pre[k]).abs().max().item() for k in live) <= 1e-5
    live_losses, pre_losses = ([e["loss"] for e in log if "loss" in e] for log in (live_log, pre_log))
    assert live_losses == pytest.approx(pre_losses, abs=1e-5) and live_losses[-1] < live_losses[0]


@pytest.mark.slow
def test_dpo_deepspeed_zero2_and_zero3_two_processes(tiny_model_dir, pair_files, data_cache, tmp_path):
    """A ZeRO-2 run and then a ZeRO-3 run, each on 2 ranks, one after the other in the same torchrun job
    (helpers/run_in_sequence.py: one interpreter start and rendezvous for both). The answers' log-probs run 3
    positions a chunk, so the ranks' answers take different numbers of chunks: under ZeRO-3 each head call
    gathers its weight from both ranks, and unequal counts used to hang the job."""
    train, valid = pair_files
    configs = ("ds_zero2_no_offload", "ds_zero3_no_offload")
    runs = []
    for config in configs:
        runs += [":::"] * bool(runs) + tiny_dpo_args(
            tiny_model_dir, tmp_path / config, data_cache, data_path=train, validation_file=valid, max_steps=3,
            save_steps=3, max_eval_samples=8, deepspeed=os.path.join(REPO, "ds_configs", f"{config}.json"))
    result = run_script(runs, nproc=2, script=DPO_SCRIPT, timeout=300,
                        wrapper=small_chunks_wrapper(tiny_model_dir, 3) + [SEQUENCE_WRAPPER])
    assert_ok(result)
    assert (result.stdout + result.stderr).count("process 0 of 2") == len(configs)  # each run on both ranks
    for config in configs:
        out = tmp_path / config
        losses = [e["loss"] for e in log_history(out) if "loss" in e]
        assert len(losses) == 3 and losses[0] == pytest.approx(math.log(2), abs=1e-5), config
        weights = adapter_weights(out / "dpo_lora_model")
        assert all(w.numel() > 0 for w in weights.values())
        assert "eval_rewards/accuracies" in json.loads((out / "eval_results.json").read_text())


@pytest.fixture(scope="module")
def dpo_resume(tiny_model_dir, pair_files, data_cache, tmp_path_factory):
    """The short run uninterrupted, and killed at seeded random steps, while writing a checkpoint and as it ends,
    rerun after each kill until it finished, each process forked (helpers/kill_points.py)."""
    train, valid = pair_files
    root = tmp_path_factory.mktemp("dpo_resume")

    def args_for(output_dir):
        return tiny_dpo_args(tiny_model_dir, output_dir, data_cache, data_path=train, validation_file=valid,
                             learning_rate=1e-2, per_device_train_batch_size=8, **{**SHORT_RUN, "save_steps": 2})

    return resume_proof(1, DPO_SCRIPT, args_for, root, seed="dpo", total=SHORT_RUN["max_steps"], save_steps=2)


@pytest.mark.slow
def test_dpo_resume_after_kills_at_random_steps_runs_only_the_remaining_steps_equals_uninterrupted_and_merges(
        dpo_resume, tiny_model_dir, tmp_path):
    dpo_resume.check_processes_after_random_kills()
    assert "resuming from" in dpo_resume.resumed_output()
    dpo_resume.check_bit_identical("dpo_lora_model")
    # The merge tool folds the resumed run's dpo_lora_model into the base.
    merged = tmp_path / "merged"
    assert_ok(run_in_process(MERGE_SCRIPT, ["--base_model", tiny_model_dir, "--lora_model",
                                            str(dpo_resume.root / "crashed" / "dpo_lora_model"), "--output_dir",
                                            str(merged), "--verify"]))
    assert (merged / "config.json").exists()


@pytest.mark.slow
def test_dpo_resume_after_a_kill_while_writing_a_checkpoint_starts_from_the_last_complete_one(dpo_resume):
    dpo_resume.check_process_after_mid_save_kill()


@pytest.mark.slow
def test_dpo_rerun_of_a_run_killed_after_its_last_step_trains_no_step_and_equals_uninterrupted(dpo_resume):
    dpo_resume.check_process_after_end_kill()
    dpo_resume.check_bit_identical("dpo_lora_model", run_name="ended")


@pytest.mark.parametrize("case,bad,flags,expected", [
    ("missing_chosen", {"prompt": "p", "rejected": "r"}, {}, "d.jsonl:2: field 'chosen' is missing"),
    ("long_prompt", {"prompt": "我们 " * 300, "chosen": "c", "rejected": "r"}, {},
     "d.jsonl:2: the prompt alone fills --max_seq_length 256"),
    ("bad_beta", GOOD_PAIR, {"beta": 0}, "--beta must be positive"),
    ("bad_smoothing", GOOD_PAIR, {"loss_type": "robust", "label_smoothing": 0.5}, "--label_smoothing must be in"),
    ("full_without_reference", GOOD_PAIR, {"full_finetuning": True}, "--precompute_ref_log_probs"),
])
def test_dpo_bad_input_is_refused_cleanly(case, bad, flags, expected, tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD_PAIR, ensure_ascii=False) + "\n" + json.dumps(bad, ensure_ascii=False) + "\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = tiny_dpo_args(tiny_model_dir, out, cache, data_path=data, **flags)
    check_refused(refuse(DPO_SCRIPT, args, in_process=case != "missing_chosen"), expected)
    assert not out.exists()


@pytest.fixture(scope="module")
def sft_then_dpo(tiny_model_dir, pair_files, data_cache, tmp_path_factory):
    """A random (non-zero) SFT adapter, and a 2-step DPO run on base + that adapter (--peft_path)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sft_then_dpo")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    sft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    sft.save_pretrained(root / "sft_lora_model")
    out = root / "out"
    result = dpo_run(tiny_model_dir, pair_files, out, data_cache, peft_path=root / "sft_lora_model", max_steps=2,
                     logging_steps=1, save_strategy="no", max_eval_samples=8)
    return {"sft": root / "sft_lora_model", "dpo": out / "dpo_lora_model", "out": out, "result": result}


def test_policy_from_base_plus_sft_adapter_has_that_model_as_reference(sft_then_dpo):
    """--peft_path SFT_ADAPTER is folded into the base: the reference is base + adapter, so the first
    loss is log 2 (a base-only reference would differ from the policy at step 0)."""
    result = sft_then_dpo["result"]
    assert_ok(result)
    assert "folding the adapter" in result.stdout
    first = next(e for e in log_history(sft_then_dpo["out"]) if "loss" in e)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["logps/chosen"] < 0


def test_qlora_dpo_on_a_4bit_base_plus_sft_adapter_starts_at_log_2_and_trains(sft_then_dpo, tiny_model_dir,
                                                                              pair_files, data_cache, tmp_path):
    """--load_in_kbits 4 with --peft_path: the SFT adapter is folded into the 4-bit base (policy and reference
    alike, so the first loss is log 2; the first batch's log-probs differ from the float32 run's on the same
    batch, so the base is quantized), and the new LoRA on the quantized layers trains."""
    out = tmp_path / "out"
    result = dpo_run(tiny_model_dir, pair_files, out, data_cache, peft_path=sft_then_dpo["sft"], load_in_kbits=4,
                     max_steps=3, logging_steps=1, save_strategy="no", max_eval_samples=8)
    assert_ok(result)
    assert "folding the adapter" in result.stdout
    losses = [entry for entry in log_history(out) if "loss" in entry]
    assert losses[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and len(losses) == 3
    float32_first = next(e for e in log_history(sft_then_dpo["out"]) if "loss" in e)
    assert abs(losses[0]["logps/chosen"] - float32_first["logps/chosen"]) > 1e-3
    assert losses[-1]["rewards/margins"] != 0 and all(math.isfinite(e["loss"]) for e in losses)
    weights = adapter_weights(out / "dpo_lora_model")
    assert any(name.endswith("lora_B.weight") and weights[name].abs().sum() > 0 for name in weights)


def test_chat_and_server_load_the_merged_dpo_model_and_the_dpo_adapter_on_the_merged_sft_model(
        sft_then_dpo, tiny_model_dir, tmp_path):
    """What chat.py and the server load (inference_tokenizer, chat_template_of, load_for_inference, as their
    main() calls them): base + SFT adapter + DPO adapter merged by the merge tool, and the DPO adapter on the
    merged SFT model. Both give the logits of peft applying the SFT adapter and then the DPO adapter, render
    the template DPO trained with, and answer alike."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lorakit.serve.inference import (
        ChatGenerator,
        SamplingSettings,
        chat_template_of,
        context_limit,
        inference_tokenizer,
        load_for_inference,
    )

    assert_ok(sft_then_dpo["result"])
    sft, dpo, merged, sft_merged = sft_then_dpo["sft"], sft_then_dpo["dpo"], tmp_path / "merged", tmp_path / "sft"
    assert_ok(run_in_process(MERGE_SCRIPT, ["--base_model", tiny_model_dir, "--lora_model", f"{sft},{dpo}",
                                            "--output_dir", str(merged), "--verify"]))
    assert_ok(run_in_process(MERGE_SCRIPT, ["--base_model", tiny_model_dir, "--lora_model", str(sft),
                                            "--output_dir", str(sft_merged)]))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(PeftModel.from_pretrained(base, sft).merge_and_unload(), dpo).eval()
    messages = [{"role": "user", "content": "北京 上海 天气 很好"}]
    settings = SamplingSettings(max_new_tokens=4, temperature=0, repetition_penalty=1.0)
    answers = []
    for base_model, lora_model in ((str(merged), None), (str(sft_merged), str(dpo))):
        tokenizer = inference_tokenizer(base_model, lora_model)
        model, tokenizer = load_for_inference(base_model, lora_model, dtype="float32", tokenizer=tokenizer)
        generator = ChatGenerator(model, tokenizer, chat_template_of(tokenizer, None), context_limit(model, None))
        assert "Human: 北京 上海 天气 很好 Assistant:" in generator.render(messages)
        prompt = generator.encode_chat(messages)
        answers.append(generator.generate([prompt], settings)[0])
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference(ids).logits
            with reference.disable_adapter():
                sft_only = reference(ids).logits
            assert (model(ids).logits - expected).abs().max().item() < TOLERANCE
        assert (expected - sft_only).abs().max().item() > 100 * TOLERANCE  # the DPO adapter changes the model
    assert answers[0] == answers[1] and answers[0].completion_tokens > 0
