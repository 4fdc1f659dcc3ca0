"""Packing under every attention that keeps packed samples apart, each compared with the samples run alone:
- flash attention: a packed batch of several rows carries its samples' bounds (cu_seq_lens_q/k, max_length_q/k,
  from data.build_dataset.sample_bounds), so transformers' flash path attends within each sample, as sdpa's
  position_ids mask does;
- torch_varlen (models.varlen_attention): torch's varlen_attn on the same bounds, and sdpa with its mask without them;
- flex_attention: the document mask transformers builds from restarting position ids;
- and the control that can fail: the same rows and positions with a causal mask over each whole row.
An attention that can do none of this is refused with --packing, and torch_varlen where it cannot run.

flash-attn and torch's varlen_attn do not run on a CPU. transformers' own flash path (modeling_flash_attention_utils:
which kernel it calls with what, from position_ids or the bounds) and our torch_varlen path run here on CPU
stand-ins of the kernels that compute what they compute (causal attention over each given segment) with torch's
sdpa: one stand-in of varlen_attn for each of its signatures (torch 2.13's; torch 2.10's, with is_causal and
neither scale nor enable_gqa).

flex_attention runs on a CPU as transformers runs it everywhere: compiled (torch.compile of flex_attention and of
its block mask; inductor's C++ code, which needs a C++ compiler): on 2 cores about 17 s with an empty inductor
cache, 3 s once its on-disk cache holds the kernels."""

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
import transformers.modeling_flash_attention_utils as flash_utils
from datasets import Dataset
from transformers import AutoTokenizer

from helpers.commands import SFT_SCRIPT, check_refused, refuse
from helpers.corpora import generated_corpus
from helpers.tiny_runs import tiny_sft_args
from lorakit.core.cli import InputError
from lorakit.data.build_dataset import (
    DataCollatorForSupervisedDataset,
    flash_varlen_kwargs,
    pack_samples,
    sample_bounds,
    whole_row_causal_mask,
)
from lorakit.models import varlen_attention
from lorakit.models.arguments import ModelArguments
from lorakit.models.loader import load_model

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


class StandIn(NamedTuple):
    """A CPU stand-in of torch's varlen_attn with one torch release's signature, the keyword arguments of each of
    its calls (and the key heads it was given), and what our code should pass it for a causal layer of 4 query
    heads and 2 key/value heads with this softmax scale."""

    kernel: Callable
    calls: list[dict[str, Any]]
    expected_call: Callable[[float], dict[str, Any]]


def varlen_attn_2_13() -> StandIn:
    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        calls.append({"window_size": window_size, "enable_gqa": enable_gqa, "scale": scale, "key_heads": key.shape[1]})
        # torch's own checks: the heads, and causal only for the tuple (-1, 0).
        assert enable_gqa or query.shape[1] == key.shape[1]
        return cpu_flash_attn_varlen_func(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale,
                                          causal=window_size == (-1, 0))

    return StandIn(varlen_attn, calls,
                   lambda scale: {"window_size": (-1, 0), "enable_gqa": True, "scale": scale, "key_heads": 2})


def varlen_attn_2_10() -> StandIn:
    calls = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append({"is_causal": is_causal, "key_heads": key.shape[1]})
        assert query.shape[1] == key.shape[1]  # no grouped-query attention in this signature
        return cpu_flash_attn_varlen_func(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)

    # No scale taken: ours is folded into the query; the key/value heads repeated.
    return StandIn(varlen_attn, calls, lambda scale: {"is_causal": True, "key_heads": 4})


@pytest.fixture(params=[varlen_attn_2_13, varlen_attn_2_10], ids=["torch2.13", "torch2.10"])
def varlen_kernel(request, monkeypatch) -> StandIn:
    """torch_varlen on a CPU stand-in of varlen_attn (registered: our seam, models.varlen_attention.KERNEL)."""
    stand_in = request.param()
    monkeypatch.setattr(varlen_attention, "KERNEL", stand_in.kernel)
    varlen_attention.use_torch_varlen(on_gpu=False)
    return stand_in


def samples_dataset(tokenizer, count: int) -> Dataset:
    ids = [tokenizer(line)["input_ids"] for line in generated_corpus(count, seed=3)]
    return Dataset.from_dict({"input_ids": ids, "labels": ids, "length": [len(row) for row in ids]})


class PackedCase(NamedTuple):
    """The tiny model (LoRA, float32, eval, sdpa), packed rows of samples, and each sample's logits run alone."""

    tokenizer: Any
    model: Any
    rows: list[dict[str, list[int]]]
    alone: dict[tuple[int, ...], torch.Tensor]


