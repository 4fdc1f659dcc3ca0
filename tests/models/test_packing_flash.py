"""Packing under flash attention: a packed batch of several rows carries its samples' bounds
(cu_seq_lens_q/k, max_length_q/k), so transformers' flash path attends within each sample, as
sdpa's position_ids mask does; an attention that can do neither is refused with --packing.

flash-attn does not run on a CPU. transformers' own flash path (modeling_flash_attention_utils:
which kernel it calls with what, from position_ids or the bounds) runs here on a CPU stand-in of
flash-attn's two kernels that computes what they compute (causal attention over each given
segment) with torch's sdpa."""

import json
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
import transformers.modeling_flash_attention_utils as flash_utils
from datasets import Dataset
from transformers import AutoTokenizer

from helpers.commands import SFT_SCRIPT, check_refused, refuse
from helpers.corpora import generated_corpus
from helpers.tiny_runs import tiny_sft_args
from lorakit.data.build_dataset import DataCollatorForSupervisedDataset, pack_samples

FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def cpu_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_func on [batch, length, heads, head_dim] (fewer key/value heads allowed)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def cpu_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                               dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_varlen_func on [tokens, heads, head_dim]: each segment of cu_seqlens attends to itself only."""
    bounds = cu_seqlens_q.tolist()
    assert bounds == cu_seqlens_k.tolist()
    return torch.cat([cpu_flash_attn_func(q[None, start:end], k[None, start:end], v[None, start:end],
                                          softmax_scale=softmax_scale, causal=causal)[0]
                      for start, end in pairwise(bounds)])


@pytest.fixture
def cpu_flash_attention(monkeypatch):
    """transformers' flash_attention_2 path with the CPU kernels in place of flash-attn's."""
    monkeypatch.setattr(flash_utils, "_loaded_implementation", "flash_attention_2")
    monkeypatch.setattr(flash_utils, "_flash_fn", cpu_flash_attn_func)
    monkeypatch.setattr(flash_utils, "_flash_varlen_fn", cpu_flash_attn_varlen_func)
    monkeypatch.setattr(flash_utils, "_flash_with_kvcache_fn", None)
    monkeypatch.setattr(flash_utils, "_pad_fn", flash_utils._pad_input)
    monkeypatch.setattr(flash_utils, "_unpad_fn", flash_utils._unpad_input)
    monkeypatch.setattr(flash_utils, "_process_flash_kwargs_fn",
                        flash_utils._lazy_define_process_function(cpu_flash_attn_varlen_func))
    monkeypatch.setattr(flash_utils, "_process_with_kvcache_kwargs_fn", dict)


def samples_dataset(tokenizer, count: int) -> Dataset:
    ids = [tokenizer(line)["input_ids"] for line in generated_corpus(count, seed=3)]
    return Dataset.from_dict({"input_ids": ids, "labels": ids, "length": [len(row) for row in ids]})


def test_collator_gives_flash_attention_the_sample_bounds_across_rows():
    lengths = [5, 7, 4, 8, 6, 3]
    samples = [[10 + i] * n for i, n in enumerate(lengths)]
    packed = pack_samples(Dataset.from_dict({"input_ids": samples, "labels": samples, "length": lengths}), 12)
    rows = [packed[i] for i in range(len(packed))]
    # Best fit, longest first: rows [8, 4], [7, 5], [6, 3], padded to 16 (a multiple of 8).
    assert [row["length"] for row in rows] == [12, 12, 9]
    flash = DataCollatorForSupervisedDataset(0, attn_implementation="flash_attention_2")(rows)
    sdpa = DataCollatorForSupervisedDataset(0, attn_implementation="sdpa")(rows)
    assert flash["input_ids"].shape == (3, 16)
    # Each sample, and each row's padding, is a segment of the batch flattened to one sequence.
    expected = [0, 8, 12, 16, 23, 28, 32, 38, 41, 48]
    assert flash["cu_seq_lens_q"].tolist() == flash["cu_seq_lens_k"].tolist() == expected
    assert flash["cu_seq_lens_q"].dtype == torch.int32
    assert flash["max_length_q"] == flash["max_length_k"] == 8
    # What transformers itself derives from the position_ids of one flattened row.
    (cu_q, _), (longest, _) = flash_utils.prepare_fa_kwargs_from_position_ids(flash["position_ids"])
    assert cu_q.tolist() == expected and int(longest) == 8
    # sdpa builds its mask from position_ids: the same batch, without the bounds.
    assert set(flash) - set(sdpa) == set(FLASH_KEYS)
    for name, value in sdpa.items():
        assert torch.equal(flash[name], value)
    # Unpacked batches keep their attention mask, which every attention takes.
    unpacked = DataCollatorForSupervisedDataset(0, attn_implementation="flash_attention_2")(
        [{"input_ids": s, "labels": s} for s in samples[:2]])
    assert set(unpacked) == {"input_ids", "labels", "attention_mask"}


def test_packed_rows_under_flash_attention_equal_each_sample_alone(tiny_model_dir, cpu_flash_attention):
    from lorakit.models.arguments import ModelArguments
    from lorakit.models.loader import load_model

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_model(ModelArguments(model_name_or_path=tiny_model_dir, torch_dtype="float32", lora_dropout=0.0,
                                      attn_implementation="sdpa"), None, tokenizer).eval()
    dataset = samples_dataset(tokenizer, 12)
    packed = pack_samples(dataset, 64)
    rows = [packed[i] for i in range(len(packed))]
    assert len(rows) >= 2 and all(row["position_ids"].count(0) >= 2 for row in rows)
    batch = DataCollatorForSupervisedDataset(tokenizer.eos_token_id,
                                             attn_implementation="flash_attention_2")(rows)
    with torch.no_grad():
        alone = {tuple(ids): model(input_ids=torch.tensor([ids])).logits[0] for ids in dataset["input_ids"]}
        model.get_base_model().config._attn_implementation = "flash_attention_2"
        with_bounds = model(**batch).logits
        without_bounds = model(**{k: v for k, v in batch.items() if k not in FLASH_KEYS}).logits

    def largest_difference(logits):
        difference = 0.0
        for row, features in enumerate(rows):
            starts = [i for i, p in enumerate(features["position_ids"]) if p == 0] + [features["length"]]
            for start, end in pairwise(starts):
                expected = alone[tuple(features["input_ids"][start:end])]
                difference = max(difference, (logits[row, start:end] - expected).abs().max().item())
        return difference

    assert largest_difference(with_bounds) <= 1e-4
    # What the bounds fix: without them, flash attention runs each row of two or more rows as one
    # causal sequence across its samples.
    assert largest_difference(without_bounds) > 1e-2


def test_packing_refuses_an_attention_that_cannot_keep_samples_apart(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"instruction": "hello", "output": "hi"}) + "\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = tiny_sft_args(tiny_model_dir, out, cache, data_path=data, packing=True, attn_implementation="paged|eager")
    check_refused(refuse(SFT_SCRIPT, args, in_process=True), "--packing with --attn_implementation paged|eager")
    assert not out.exists() and not cache.exists()
