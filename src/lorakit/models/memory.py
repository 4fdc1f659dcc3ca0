"""The memory arithmetic of a LoRA or QLoRA run: how much GPU and CPU memory it needs under each ZeRO config we
ship, from DeepSpeed's own estimators, for a model's config and a GPU count; reads only config.json. The command
`lorakit estimate-memory` (lorakit.commands.estimate_memory) prints it.

The model is built on the meta device (no weights, no memory) and the LoRA attached by the
training scripts' own attach_lora (models.adapters), so the trainable count is exactly the one training logs.

DeepSpeed's estimators assume every parameter trains with Adam in 16-bit mixed precision: 2
bytes of 16-bit weight, 2 of 16-bit gradient, 4 of fp32 gradient, 4 of fp32 master weight and 8
of Adam moments per parameter, partitioned as each ZeRO stage does. With LoRA that holds for the
trainable parameters (adapter + --modules_to_save) only, so the estimators get those (and, for
ZeRO-3, the largest trainable layer), and the frozen base is added on its own:

    ZeRO-2: every GPU holds the whole frozen base (2 bytes a weight in bf16; 4-bit: 0.5 byte plus
            the quantization constants; 8-bit: 1 byte plus a fp32 scale per output row). A 16-bit
            base is read whole into CPU memory by each process before DeepSpeed moves it to its
            GPU; a quantized one is loaded straight onto each GPU.
    ZeRO-3: the frozen base is partitioned, 1/world of it per GPU, plus its largest layer gathered
            for that layer's forward; with offload_param it lives in CPU memory instead (1/nodes
            of it per node). QLoRA cannot run under ZeRO-3 (the model loader refuses it).

CPU figures are per node and carry DeepSpeed's additional_buffer_factor (1.5), as its own do.
Activations come on top of these model states; see activation_bytes for the rule used.
"""

import glob
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from lorakit.core.cli import InputError, read_json
from lorakit.core.package_data import DS_CONFIGS
from lorakit.models.chunked_loss import positions_per_chunk

if TYPE_CHECKING:  # transformers, peft and bitsandbytes load only inside the functions that build the model
    from bitsandbytes.nn import Params4bit
    from peft import PeftModel
    from transformers import PreTrainedConfig

GIB = 2**30
FP32_BYTES = 4
# DeepSpeed's estimators' default margin on CPU memory; applied to our CPU terms too.
CPU_BUFFER_FACTOR = 1.5
# Share of a card counted as usable: the estimators leave out the CUDA context, NCCL and ZeRO's
# communication buckets (reduce/allgather bucket sizes in ds_configs) and allocator fragmentation.
USABLE_CARD_FRACTION = 0.9
# GPU counts the fit table tries: one node, then nodes of 8.
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)
GPUS_PER_NODE = 8