def load_tiny(model_dir: str, attn_implementation: str, tokenizer) -> Any:
    return load_model(ModelArguments(model_name_or_path=model_dir, torch_dtype="float32", lora_dropout=0.0,
                                     attn_implementation=attn_implementation), None, tokenizer).eval()


@pytest.fixture(scope="module")
def packed_case(tiny_model_dir) -> PackedCase:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = load_tiny(tiny_model_dir, "sdpa", tokenizer)
    dataset = samples_dataset(tokenizer, 12)
    packed = pack_samples(dataset, 64)
    rows = [packed[i] for i in range(len(packed))]
    assert len(rows) >= 2 and all(row["position_ids"].count(0) >= 2 for row in rows)
    with torch.no_grad():
        alone = {tuple(ids): model(input_ids=torch.tensor([ids])).logits[0] for ids in dataset["input_ids"]}
    return PackedCase(tokenizer, model, rows, alone)


@contextmanager
def attention(model, attn_implementation: str) -> Iterator[None]:
    """The model runs this attention implementation inside the block (the fixture's model is shared)."""
    config = model.get_base_model().config
    saved, config._attn_implementation = config._attn_implementation, attn_implementation
    try:
        yield
    finally:
        config._attn_implementation = saved


class Sample(NamedTuple):
    row: int
    start: int
    end: int
    input_ids: tuple[int, ...]


def samples_in(rows: list[dict[str, list[int]]]) -> list[Sample]:
    """The samples of packed rows, where their positions restart, up to each row's length (its padding follows)."""
    samples = []
    for row, features in enumerate(rows):
        starts = [i for i, p in enumerate(features["position_ids"]) if p == 0] + [features["length"]]
        samples += [Sample(row, start, end, tuple(features["input_ids"][start:end])) for start, end in pairwise(starts)]
    return samples


def logit_differences(logits: torch.Tensor, case: PackedCase) -> list[float]:
    """Per sample of the packed rows, the largest difference of its logits from the sample's run alone."""
    return [(logits[s.row, s.start:s.end] - case.alone[s.input_ids]).abs().max().item() for s in samples_in(case.rows)]


def mean_loss(logits: torch.Tensor, input_ids: tuple[int, ...]) -> float:
    """A sample's mean loss, as the model computes it: each token's logits predict the next token."""
    return F.cross_entropy(logits[:-1], torch.tensor(input_ids[1:])).item()


def loss_differences(logits: torch.Tensor, case: PackedCase) -> list[float]:
    """Per sample of the packed rows, how far its mean loss is from the sample's run alone."""
    return [abs(mean_loss(logits[s.row, s.start:s.end], s.input_ids) - mean_loss(case.alone[s.input_ids], s.input_ids))
            for s in samples_in(case.rows)]


# ----------------------------------------------------------------------------- sample bounds, worked by hand

@pytest.mark.parametrize(("position_ids", "cu_seqlens", "max_length"), [
    # samples of 3, 2 and 4 tokens in one row
    ([[0, 1, 2, 0, 1, 0, 1, 2, 3]], [0, 3, 5, 9], 4),
    # the same row unbatched
    ([0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 3, 5, 9], 4),
    # two rows of width 8: a sample of 5 then 3 of padding; samples of 2 and 4 then 2 of padding
    ([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 1, 2, 3, 0, 1]], [0, 5, 8, 10, 14, 16], 5),
    # a row with no restart: one sample fills it
    ([[0, 1, 2, 3, 4, 5]], [0, 6], 6),
    # a row whose positions do not start at 0 still starts a segment: none crosses from one row into the next
    ([[0, 1, 2, 3], [4, 5, 6, 7]], [0, 4, 8], 4),
    # single-token samples: first, and last
    ([[0, 0, 1, 2, 0]], [0, 1, 4, 5], 3),
])
def test_sample_bounds_of_packed_rows(position_ids, cu_seqlens, max_length):
    bounds = sample_bounds(torch.tensor(position_ids))
    assert bounds.cu_seqlens.tolist() == cu_seqlens and bounds.cu_seqlens.dtype == torch.int32
    assert bounds.max_length == max_length and isinstance(bounds.max_length, int)


