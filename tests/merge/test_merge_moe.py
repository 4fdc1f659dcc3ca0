"""LoRA on a mixture-of-experts model's fused expert parameters (peft's target_parameters) merged by
scripts/merge/merge_llama_with_lora.py (lorakit.merge.experts: peft in memory): on tiny Qwen3-MoE and Mixtral
models the merged model, loaded back by transformers, computes peft's merge_and_unload logits (<= 1e-4 in
float32) and not the base's; its checkpoint has the per-expert layout transformers 5 saves and loads (the fused
gate_up_proj / down_proj split back per expert); the streaming path's refusals hold on this path."""

import logging
import os

import pytest
import torch
from test_merge_lora import SCRIPT, safetensors_names, snapshot, with_tokenizer

from helpers.commands import assert_ok, check_refused, refuse, run_in_process
from helpers.merge_tools import TOLERANCE, load_merged, logits_of, lora, merge

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
VOCAB = 400  # the tiny tokenizer's size (conftest.tiny_tokenizer_dir)
INPUT_IDS = torch.tensor([[1, 5, 17, 42, 99, 250, 399, 3, 7, 300]])


def tiny_qwen3_moe(experts: int = 4):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1,
                            max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


def tiny_mixtral(experts: int = 4):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=experts,
                           num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return MixtralForCausalLM(config).eval()


