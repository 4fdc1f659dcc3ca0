"""scripts/training/estimate_memory.py: the trainable count is peft's on a really built model, the ZeRO
figures are DeepSpeed's own estimators on it plus the frozen base counted by hand, the activation rule
matches what autograd keeps, and bad input is one line."""

import os
from dataclasses import replace

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from helpers.commands import REPO, check_refused, run_in_process
from lorakit.commands import estimate_memory as command
from lorakit.models import memory as em
from lorakit.models.chunked_loss import LOGITS_PER_CHUNK, causal_lm_loss

SCRIPT = os.path.join(REPO, "scripts", "training", "estimate_memory.py")
TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Published parameter counts of the checkpoints whose shapes PUBLIC_SHAPES holds.
PUBLISHED_SIZES = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "codellama-34b": 33_743_970_304,
                   "llama2-70b": 68_976_648_192}


@pytest.fixture(scope="module")
def tiny_config_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_config")
    LlamaConfig(**TINY, tie_word_embeddings=False).save_pretrained(out)
    return str(out)


def estimate_args(**overrides) -> em.EstimateArguments:
    return replace(em.EstimateArguments(), lora_rank=8, **overrides)


def counts_for(config_dir: str, **overrides) -> em.ParameterCounts:
    args = estimate_args(model_name_or_path=config_dir, **overrides)
    return em.count_parameters(em.build_meta_model(em.read_model_config(config_dir, None), args))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("trainable, saved", [("all-linear", "embed_tokens,lm_head"), ("q_proj,v_proj", None)])
def test_trainable_count_is_peft_count_on_a_built_model(tmp_path, tied, trainable, saved):
    config = LlamaConfig(**TINY, tie_word_embeddings=tied)
    config.save_pretrained(tmp_path)
    counts = counts_for(str(tmp_path), trainable=trainable, modules_to_save=saved)

    base = LlamaForCausalLM(config)
    base_count = sum(p.numel() for p in base.parameters())
    targets = LLAMA_LINEARS if trainable == "all-linear" else trainable.split(",")
    built = get_peft_model(base, LoraConfig(r=8, target_modules=targets, modules_to_save=saved and saved.split(","),
                                            ensure_weight_tying=tied and bool(saved)))
    assert counts.trainable == sum(p.numel() for p in built.parameters() if p.requires_grad)
    assert counts.frozen == base_count
    assert counts.frozen_bytes == 2 * base_count  # bfloat16
    # What PPO's merged decode copies: the targeted layers' base weights, in bfloat16.
    assert counts.lora_targeted_bytes == 2 * sum(module.weight.numel() for name, module in base.named_modules()
                                                 if name.rsplit(".", 1)[-1] in targets)


def test_zero_figures_are_deepspeeds_estimators_plus_the_frozen_base(tiny_config_dir):
    counts = counts_for(tiny_config_dir, modules_to_save="embed_tokens,lm_head")
    base_count = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**TINY)).parameters())
    frozen, largest_frozen = 2 * base_count, 2 * TINY["vocab_size"] * TINY["hidden_size"]  # bf16; lm_head
    gpus, nodes = 4, 2
    configs = {zero.name: zero for zero in em.shipped_zero_configs()}
    assert set(configs) == {"ds_zero2_no_offload.json", "ds_zero3_no_offload.json", "ds_zero3_offload.json"}

    zero2 = em.model_state_bytes(counts, configs["ds_zero2_no_offload.json"], gpus, nodes, quantized=False)
    cpu, gpu = estimate_zero2_model_states_mem_needs(counts.trainable, gpus, nodes, cpu_offload=False)
    assert (zero2.gpu, zero2.cpu) == (gpu + frozen, int(cpu + frozen * gpus * 1.5))

    zero3 = em.model_state_bytes(counts, configs["ds_zero3_no_offload.json"], gpus, nodes, quantized=False)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(counts.trainable, counts.largest_trainable_layer, gpus,
                                                        nodes, cpu_offload=False, cpu_offload_params=False)
    assert (zero3.gpu, zero3.cpu) == (int(gpu + frozen / 8 + largest_frozen), int(cpu + largest_frozen * gpus * 1.5))

    offload = em.model_state_bytes(counts, configs["ds_zero3_offload.json"], gpus, nodes, quantized=False)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(counts.trainable, counts.largest_trainable_layer, gpus,
                                                        nodes, cpu_offload=True, cpu_offload_params=True)
    assert (offload.gpu, offload.cpu) == (gpu + largest_frozen, int(cpu + frozen / nodes * 1.5))
    assert counts.largest_trainable_layer == TINY["vocab_size"] * TINY["hidden_size"]  # the lm_head copy

    assert em.model_state_bytes(counts, configs["ds_zero3_no_offload.json"], gpus, nodes, quantized=True) is None