def test_whole_row_causal_mask_is_causal_across_each_row():
    allowed = [[True, False, False], [True, True, False], [True, True, True]]
    assert whole_row_causal_mask(2, 3).tolist() == [[allowed]] * 2
    low = torch.finfo(torch.float32).min
    additive = whole_row_causal_mask(1, 3, torch.float32)
    assert additive.dtype == torch.float32 and additive.tolist() == [[[[0.0, low, low], [0.0, 0.0, low],
                                                                       [0.0, 0.0, 0.0]]]]


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
    # torch_varlen takes the same bounds.
    varlen = DataCollatorForSupervisedDataset(0, attn_implementation="torch_varlen")(rows)
    assert set(varlen) == set(flash) and all(torch.equal(torch.as_tensor(flash[k]), torch.as_tensor(v))
                                             for k, v in varlen.items())
    # Unpacked batches keep their attention mask, which every attention takes.
    unpacked = DataCollatorForSupervisedDataset(0, attn_implementation="flash_attention_2")(
        [{"input_ids": s, "labels": s} for s in samples[:2]])
    assert set(unpacked) == {"input_ids", "labels", "attention_mask"}


def test_packed_rows_under_flash_attention_equal_each_sample_alone(packed_case, cpu_flash_attention):
    batch = DataCollatorForSupervisedDataset(packed_case.tokenizer.eos_token_id,
                                             attn_implementation="flash_attention_2")(packed_case.rows)
    with torch.no_grad(), attention(packed_case.model, "flash_attention_2"):
        with_bounds = packed_case.model(**batch).logits
        without_bounds = packed_case.model(**{k: v for k, v in batch.items() if k not in FLASH_KEYS}).logits
    assert max(logit_differences(with_bounds, packed_case)) <= 1e-4
    # What the bounds fix: without them, flash attention runs each row of two or more rows as one
    # causal sequence across its samples.
    assert max(logit_differences(without_bounds, packed_case)) > 1e-2


# ----------------------------------------------------------------------------- torch_varlen


def test_torch_varlen_passes_each_signature_what_it_takes(varlen_kernel):
    """The attention function alone, on random heads: 4 query heads, 2 key/value heads, a softmax scale other than
    the kernel's own (torch 2.10's signature takes none: it is folded into the query), two padded packed rows."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 8, 16, generator=generator)
    key, value = torch.randn(2, 2, 2, 8, 16, generator=generator)
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 0, 1]])
    layer = torch.nn.Module()
    layer.is_causal = True
    output, weights = varlen_attention.varlen_attention_forward(layer, query, key, value, None, scaling=0.3,
                                                                **flash_varlen_kwargs(position_ids))
    assert weights is None and output.shape == (2, 8, 4, 16)
    for row, starts in enumerate([[0, 3, 8], [0, 4, 6, 8]]):
        for start, end in pairwise(starts):
            expected = F.scaled_dot_product_attention(query[row:row + 1, :, start:end], key[row:row + 1, :, start:end],
                                                      value[row:row + 1, :, start:end], is_causal=True, scale=0.3,
                                                      enable_gqa=True)
            torch.testing.assert_close(output[row, start:end], expected[0].transpose(0, 1))
    assert varlen_kernel.calls == [varlen_kernel.expected_call(0.3)]


def test_packed_rows_under_torch_varlen_equal_each_sample_alone(packed_case, tiny_model_dir, varlen_kernel):
    """Loaded as a user asks for it (--attn_implementation torch_varlen), its packed batches collated for the model's
    attention, as the SFT command does."""
    model = load_tiny(tiny_model_dir, "torch_varlen", packed_case.tokenizer)
    assert model.config._attn_implementation == "torch_varlen"
    batch = DataCollatorForSupervisedDataset(packed_case.tokenizer.eos_token_id,
                                             attn_implementation=model.config._attn_implementation)(packed_case.rows)
    assert set(FLASH_KEYS) <= set(batch)
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits
    assert max(logit_differences(logits, packed_case)) <= 1e-4
    layers = model.get_base_model().model.layers
    assert varlen_kernel.calls == [varlen_kernel.expected_call(layers[0].self_attn.scaling)] * len(layers)


def test_torch_varlen_without_bounds_runs_sdpa_with_its_mask(packed_case, varlen_kernel):
    """A left-padded batch (generation's) has no bounds: sdpa with the padding mask, so no token sees the padding
    before it, and each sample's logits are its own."""
    by_length = sorted(packed_case.alone, key=len)
    samples = [by_length[0], by_length[len(by_length) // 2], by_length[-1]]
    assert len({len(ids) for ids in samples}) == 3
    width = len(samples[-1])
    pad = packed_case.tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in samples])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in samples])
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), attention(packed_case.model, "torch_varlen"):
        logits = packed_case.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False).logits
    for row, ids in enumerate(samples):
        assert (logits[row, width - len(ids):] - packed_case.alone[ids]).abs().max().item() <= 1e-4
    assert varlen_kernel.calls == []


