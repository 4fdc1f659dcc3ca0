"""Kernels through TrainingArguments' own flags: --torch_compile compiles the decoder layers in place (the same
per-sample losses and training as the plain model, on packed rows); --use_liger_kernel and --torch_compile refused in
one line by the stages where they are not proven, and Liger where liger_kernel does not import."""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from helpers.commands import SFT_SCRIPT, TRAINING, check_refused, refuse
from helpers.tiny_runs import tiny_sft_args
from lorakit.data.build_dataset import DataCollatorForSupervisedDataset, pack_samples
from lorakit.trainers.causal_lm import CausalLMTrainer


def packed_rows(count: int, seed: int) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    samples = [torch.randint(5, 200, (int(n),), generator=generator).tolist()
               for n in torch.randint(4, 30, (count,), generator=generator)]
    return pack_samples(Dataset.from_dict({"input_ids": samples, "labels": samples,
                                           "length": [len(s) for s in samples]}), 64)


def trainer_of(model_dir: str, output_dir, rows: Dataset, torch_compile: bool) -> CausalLMTrainer:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorakit.trainers.sft_config import SFTArguments

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                      init_lora_weights=False))
    args = SFTArguments(output_dir=str(output_dir), use_cpu=True, per_device_train_batch_size=2, max_steps=3,
                        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", seed=3,
                        torch_compile=torch_compile)
    return CausalLMTrainer(model=model, args=args, train_dataset=rows,
                           data_collator=DataCollatorForSupervisedDataset(0))


def sample_losses(model, rows: Dataset) -> list[float]:
    """Each packed sample's mean next-token loss, the rows run as the collator batches them, in training mode with
    gradients on (the graph training compiles, so that the test pays for one compile, not two)."""
    batch = DataCollatorForSupervisedDataset(0)([rows[i] for i in range(len(rows))])
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits.detach()
    losses = []
    for row, positions in enumerate(batch["position_ids"].tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        for start, end in zip(starts, starts[1:], strict=False):
            labels = batch["labels"][row, start + 1:end]
            if (labels != -100).any():
                losses.append(float(F.cross_entropy(logits[row, start:end - 1], labels, ignore_index=-100)))
    return losses


@pytest.mark.slow
def test_compiled_decoder_layers_give_the_plain_losses_and_train_alike(tiny_model_dir, tmp_path):
    rows = packed_rows(6, seed=5)
    assert len(rows) == 2  # one batch, the same shape every step
    plain = trainer_of(tiny_model_dir, tmp_path / "plain", rows, torch_compile=False)
    compiled = trainer_of(tiny_model_dir, tmp_path / "compiled", rows, torch_compile=True)
    layers = compiled.model.get_base_model().model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert plain.model.get_base_model().model.layers[0]._compiled_call_impl is None
    assert compiled.model.__class__ is plain.model.__class__  # not wrapped: the chunked loss reads its head
    expected, got = sample_losses(plain.model.train(), rows), sample_losses(compiled.model.train(), rows)
    assert len(expected) == 6 and got == pytest.approx(expected, abs=1e-5)
    logged = {}
    for name, trainer in (("plain", plain), ("compiled", compiled)):
        trainer.train()
        logged[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged["plain"]) == 3 and logged["compiled"] == pytest.approx(logged["plain"], abs=1e-4)
    assert logged["plain"][-1] < logged["plain"][0]


def test_sft_refuses_liger_where_it_does_not_import(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"instruction": "hello", "output": "hi"}) + "\n")
    out = tmp_path / "out"
    args = tiny_sft_args(tiny_model_dir, out, tmp_path / "cache", data_path=data, use_liger_kernel=True)
    check_refused(refuse(SFT_SCRIPT, args, in_process=True), "--use_liger_kernel: liger_kernel is not installed")
    assert not out.exists()


# Each stage's script and the flags naming its models.
UNPROVEN_STAGES = {"run_dpo.py": ["model_name_or_path"], "run_reward.py": ["model_name_or_path"],
                   "run_ppo.py": ["actor_model_name_or_path", "reward_model_name_or_path"],
                   "run_grpo.py": ["model_name_or_path"]}


@pytest.mark.parametrize("script", list(UNPROVEN_STAGES))
@pytest.mark.parametrize("flag", ["use_liger_kernel", "torch_compile"])
def test_stages_where_kernels_are_unproven_refuse_them(script, flag, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    args = [word for name in UNPROVEN_STAGES[script] for word in (f"--{name}", tiny_model_dir)]
    args += ["--output_dir", str(out), f"--{flag}", "true"]
    script = os.path.join(TRAINING, script)
    check_refused(refuse(script, args, in_process=True),
                  f"--{flag}: not proven for this stage, only for pretraining and SFT")
    assert not out.exists()


def test_compile_under_zero3_is_refused(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"instruction": "hello", "output": "hi"}) + "\n")
    out = tmp_path / "out"
    args = tiny_sft_args(tiny_model_dir, out, tmp_path / "cache", data_path=data, torch_compile=True,
                         deepspeed=os.path.join(TRAINING, "..", "..", "ds_configs", "ds_zero3_no_offload.json"))
    check_refused(refuse(SFT_SCRIPT, args, in_process=True), "--torch_compile with a ZeRO-3 DeepSpeed config")
    assert not out.exists()