def test_zero3_memory_per_gpu_falls_as_gpus_rise():
    args = estimate_args(model_shape="llama2-13b", modules_to_save="embed_tokens,lm_head")
    counts = em.count_parameters(em.build_meta_model(em.read_model_config(None, "llama2-13b"), args))
    zero3 = next(zero for zero in em.shipped_zero_configs() if zero.stage == 3 and not zero.offload_param)
    per_gpu = [em.model_state_bytes(counts, zero3, gpus, 1, quantized=False).gpu for gpus in (1, 2, 4, 8)]
    assert per_gpu == sorted(per_gpu, reverse=True) and len(set(per_gpu)) == 4
    assert per_gpu[0] / per_gpu[3] > 4  # the frozen base and optimizer states are split 8 ways


def test_public_shapes_have_the_published_sizes():
    from transformers import AutoModelForCausalLM

    for shape, size in PUBLISHED_SIZES.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(em.read_model_config(None, shape))
        assert sum(p.numel() for p in model.parameters()) == size, shape


def stored_by_bitsandbytes(weight, kbits: int) -> list:
    """The tensors bitsandbytes keeps for a quantized weight: nf4 with double quantization, or int8 + row scales."""
    import bitsandbytes.functional as bnb_functional

    if kbits == 8:
        int8, row_scales, _ = bnb_functional.int8_vectorwise_quant(weight.half())
        return [int8, row_scales]
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    return [packed, state.code, state.absmax, state.offset, state.state2.absmax, state.state2.code]


@pytest.mark.parametrize("kbits", [4, 8])
def test_quantized_base_bytes_are_what_bitsandbytes_stores(tiny_config_dir, kbits):
    counts = counts_for(tiny_config_dir, load_in_kbits=kbits)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).to(torch.bfloat16)
    expected = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":  # the LM head stays 16-bit
            expected += sum(t.numel() * t.element_size() for t in stored_by_bitsandbytes(module.weight.data, kbits))
        else:
            expected += sum(2 * p.numel() for p in module.parameters(recurse=False))
    assert counts.frozen_bytes == expected
    assert counts.trainable == counts_for(tiny_config_dir).trainable  # the same LoRA on a quantized base