# config.json values of the published checkpoints (meta-llama/Llama-2-{7b,13b,70b}-hf,
# codellama/CodeLlama-34b-hf) that decide their size and shape.
PUBLIC_SHAPES: dict[str, dict[str, Any]] = {
    "llama2-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096},
    "llama2-13b": {"hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                   "num_attention_heads": 40, "num_key_value_heads": 40, "max_position_embeddings": 4096},
    "codellama-34b": {"hidden_size": 8192, "intermediate_size": 22016, "num_hidden_layers": 48,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 16384,
                      "rope_theta": 1000000.0},
    "llama2-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 4096},
}
LLAMA_COMMON: dict[str, Any] = {"model_type": "llama", "vocab_size": 32000, "rms_norm_eps": 1e-5,
                                "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1,
                                "eos_token_id": 2}

# The shipped configs train in 16-bit mixed precision ("bf16"/"fp16": "auto"), which DeepSpeed's estimators assume.
TRAINING_DTYPES = ("bfloat16", "float16")
# bitsandbytes' 4-bit layout (Params4bit's defaults): blocks of 64 weights with one absmax each;
# with double quantization the absmax values are themselves 8-bit in blocks of 256 with a fp32
# absmax each, plus a 256-entry fp32 code book and a fp32 offset; the 16-entry fp32 nf4/fp4 code.
BNB_4BIT_BLOCK = 64
BNB_NESTED_BLOCK = 256
BNB_NESTED_FIXED_BYTES = 256 * FP32_BYTES + FP32_BYTES
BNB_4BIT_CODE_BYTES = 16 * FP32_BYTES

# Activation bytes per token of one Llama decoder layer with all-linear LoRA (dropout on) in
# 16-bit, as autograd keeps them for backward (counted with torch.autograd.graph.saved_tensors_hooks
# on Llama layers of several shapes, sdpa attention; tests/models/test_estimate_memory.py re-measures it):
# 60 per hidden unit, 14 per MLP unit, 4 per key/value unit, 4 per head (fp32 logsumexp), 28 per
# LoRA rank, 8 more.
LAYER_BYTES_PER = {"hidden": 60, "intermediate": 14, "kv": 4, "heads": 4, "rank": 28, "fixed": 8}
# Of those, what LoRA's dropout keeps (--lora_dropout > 0, measured the same way): 4 bytes per token for each
# adapted layer's input (peft's dropout output and its mask, for lora_A's backward): q, k, v, o, gate and up
# are hidden-wide, down is MLP-wide; 24 of the 60 per hidden unit and 4 of the 14 per MLP unit. With
# --lora_dropout 0 peft's dropout is the identity and lora_A reads the input the base layer keeps anyway.
DROPOUT_BYTES_PER_INPUT = 4
# A mixture of experts with LoRA on its fused experts (peft's ParamWrapper, models.adapters.expert_targets): each
# forward builds every expert's effective weight W + B A and keeps it, with the per-expert A and B it reshapes, for
# the backward, whatever the number of tokens: per MoE layer, 16-bit, E x (3 H I + r (2 H + 3 I)) values (gate_up
# and down; measured with saved_tensors_hooks, tests/models/test_estimate_memory.py).
EXPERT_WEIGHT_BYTES = 2
# Activation checkpointing keeps only each layer's 16-bit input: 2 bytes per hidden unit per layer.
CHECKPOINT_BYTES_PER_HIDDEN = 2
# The loss per logit: 16-bit logits, the fp32 copy the loss makes and its fp32 log-softmax, which
# cross-entropy keeps for backward (the 4 bytes autograd was seen to keep). transformers' loss holds them for
# every token at once; --chunked_loss (training's default) for one chunk of positions at a time.
LOGIT_BYTES = 2 + FP32_BYTES + FP32_BYTES


@dataclass
class EstimateArguments:
    """The model and run to estimate; LoRA flags mean what they mean to the training scripts."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A model directory or its config.json (only the config is read)."})
    model_shape: str | None = field(
        default=None, metadata={"help": "A published shape instead of a config.", "choices": list(PUBLIC_SHAPES)})
    num_gpus: int = field(default=8, metadata={"help": "GPUs per node."})
    num_nodes: int = field(default=1, metadata={"help": "Nodes."})
    lora_rank: int = field(
        default=64, metadata={"help": "LoRA rank r (Chinese-LLaMA-Alpaca-2's 64; training's default is 8)."})
    lora_dropout: float = field(
        default=0.05, metadata={"help": "As in training (its default): above 0, each adapted layer keeps a copy of "
                                        "its input for backward (a third of a layer's activations); 0: none."})
    trainable: str = field(default="all-linear", metadata={"help": "LoRA target modules, as in training."})
    lora_experts: str = field(
        default="auto", metadata={"help": "As in training: a mixture of experts' fused experts carry LoRA (auto, "
                                          "yes) or not (no).", "choices": ["auto", "yes", "no"]})
    modules_to_save: str | None = field(
        default=None, metadata={"help": "Modules trained in full, comma list (e.g. embed_tokens,lm_head)."})
    load_in_kbits: int = field(default=16, metadata={"help": "4 or 8: QLoRA; 16: no.", "choices": [4, 8, 16]})
    double_quant: bool = field(default=True, metadata={"help": "4-bit: quantize the quantization constants."})
    torch_dtype: str = field(
        default="bfloat16",
        metadata={"help": "Precision of the frozen weights and activations (the run's --bf16/--fp16).",
                  "choices": list(TRAINING_DTYPES)})
    per_device_train_batch_size: int = field(default=1, metadata={"help": "Sequences per GPU per step."})
    max_tokens_per_batch: int | None = field(
        default=None, metadata={"help": "SFT's token-budget batching: tokens per GPU per micro-batch, in place of "
                                        "--per_device_train_batch_size x --max_seq_length."})
    chunked_loss: bool = field(
        default=True, metadata={"help": "As in training (its default): the loss holds one chunk of logits at a "
                                        "time; false: transformers' loss over every token's logits."})
    max_seq_length: int = field(default=1024, metadata={"help": "Tokens per sequence (--block_size in pt; a "
                                                                  "rollout's prompt + answer in PPO and GRPO)."})
    num_generations: int = field(default=8, metadata={"help": "GRPO: answers sampled per prompt."})
    per_device_generation_batch_size: int = field(
        default=8, metadata={"help": "PPO / GRPO: answers sampled together per GPU (their KV cache is held at once)."})
    fit_table: bool = field(
        default=False,
        metadata={"help": "Print the markdown table of docs/nodes-and-memory.md instead: every --model_shape, "
                          "LoRA in bf16 and QLoRA 4-bit, the fewest GPUs and shipped config that fit 24/40/80 GB "
                          "cards (--num_gpus and --num_nodes are not used)."})


@dataclass
class ParameterCounts:
    """What the estimators need from a model with its adapter attached."""

    trainable: int
    largest_trainable_layer: int  # parameters of the module with the most trainable ones of its own
    frozen: int
    frozen_bytes: int
    largest_frozen_layer_bytes: int
    # The base weights of the LoRA-targeted layers (unquantized): what PPO's --enable_hybrid_engine copies while it
    # decodes on the merged adapter (rl.rollout.merged_adapters).
    lora_targeted_bytes: int = 0


@dataclass
class ZeroConfig:
    """A shipped ds_configs/*.json as the estimators see it."""

    name: str
    stage: int
    offload_optimizer: bool
    offload_param: bool


@dataclass
class MemoryEstimate:
    """Bytes for one ZeRO config: the DeepSpeed estimator's part (trainable) and the frozen base's."""

    trained_gpu: int
    trained_cpu: int
    frozen_gpu: int
    frozen_cpu: int

    @property
    def gpu(self) -> int:
        return self.trained_gpu + self.frozen_gpu

    @property
    def cpu(self) -> int:
        return self.trained_cpu + self.frozen_cpu


def shipped_zero_configs(directory: str = DS_CONFIGS) -> list[ZeroConfig]:
    """The ZeRO stage and offloads of every config in ds_configs/, fastest first (no offload, lower stage)."""
    configs = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        zero = read_json(path, "DeepSpeed config").get("zero_optimization", {})
        configs.append(ZeroConfig(
            name=os.path.basename(path),
            stage=int(zero.get("stage", 0)),
            offload_optimizer=zero.get("offload_optimizer", {}).get("device") == "cpu",
            offload_param=zero.get("offload_param", {}).get("device") == "cpu",
        ))
    return sorted(configs, key=lambda c: (c.offload_optimizer or c.offload_param, c.stage, c.name))


def read_model_config(path: str | None, shape: str | None) -> "PreTrainedConfig":
    """The transformers config of --model_name_or_path (a directory or its config.json) or --model_shape."""
    from transformers import AutoConfig, LlamaConfig

    if shape is not None and path is None:
        return LlamaConfig(**LLAMA_COMMON, **PUBLIC_SHAPES[shape])
    if path is None or shape is not None:
        raise InputError("give exactly one of --model_name_or_path and --model_shape")
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    values = read_json(config_file, "config.json")  # one line for a missing or broken file
    if "model_type" not in values:
        raise InputError(f"{config_file}: field 'model_type' is missing")
    try:
        return AutoConfig.from_pretrained(config_file)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{config_file}: cannot read the model config ({err})") from None


def build_meta_model(config: "PreTrainedConfig", args: EstimateArguments) -> "PeftModel":
    """The model as training builds it: quantized layers where --load_in_kbits asks (bitsandbytes'
    modules, chosen by transformers' own rule), and the LoRA attached by the training scripts'
    attach_lora; all on the meta device."""
    from transformers import AutoModelForCausalLM

    from lorakit.models.adapters import attach_lora
    from lorakit.models.arguments import ModelArguments, comma_list

    name = args.model_name_or_path or args.model_shape
    if name is None:
        raise InputError("give exactly one of --model_name_or_path and --model_shape")
    model_args = ModelArguments(model_name_or_path=name,
                                lora_rank=args.lora_rank, trainable=args.trainable, lora_experts=args.lora_experts,
                                modules_to_save=args.modules_to_save, load_in_kbits=args.load_in_kbits,
                                double_quant=args.double_quant)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.torch_dtype))
        except (ValueError, KeyError, TypeError) as err:
            raise InputError(f"--model_name_or_path: cannot build a causal LM from this config ({err})") from None
        if args.load_in_kbits < 16:
            quantize_layers(model, args)
        check_modules_to_save(model, comma_list(args.modules_to_save))
        return attach_lora(model, model_args)


def check_modules_to_save(model: torch.nn.Module, names: list[str]) -> None:
    """peft trains nothing for a --modules_to_save name that matches no module, silently; an estimate
    that left it out would mislead, so it is refused."""
    paths = [path for path, _ in model.named_modules()]
    for name in names:
        if not any(path == name or path.endswith("." + name) for path in paths):
            raise InputError(f"--modules_to_save {name}: this model has no module of that name")


def quantize_layers(model: torch.nn.Module, args: EstimateArguments) -> None:
    """Swap in bitsandbytes' layers where from_pretrained would (every linear layer but the LM head)."""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    if args.load_in_kbits == 4:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=args.double_quant)
    else:
        quant = BitsAndBytesConfig(load_in_8bit=True)
    skip = get_keys_to_not_convert(model) + list(getattr(model, "_keep_in_fp32_modules", None) or [])
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=quant)


def quantized_weight_bytes(module: torch.nn.Module, weight: torch.nn.Parameter) -> int | None:
    """Bytes bitsandbytes stores for a quantized layer's weight, None for a weight kept as it is."""
    import bitsandbytes as bnb

    count = weight.numel()
    if isinstance(module, bnb.nn.Linear8bitLt):
        return count + FP32_BYTES * weight.shape[0]  # int8 weights and a fp32 scale per output row
    if not isinstance(module, bnb.nn.Linear4bit):
        return None
    blocks = -(-count // BNB_4BIT_BLOCK)
    packed = -(-count // 2) + BNB_4BIT_CODE_BYTES
    # A Linear4bit's weight is bitsandbytes' Params4bit, which holds its quantization options.
    if not cast("Params4bit", weight).compress_statistics:
        return packed + FP32_BYTES * blocks
    return packed + blocks + FP32_BYTES * -(-blocks // BNB_NESTED_BLOCK) + BNB_NESTED_FIXED_BYTES


def count_parameters(model: torch.nn.Module) -> ParameterCounts:
    """Trainable and frozen parameters, counted per module so that shared ones count once and the
    largest layer (what ZeRO-3 gathers at a time) is known."""
    trainable = frozen = frozen_bytes = targeted_bytes = 0
    largest_trainable = largest_frozen_bytes = 0
    seen = set()
    for module in model.modules():
        targeted_bytes += lora_targeted_bytes(module)
        module_trainable = module_frozen_bytes = 0
        for weight in module.parameters(recurse=False):
            if id(weight) in seen:
                continue
            seen.add(id(weight))
            if weight.requires_grad:
                module_trainable += weight.numel()
                continue
            stored = quantized_weight_bytes(module, weight)
            module_frozen_bytes += weight.numel() * weight.element_size() if stored is None else stored
            frozen += weight.numel()
        trainable += module_trainable
        frozen_bytes += module_frozen_bytes
        largest_trainable = max(largest_trainable, module_trainable)
        largest_frozen_bytes = max(largest_frozen_bytes, module_frozen_bytes)
    return ParameterCounts(trainable, largest_trainable, frozen, frozen_bytes, largest_frozen_bytes, targeted_bytes)


def lora_targeted_bytes(module: torch.nn.Module) -> int:
    """Bytes of a LoRA layer's base weights where they are not quantized (a quantized base decodes unmerged); 0
    for any other module."""
    # getattr: nn.Module's __getattr__ would type peft's method as a Tensor or a Module.
    get_base_layer = getattr(module, "get_base_layer", None)
    if not hasattr(module, "lora_A") or get_base_layer is None:
        return 0
    base = get_base_layer()
    if any(quantized_weight_bytes(base, weight) is not None for weight in base.parameters(recurse=False)):
        return 0
    return sum(weight.numel() * weight.element_size() for weight in base.parameters(recurse=False))


def model_state_bytes(counts: ParameterCounts, zero: ZeroConfig, gpus_per_node: int, num_nodes: int,
                      quantized: bool) -> MemoryEstimate | None:
    """Per-GPU and per-node CPU bytes of model states under one ZeRO config (module docstring);
    None where the toolkit refuses the combination (a quantized base under ZeRO-3)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    world = gpus_per_node * num_nodes
    frozen_gpu: float
    frozen_cpu: float
    if zero.stage == 3:
        if quantized:
            return None
        # The Trainer builds a ZeRO-3 model under zero.Init: partitioned as it loads.
        trained_cpu, trained_gpu, _ = estimate_zero3_model_states_mem_needs(
            counts.trainable, counts.largest_trainable_layer, gpus_per_node, num_nodes,
            cpu_offload=zero.offload_optimizer, cpu_offload_params=zero.offload_param, zero_init=True,
            additional_buffer_factor=CPU_BUFFER_FACTOR)
        gathered = counts.largest_frozen_layer_bytes
        if zero.offload_param:
            frozen_gpu, frozen_cpu = gathered, counts.frozen_bytes / num_nodes * CPU_BUFFER_FACTOR
        else:
            frozen_gpu = counts.frozen_bytes / world + gathered
            frozen_cpu = gathered * gpus_per_node * CPU_BUFFER_FACTOR  # each process's layer being loaded
    else:
        trained_cpu, trained_gpu = estimate_zero2_model_states_mem_needs(
            counts.trainable, gpus_per_node, num_nodes, cpu_offload=zero.offload_optimizer,
            additional_buffer_factor=CPU_BUFFER_FACTOR)
        frozen_gpu = counts.frozen_bytes
        frozen_cpu = 0 if quantized else counts.frozen_bytes * gpus_per_node * CPU_BUFFER_FACTOR
    return MemoryEstimate(int(trained_gpu), int(trained_cpu), int(frozen_gpu), int(frozen_cpu))


def layer_activation_bytes(config: "PreTrainedConfig", lora_rank: int, lora_dropout: float = 0.05) -> int:
    """Bytes per token one Llama-family decoder layer with all-linear LoRA keeps for backward in
    16-bit (LAYER_BYTES_PER), less the dropout's copies (DROPOUT_BYTES_PER_INPUT) without dropout."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = mlp_width(config)
    with_dropout = (LAYER_BYTES_PER["hidden"] * hidden + LAYER_BYTES_PER["intermediate"] * intermediate
                    + LAYER_BYTES_PER["kv"] * kv_heads * head_dim + LAYER_BYTES_PER["heads"] * heads
                    + LAYER_BYTES_PER["rank"] * lora_rank + LAYER_BYTES_PER["fixed"])
    return with_dropout - (0 if lora_dropout > 0 else dropout_bytes(hidden, intermediate))


def dropout_bytes(hidden: int, intermediate: int) -> int:
    """What LoRA's dropout keeps per token in one layer: the inputs of q, k, v, o, gate and up (hidden-wide; o's
    is heads x head_dim, hidden in the families the rule was measured on) and down (MLP-wide)."""
    return DROPOUT_BYTES_PER_INPUT * (6 * hidden + intermediate)


class ExpertShape(NamedTuple):
    """What a mixture-of-experts config says of its MLPs (transformers' field names differ by family)."""

    experts: int  # routed experts per layer (0: a dense model)
    top_k: int  # experts each token goes to
    width: int  # one routed expert's intermediate size
    shared_width: int  # the shared expert(s)' intermediate size, 0 for none


def expert_shape(config: "PreTrainedConfig") -> ExpertShape:
    experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
               or getattr(config, "n_routed_experts", None) or 0)
    if not experts:
        return ExpertShape(0, 0, 0, 0)
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = (getattr(config, "shared_expert_intermediate_size", None)
              or (getattr(config, "n_shared_experts", None) or 0) * width)
    return ExpertShape(experts, config.num_experts_per_tok, width, shared)


def mlp_width(config: "PreTrainedConfig") -> int:
    """The MLP width a token's activations follow: a dense model's intermediate size; for a mixture of experts,
    its top-k routed experts' and its shared expert's together (an approximation: the rule was measured on
    dense layers)."""
    shape = expert_shape(config)
    if not shape.experts:
        return getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    return shape.top_k * shape.width + shape.shared_width


def expert_lora_bytes(config: "PreTrainedConfig", lora_rank: int) -> int:
    """Bytes one MoE layer keeps for backward when its experts carry LoRA (EXPERT_WEIGHT_BYTES), whatever the
    tokens; 0 for a dense model."""
    shape, hidden = expert_shape(config), config.hidden_size
    values = shape.experts * (3 * hidden * shape.width + lora_rank * (2 * hidden + 3 * shape.width))
    return EXPERT_WEIGHT_BYTES * values


def loss_bytes(vocab_size: int, tokens: int, chunked_loss: bool) -> int:
    """The loss's logits, their fp32 copy and log-softmax (LOGIT_BYTES each): for every token, or with the
    chunked loss for the positions of one chunk."""
    positions = min(tokens, positions_per_chunk(vocab_size)) if chunked_loss else tokens
    return positions * LOGIT_BYTES * vocab_size


def activation_bytes(config: "PreTrainedConfig", lora_rank: int, tokens: int, checkpointing: bool,
                     chunked_loss: bool = True, lora_dropout: float = 0.05, lora_experts: bool = True) -> int:
    """Per-GPU activation bytes for `tokens` tokens (batch x sequence length) of a Llama-family model.

    With activation checkpointing: each decoder layer's 16-bit input (2 x layers x tokens x hidden
    bytes), plus one layer's activations while it is recomputed in backward, plus the loss over the
    vocabulary (loss_bytes): the 16-bit logits, their fp32 copy and the fp32 log-softmax kept for backward,
    alive together. Without it, every layer's activations are kept. An upper bound: the loss and a
    layer's recompute do not peak at the same time. A mixture of experts whose experts carry LoRA (lora_experts)
    adds expert_lora_bytes per layer kept: one layer with checkpointing, every layer without."""
    per_layer = layer_activation_bytes(config, lora_rank, lora_dropout)
    layers = config.num_hidden_layers
    experts = expert_lora_bytes(config, lora_rank) if lora_experts else 0
    if checkpointing:
        kept, fixed = CHECKPOINT_BYTES_PER_HIDDEN * config.hidden_size * layers + per_layer, experts
    else:
        kept, fixed = per_layer * layers, experts * layers
    return tokens * kept + fixed + loss_bytes(config.vocab_size, tokens, chunked_loss)


def kv_cache_bytes(config: "PreTrainedConfig", answers: int, tokens: int, dtype_bytes: int = 2) -> int:
    """The KV cache of a generation batch: every layer's keys and values for answers x tokens positions (the
    rollout engines' static cache holds the whole length from the first token)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * answers * tokens * dtype_bytes


def fits(total_bytes: float, card_gib: int) -> bool:
    return total_bytes <= card_gib * GIB * USABLE_CARD_FRACTION


def lora_dropout(config: "PreTrainedConfig", args: EstimateArguments) -> float:
    """The dropout training gives the adapter: none where it puts LoRA on fused experts (models.adapters)."""
    return 0.0 if expert_shape(config).experts and args.lora_experts != "no" else args.lora_dropout


def batch_tokens(args: EstimateArguments) -> int:
    """Tokens one micro-batch holds per GPU: the token budget, or batch size x sequence length."""
    return args.max_tokens_per_batch or args.per_device_train_batch_size * args.max_seq_length


class Fit(NamedTuple):
    """Where a run fits a card: how many GPUs, under which shipped config, and the bytes it then takes."""

    gpus: int
    zero: ZeroConfig
    gpu_bytes: int  # model states + activations per GPU
    cpu_bytes: int  # model states' CPU memory per node


def smallest_fit(counts: ParameterCounts, config: "PreTrainedConfig", args: EstimateArguments, card_gib: int,
                 offload: bool) -> Fit | None:
    """Fit (GPUs, config, model states + activations per GPU, model states' CPU per node) with the fewest
    GPUs, then the fastest config, that fits the card; offloading configs only when offload, the
    others otherwise; None if nothing fits up to the largest of GPU_COUNTS."""
    tokens = batch_tokens(args)
    act = activation_bytes(config, args.lora_rank, tokens, True, args.chunked_loss, lora_dropout(config, args),
                           args.lora_experts != "no")
    configs = [z for z in shipped_zero_configs() if (z.offload_optimizer or z.offload_param) == offload]
    for total in GPU_COUNTS:
        per_node, nodes = min(total, GPUS_PER_NODE), max(1, total // GPUS_PER_NODE)
        for zero in configs:
            estimate = model_state_bytes(counts, zero, per_node, nodes, args.load_in_kbits < 16)
            if estimate is not None and fits(estimate.gpu + act, card_gib):
                return Fit(total, zero, estimate.gpu + act, estimate.cpu)
    return None