# What transformers 5.24's save_pretrained writes for layer 0's experts (its conversion mapping, reversed):
# one tensor per expert and projection, as the released checkpoints store them; never the fused parameter.
PER_EXPERT_KEYS = {
    "qwen3_moe": {f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")},
    "mixtral": {f"model.layers.0.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(4) for i in (1, 2, 3)},
}
FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral}


def tiny_qwen3_dense():
    """tiny_qwen3_moe's attention, embeddings and head, with a dense MLP in place of the experts."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).eval()


def expert_adapter(model, seed: int):
    """LoRA on the attention's q and v and on every expert's fused projections, B non-zero."""
    return lora(model, seed, target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMETERS,
                lora_dropout=0.0)


def save_base(model, base_dir, tiny_tokenizer_dir, **save) -> None:
    from transformers import AutoTokenizer

    model.save_pretrained(str(base_dir), **save)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(str(base_dir))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_expert_adapter_merged_as_peft_merges_it(family, tmp_path, tiny_tokenizer_dir, caplog):
    """The base sharded (several files): the merged model is sharded no larger than the base's largest file."""
    from transformers import AutoTokenizer

    base_dir, adapter_dir, out = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    model = FAMILIES[family]()
    save_base(model, base_dir, tiny_tokenizer_dir, max_shard_size="100KB")
    base_logits = logits_of(model, INPUT_IDS)
    peft_model = expert_adapter(model, seed=31)
    peft_model.save_pretrained(str(adapter_dir))
    reference = logits_of(peft_model.merge_and_unload(), INPUT_IDS)

    with caplog.at_level(logging.INFO, logger="merge_llama_with_lora"):
        merge(base_dir, [adapter_dir], out)
    assert any("expert adapter (target_parameters): merged through peft in memory; peak ~ 3 x the base" in
               record.getMessage() for record in caplog.records)
    merged_logits = logits_of(load_merged(out), INPUT_IDS)
    assert (merged_logits - reference).abs().max().item() <= TOLERANCE
    assert (merged_logits - base_logits).abs().max().item() > 0.01  # the adapter did something

    names = safetensors_names(out)
    assert PER_EXPERT_KEYS[family] <= set(names)
    assert not [name for name in names if "gate_up_proj" in name or name.endswith("experts.down_proj")]
    assert set(names) == set(safetensors_names(base_dir))  # the base's own layout, tensor for tensor
    base_sizes = [os.path.getsize(base_dir / name) for name in set(safetensors_names(base_dir).values())]
    out_files = set(names.values())
    assert len(out_files) >= 2 and (out / "model.safetensors.index.json").is_file()
    assert max(os.path.getsize(out / name) for name in out_files) <= max(base_sizes) + 4096  # + a header's slack
    assert len(AutoTokenizer.from_pretrained(str(out))) == VOCAB  # the tokenizer came along


def test_expert_adapter_with_verify(tmp_path, tiny_tokenizer_dir):
    """--verify on this path loads the written model back and compares it with peft's merge in memory."""
    base_dir, adapter_dir, out = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    model = tiny_mixtral()
    save_base(model, base_dir, tiny_tokenizer_dir)
    expert_adapter(model, seed=32).save_pretrained(str(adapter_dir))
    result = run_in_process(SCRIPT, ["--base_model", base_dir, "--lora_model", adapter_dir, "--output_dir", out,
                                     "--verify"])
    assert_ok(result)
    assert "verify: max abs logit difference, peft's merge in memory vs written: 0 " in result.stdout
    assert "through peft (expert adapter): 1 file(s)" in result.stdout


@pytest.fixture(scope="module")
def expert_inputs(tmp_path_factory, tiny_tokenizer_dir):
    """A 4-expert Qwen3-MoE base and its expert adapter (plain peft: no lorakit_base.json), an 8-expert base of the
    same shape otherwise, and a dense Qwen3 base with the same attention."""
    root = tmp_path_factory.mktemp("expert_inputs")
    model = tiny_qwen3_moe()
    save_base(model, root / "base", tiny_tokenizer_dir)
    expert_adapter(model, seed=33).save_pretrained(str(root / "adapter"))
    save_base(tiny_qwen3_moe(experts=8), root / "base_8_experts", tiny_tokenizer_dir)
    save_base(tiny_qwen3_dense(), root / "dense_base", tiny_tokenizer_dir)
    return root


REFUSALS = ["other_expert_count", "dense_base", "output_exists", "tokenizer_too_large"]


@pytest.mark.parametrize("case", REFUSALS)
def test_expert_adapter_refused(case, expert_inputs, tmp_path, extended_tokenizer_dir):
    base, adapter, out = expert_inputs / "base", expert_inputs / "adapter", tmp_path / "out"
    if case == "other_expert_count":
        base = expert_inputs / "base_8_experts"
        expected = "the adapter does not fit the base model: size mismatch for base_model.model.model.layers.0.mlp"
    elif case == "dense_base":  # peft would load the attention's LoRA, drop the experts' and only warn
        base = expert_inputs / "dense_base"
        expected = (f"adapter_model.safetensors: the --lora_model adapter does not fit the base {base}: 8 of its "
                    "expert LoRA keys (target_parameters ['mlp.experts.down_proj', 'mlp.experts.gate_up_proj']), "
                    "e.g. base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight, name weights the "
                    "base does not have")
    elif case == "output_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expected = "--output_dir exists and is not empty"
    else:  # the adapter carries a tokenizer larger than the embeddings it was trained with
        adapter = with_tokenizer(expert_inputs / "adapter", extended_tokenizer_dir, tmp_path)
        expected = "the tokenizer has 404 tokens but the merged embeddings have 400 rows"
    before = snapshot(expert_inputs)
    check_refused(refuse(SCRIPT, ["--base_model", base, "--lora_model", adapter, "--output_dir", out],
                         in_process=True), expected)
    assert snapshot(expert_inputs) == before
    if case == "output_exists":
        assert os.listdir(out) == ["keep.txt"]
    else:
        assert not out.exists()
    assert not [name for name in os.listdir(tmp_path) if ".tmp-" in name]


def test_the_adapter_check_finds_experts_in_either_checkpoint_layout(expert_inputs, tmp_path, tiny_tokenizer_dir):
    """core.model_files.check_adapter_fits_base (chat, serving, --peft_path) reads the base's headers: Mixtral's
    experts are mlp.experts in memory and block_sparse_moe.experts.N.wK in its checkpoint, Qwen3-MoE's keep their
    name; both bases take their expert adapter, a dense base of the same attention does not."""
    from lorakit.core.cli import InputError
    from lorakit.core.model_files import check_adapter_fits_base

    model = tiny_mixtral()
    model.save_pretrained(str(tmp_path / "mixtral"))
    expert_adapter(model, seed=34).save_pretrained(str(tmp_path / "mixtral_adapter"))
    check_adapter_fits_base(str(tmp_path / "mixtral_adapter"), str(tmp_path / "mixtral"), "--lora_model")
    check_adapter_fits_base(str(expert_inputs / "adapter"), str(expert_inputs / "base"), "--lora_model")
    with pytest.raises(InputError, match="model.layers.0.mlp.experts matches no module of the base"):
        check_adapter_fits_base(str(expert_inputs / "adapter"), str(expert_inputs / "dense_base"), "--lora_model")