def saved_bytes_per_token(layers: int, checkpointing: bool, vocab_size: int = TINY["vocab_size"],
                          chunked: bool = False, lora_dropout: float = 0.05) -> float:
    """What autograd keeps for backward after one forward of a tiny bf16 Llama with LoRA (all-linear,
    dropout 0.05 unless given) and its loss (transformers' own, or the chunked loss), per token; the weights left
    out."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "num_hidden_layers": layers, "vocab_size": vocab_size}, attn_implementation="sdpa")
    model = get_peft_model(LlamaForCausalLM(config).to(torch.bfloat16),
                           LoraConfig(r=8, target_modules=LLAMA_LINEARS, lora_dropout=lora_dropout))
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    batch, length = 2, 32
    ids = torch.randint(vocab_size, (batch, length))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        if chunked:
            outputs = model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
            causal_lm_loss(outputs.hidden_states[-1], model.get_output_embeddings(), ids)
        else:
            model(input_ids=ids, labels=ids, use_cache=False)
    return sum(kept.values()) / (batch * length)


def test_activation_rule_matches_what_autograd_keeps():
    config = LlamaConfig(**TINY)
    per_layer = (saved_bytes_per_token(3, checkpointing=False) - saved_bytes_per_token(1, checkpointing=False)) / 2
    assert per_layer == em.layer_activation_bytes(config, lora_rank=8)
    # LoRA's dropout keeps 4 bytes per token of each adapted layer's input: a third of the layer here.
    no_dropout = (saved_bytes_per_token(3, False, lora_dropout=0.0)
                  - saved_bytes_per_token(1, False, lora_dropout=0.0)) / 2
    assert no_dropout == em.layer_activation_bytes(config, lora_rank=8, lora_dropout=0.0)
    assert per_layer - no_dropout == 4 * (6 * TINY["hidden_size"] + TINY["intermediate_size"])
    per_checkpoint = (saved_bytes_per_token(3, checkpointing=True) - saved_bytes_per_token(1, checkpointing=True)) / 2
    assert per_checkpoint == em.CHECKPOINT_BYTES_PER_HIDDEN * TINY["hidden_size"]
    per_vocab_entry = (saved_bytes_per_token(1, True, vocab_size=600) - saved_bytes_per_token(1, True)) / 300
    assert per_vocab_entry == 4  # the fp32 log-softmax, one of LOGIT_BYTES' three tensors


def tiny_moe_config(experts: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=experts,
                          num_experts_per_tok=2, vocab_size=300, attn_implementation="sdpa")


def moe_saved_bytes(config, tokens: int, lora_experts: bool) -> int:
    """What autograd keeps after one forward of a bf16 Qwen3-MoE with LoRA on its attention and, if lora_experts,
    on its fused experts (peft's target_parameters); the weights left out."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if lora_experts else None
    model = get_peft_model(Qwen3MoeForCausalLM(config).to(torch.bfloat16),
                           LoraConfig(r=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                      target_parameters=targets)).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def keep(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=torch.randint(300, (1, tokens)), use_cache=False, logits_to_keep=1)
    return sum(kept.values())


def test_lora_on_fused_experts_keeps_their_effective_weights_whatever_the_tokens():
    """peft's expert wrapper builds every expert's W + B A in each forward and keeps it for the backward: what the
    expert LoRA adds, less its per-token part, is expert_lora_bytes exactly, and grows with the experts."""
    for experts in (4, 8):
        config = tiny_moe_config(experts)
        added = {tokens: moe_saved_bytes(config, tokens, True) - moe_saved_bytes(config, tokens, False)
                 for tokens in (64, 128)}
        per_token = (added[128] - added[64]) / 64
        assert added[64] - 64 * per_token == em.expert_lora_bytes(config, lora_rank=8)
    assert em.expert_lora_bytes(config, 8) == 2 * 8 * (3 * 64 * 32 + 8 * (2 * 64 + 3 * 32))


def test_the_rollouts_kv_cache_is_what_generate_holds():
    """kv_cache_bytes against the static cache transformers' generate() allocates for a batch (grouped-query heads,
    bf16), and at the Llama-2-7B shape by hand: 2 x 32 layers x 32 heads x 128 x 2 bytes = 0.5 MiB per token."""
    from transformers import StaticCache

    config = LlamaConfig(**{**TINY, "num_key_value_heads": 2})
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    cache = StaticCache(config=config, max_cache_len=40)
    model(input_ids=torch.ones(6, 5, dtype=torch.long), past_key_values=cache, use_cache=True)
    held = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)
    assert held == em.kv_cache_bytes(config, answers=6, tokens=40, dtype_bytes=2)
    llama7b = LlamaConfig(**em.PUBLIC_SHAPES["llama2-7b"])
    assert em.kv_cache_bytes(llama7b, answers=64, tokens=512) == 64 * 512 * 2**19  # 16 GiB
    line = command.rollout_line(llama7b, estimate_args(per_device_generation_batch_size=64, max_seq_length=512))
    assert "a 16.0 GiB KV cache per GPU" in line and "64 answers (GRPO: 8 prompts x 8)" in line