def test_torch_varlen_is_refused_where_torch_cannot_run_it(monkeypatch):
    with pytest.raises(InputError, match="runs on a CUDA GPU only"):
        varlen_attention.use_torch_varlen(on_gpu=False)
    with pytest.raises(InputError, match=r"computes in bfloat16 or float16 only .*: add --bf16"):
        varlen_attention.use_torch_varlen(on_gpu=True, float32_only=True)
    monkeypatch.setattr(varlen_attention, "KERNEL", None)
    with pytest.raises(InputError, match=r"has no torch.nn.attention.varlen \(torch 2.10 or later"):
        varlen_attention.use_torch_varlen(on_gpu=True)


# ----------------------------------------------------------------------------- flex_attention, and the control


@pytest.mark.slow  # flex attention compiles on the CPU: ~17 s with a cold inductor cache
def test_packed_rows_under_flex_attention_equal_each_sample_alone(packed_case):
    """transformers builds flex_attention's block mask from the restarting position ids: each sample's loss is its
    loss alone (sdpa)."""
    batch = DataCollatorForSupervisedDataset(packed_case.tokenizer.eos_token_id,
                                             attn_implementation="flex_attention")(packed_case.rows)
    with torch.no_grad(), attention(packed_case.model, "flex_attention"):
        logits = packed_case.model(**batch, use_cache=False).logits
    assert max(loss_differences(logits, packed_case)) <= 1e-4


def whole_row_control(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The control of a packed batch: the same rows and restarting position ids, and a causal mask over each whole
    row (data.build_dataset.whole_row_causal_mask, which the GPU benchmark's control takes too:
    benchmarks/gpu/packing_check.py)."""
    rows, width = batch["input_ids"].shape
    return {**batch, "attention_mask": whole_row_causal_mask(rows, width, device=batch["input_ids"].device)}


def test_a_causal_mask_over_whole_rows_mixes_the_samples(packed_case):
    """The control that can fail: transformers separates packed samples by their restarting position ids whatever
    is asked, so the control keeps those positions (RoPE unchanged) and gives a 4D causal mask over each whole row,
    which transformers takes as it is: only the attention differs, and each sample after the first of its row
    sees the samples before it."""
    batch = DataCollatorForSupervisedDataset(packed_case.tokenizer.eos_token_id,
                                             attn_implementation="sdpa")(packed_case.rows)
    with torch.no_grad():
        packed = packed_case.model(**batch, use_cache=False).logits
        mixed = packed_case.model(**whole_row_control(batch), use_cache=False).logits
    assert max(loss_differences(packed, packed_case)) <= 1e-4
    assert max(loss_differences(mixed, packed_case)) > 1e-2
    # Per sample: the first of each row has nothing before it; every later one's logits move (a mean loss can
    # move less by chance: here from under 1e-4 to 0.5).
    firsts = [sample.start == 0 for sample in samples_in(packed_case.rows)]
    differences = logit_differences(mixed, packed_case)
    assert max(d for d, first in zip(differences, firsts, strict=True) if first) <= 1e-4
    assert min(d for d, first in zip(differences, firsts, strict=True) if not first) > 1e-2


# ----------------------------------------------------------------------------- refusals


def check_sft_refused(model_dir: str, tmp_path, attn_implementation: str, expected: str) -> None:
    """A packed SFT run with this attention is refused with one line, before anything is written."""
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"instruction": "hello", "output": "hi"}) + "\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = tiny_sft_args(model_dir, out, cache, data_path=data, packing=True, attn_implementation=attn_implementation)
    check_refused(refuse(SFT_SCRIPT, args, in_process=True), expected)
    assert not out.exists() and not cache.exists()


def test_packing_refuses_an_attention_that_cannot_keep_samples_apart(tiny_model_dir, tmp_path):
    check_sft_refused(tiny_model_dir, tmp_path, "paged|eager", "--packing with --attn_implementation paged|eager")


def test_torch_varlen_training_is_refused_without_cuda(tiny_model_dir, tmp_path):
    check_sft_refused(tiny_model_dir, tmp_path, "torch_varlen",
                      "--attn_implementation torch_varlen runs on a CUDA GPU only")


def test_flex_attention_training_is_refused_without_cuda(tiny_model_dir, tmp_path):
    """torch's CPU flex attention runs forward (the test above) but has no backward: refused before anything is
    written, not as a traceback at the first step."""
    check_sft_refused(tiny_model_dir, tmp_path, "flex_attention",
                      "--attn_implementation flex_attention trains on a CUDA GPU only")