def test_chunked_loss_keeps_no_logits_for_backward_and_the_estimate_holds_one_chunk():
    """The chunked loss (training's default) keeps nothing per token and vocabulary entry for backward (each
    chunk's logits are recomputed there), so the estimate's loss term is one chunk's, whatever the tokens."""
    per_vocab_entry = (saved_bytes_per_token(1, True, vocab_size=600, chunked=True)
                       - saved_bytes_per_token(1, True, chunked=True)) / 300
    assert per_vocab_entry == 0
    config = LlamaConfig(**{**TINY, "vocab_size": 32_000})
    chunk = (LOGITS_PER_CHUNK // 32_000) * em.LOGIT_BYTES * 32_000
    for tokens in (1024, 8192):
        full = em.activation_bytes(config, 8, tokens, checkpointing=True, chunked_loss=False)
        chunked = em.activation_bytes(config, 8, tokens, checkpointing=True, chunked_loss=True)
        assert full - chunked == tokens * em.LOGIT_BYTES * 32_000 - chunk
    assert em.loss_bytes(32_000, 100, chunked_loss=True) == 100 * em.LOGIT_BYTES * 32_000  # less than a chunk


def test_smallest_fit_takes_the_fewest_gpus_that_fit():
    config = em.read_model_config(None, "llama2-70b")
    args = estimate_args(model_shape="llama2-70b")
    # Llama-2-70B's frozen base and a 1.35 B-parameter adapter, without building it.
    counts = em.ParameterCounts(trainable=1_352_663_040, largest_trainable_layer=262_144_000,
                                frozen=68_976_648_192, frozen_bytes=2 * 68_976_648_192,
                                largest_frozen_layer_bytes=2 * 262_144_000)
    gpus, zero, per_gpu, _ = em.smallest_fit(counts, config, args, 80, offload=False)
    assert (gpus, zero.stage) == (4, 3)  # ZeRO-2 keeps the whole 128 GiB base on every GPU
    act = em.activation_bytes(config, 8, 1024, checkpointing=True)
    assert per_gpu == em.model_state_bytes(counts, zero, 4, 1, quantized=False).gpu + act <= 0.9 * 80 * em.GIB
    assert em.model_state_bytes(counts, zero, 2, 1, quantized=False).gpu + act > 0.9 * 80 * em.GIB


def test_report_names_every_shipped_config(tiny_config_dir):
    result = run_in_process(SCRIPT, ["--model_name_or_path", tiny_config_dir, "--lora_rank", "8", "--num_gpus", "2"])
    assert result.returncode == 0, result.stderr[-2000:]
    counts = counts_for(tiny_config_dir)
    assert f"trainable: {counts.trainable:,} parameters" in result.stdout
    for name in ("ds_zero2_no_offload.json", "ds_zero3_no_offload.json", "ds_zero3_offload.json"):
        assert name in result.stdout
    assert "activations per GPU come on top" in result.stdout
    assert "PPO with --enable_hybrid_engine adds" in result.stdout


def test_a_token_budget_is_the_activations_of_that_many_tokens(tiny_config_dir):
    """--max_tokens_per_batch 3072 holds the activations of 3072 tokens a GPU, whatever the batch size says."""
    common = ["--model_name_or_path", tiny_config_dir, "--lora_rank", "8", "--max_seq_length", "1024"]
    budget = run_in_process(SCRIPT, common + ["--max_tokens_per_batch", "3072", "--per_device_train_batch_size", "8"])
    rows = run_in_process(SCRIPT, common + ["--per_device_train_batch_size", "3"])
    assert budget.returncode == rows.returncode == 0, budget.stderr[-2000:]
    config = em.read_model_config(tiny_config_dir, None)
    expected = command.gib(em.activation_bytes(config, 8, 3072, checkpointing=True))
    line = next(line for line in budget.stdout.splitlines() if line.startswith("activations per GPU"))
    assert f"{expected} GiB with --activation_checkpointing" in line and "a budget of 3072 tokens" in line
    assert line.split(" GiB without")[0] == next(
        line for line in rows.stdout.splitlines() if line.startswith("activations per GPU")).split(" GiB without")[0]


@pytest.mark.parametrize("args, expected", [
    (["--model_shape", "llama2-7b", "--max_tokens_per_batch", "512"], "--max_tokens_per_batch 512 is below"),
    (["--model_name_or_path", "{missing}"], "config.json does not exist"),
    (["--model_shape", "llama2-7b", "--num_gpus", "0"], "--num_gpus"),
    (["--model_shape", "llama2-7b", "--num_nodes", "eight"], "--num_nodes"),
    (["--lora_rank", "8"], "exactly one of --model_name_or_path and --model_shape"),
    (["--model_shape", "llama2-7b", "--modules_to_save", "embed_tokens,lm_heads"], "--modules_to_save lm_heads"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, expected):
    args = [arg.format(missing=tmp_path / "no_model") for arg in args]
    check_refused(run_in_process(SCRIPT, args), expected)
