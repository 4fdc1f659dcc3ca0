"""LoRA through peft: a new adapter on the layers --trainable names (all-linear resolved per model), a saved one
continued, folded into the base in memory, or kept on a frozen model; a saved adapter made for another base refused
in one line."""

import logging
import os
from typing import TYPE_CHECKING, cast

import torch
from transformers.integrations import is_deepspeed_zero3_enabled

from lorakit.core.cli import InputError, read_json
from lorakit.core.model_files import expert_parameter_targets
from lorakit.models.arguments import ALL_LINEAR, ModelArguments, comma_list

if TYPE_CHECKING:  # peft is imported where an adapter is made or loaded; transformers' models where they are built
    from peft import PeftModel
    from transformers import PreTrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)


def check_foldable(path: str, flag: str) -> None:
    if is_deepspeed_zero3_enabled():
        raise InputError(f"{flag} {path} with a ZeRO-3 DeepSpeed config: the adapter cannot be folded into "
                         "partitioned weights; merge it first (scripts/merge) and pass the merged model")


def frozen(model: "PreTrainedModel", model_args: ModelArguments, quantized: bool,
           adapter_flag: str) -> "PreTrainedModel":
    """A model that is only run: the --peft_path adapter folded into the weights (one plain forward
    per pass), or on a quantized base left as LoRA layers inside the model (folding would round
    it into the quantized weights); no parameter trains, eval mode."""
    if model_args.peft_path:
        adapted = load_peft_adapter(model, model_args.peft_path, is_trainable=False, flag=adapter_flag)
        # peft types both as nn.Module: each returns the transformers model it wraps.
        model = cast("PreTrainedModel", adapted.get_base_model() if quantized else adapted.merge_and_unload())
    model.requires_grad_(False)
    return model.eval()


def fold_in_adapter(model: "PreTrainedModel", path: str, flag: str) -> "PreTrainedModel":
    """The adapter at path merged into the loaded base's weights (in memory, nothing written)."""
    check_foldable(path, flag)
    logger.info("folding the adapter %s into the base in memory: a new LoRA trains on base + adapter", path)
    return load_peft_adapter(model, path, is_trainable=False, flag=flag).merge_and_unload()


def expert_adapter_dropout(model: "PreTrainedModel", dropout: float, experts: list[str], empty: bool) -> float:
    """--lora_dropout, or 0 with LoRA on fused experts (peft's wrapper of fused expert weights takes no dropout);
    said once in the log (not for the empty skeleton), with what QLoRA leaves unquantized on such a model."""
    log = logger.info if not empty else (lambda *args: None)
    if experts and dropout > 0:
        log("LoRA on the experts (%s): --lora_dropout %g -> 0 for this adapter, as peft's wrapper of fused expert "
            "weights takes no dropout", ",".join(experts), dropout)
        dropout = 0.0
    quantized = getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
    if expert_parameter_names(model) and quantized:
        log("QLoRA on a mixture of experts: bitsandbytes quantizes nn.Linear layers only, so the fused experts stay "
            "in %s (estimate_memory.py counts them so)", model.dtype)
    return dropout


def attach_lora(model: "PreTrainedModel", model_args: ModelArguments, task: str = "causal_lm",
                adapter_flag: str = "--peft_path", empty: bool = False) -> "PeftModel":
    """The --peft_path adapter continued, or a new LoRA adapter; empty: model is check_load_plan's empty skeleton,
    and the adapter's weights stay on the meta device too (nothing is logged: the real load logs it)."""
    from peft import LoraConfig, TaskType, get_peft_model

    if model_args.peft_path:
        if not empty:
            logger.info("continuing LoRA adapter %s", model_args.peft_path)
        return load_peft_adapter(model, model_args.peft_path, is_trainable=True, flag=adapter_flag,
                                 low_cpu_mem_usage=empty)
    modules_to_save = comma_list(model_args.modules_to_save)
    targets = lora_target_modules(model, model_args.trainable, modules_to_save)
    if not targets:
        raise InputError("--trainable must name at least one module for LoRA (or use --full_finetuning)")
    if model_args.trainable.strip() == ALL_LINEAR and not empty:
        logger.info("LoRA targets (%s): %s", ALL_LINEAR, ",".join(targets))
    experts = expert_targets(model, model_args)
    dropout = expert_adapter_dropout(model, model_args.lora_dropout, experts, empty)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # A tied model keeps one matrix for embed_tokens and lm_head; training two separate copies
    # would untie them and change what the merged model means.
    ensure_tying = tied and bool(modules_to_save) and bool({"embed_tokens", "lm_head"} & set(modules_to_save))
    lora_config = LoraConfig(
        # SEQ_CLS also trains the score head in full and saves it with the adapter.
        task_type=TaskType.SEQ_CLS if task == "reward" else TaskType.CAUSAL_LM,
        target_modules=targets,
        target_parameters=experts or None,
        r=model_args.lora_rank,
        lora_alpha=model_args.lora_alpha,  # type: ignore[arg-type]  # peft annotates int; it only computes alpha / r
        lora_dropout=dropout,
        modules_to_save=modules_to_save or None,
        ensure_weight_tying=ensure_tying,
    )
    try:
        return get_peft_model(model, lora_config, low_cpu_mem_usage=empty)
    except ValueError as err:
        raise InputError(f"--trainable {model_args.trainable}: {err}") from None


def lora_target_modules(model: "PreTrainedModel", trainable: str, modules_to_save: list[str]) -> list[str]:
    """--trainable as peft target names: the comma list as given, or for all-linear the names found
    in this model (attach_lora logs them). Resolved here rather than by peft so adapter_config.json
    lists the layers by name, and a reader of the log sees what is trained."""
    if trainable.strip() != ALL_LINEAR:
        return comma_list(trainable)
    return [name for name in linear_layer_names(model) if name not in modules_to_save]


def expert_parameter_names(model: "PreTrainedModel") -> list[str]:
    """peft target_parameters names (matched as suffixes) of a mixture-of-experts model's fused experts: the 3-D
    weights (experts x out x in) of every module named `experts`, as transformers 5 keeps them (Qwen3-MoE's and
    Mixtral's `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`): no nn.Linear, so all-linear's search by type
    never finds them. Empty for a dense model."""
    names = []
    for path, module in model.base_model.named_modules():
        if path.rsplit(".", 1)[-1] != "experts":
            continue
        for parameter_name, parameter in module.named_parameters(recurse=False):
            name = f"{below_layer_index(path)}.{parameter_name}"
            # ZeRO-3 (zero.Init) leaves a partitioned parameter 1-D: its full shape is ds_shape.
            if len(getattr(parameter, "ds_shape", parameter.shape)) == 3 and name not in names:
                names.append(name)
    return names


def below_layer_index(path: str) -> str:
    """The module path after its last numeric part (the layer index): "model.layers.0.mlp.experts" ->
    "mlp.experts"; the whole path where there is none."""
    parts = path.split(".")
    last_index = max((i for i, part in enumerate(parts) if part.isdigit()), default=-1)
    return ".".join(parts[last_index + 1:])


def expert_targets(model: "PreTrainedModel", model_args: ModelArguments) -> list[str]:
    """The expert weights this adapter trains (--lora_experts): auto and yes train them with all-linear, yes with
    a --trainable list too; an explicit list that would leave a MoE model's experts frozen is refused under auto,
    so that a run never trains none of them without saying so; no leaves them frozen."""
    experts = expert_parameter_names(model)
    mode, explicit = model_args.lora_experts, model_args.trainable.strip() != ALL_LINEAR
    if mode == "yes" and not experts:
        raise InputError("--lora_experts yes: this model has no fused expert weights (it is not a mixture of "
                         "experts); drop the flag")
    if not experts or mode == "no":
        return []
    if explicit and mode == "auto":
        raise InputError(f"--trainable {model_args.trainable} leaves the experts of this mixture-of-experts model "
                         f"frozen ({', '.join(experts)}): add --lora_experts yes to train them too, or "
                         "--lora_experts no if frozen experts are meant")
    return experts


def saved_expert_targets(adapter_dir: str) -> list[str]:
    """The fused expert weights a saved adapter trains (its target_parameters, each once), sorted; [] for none."""
    config = read_json(os.path.join(adapter_dir, "adapter_config.json"), "adapter_config.json")
    return expert_parameter_targets(config.get("target_parameters"))


def planned_expert_targets(config: "PreTrainedConfig", model_args: ModelArguments, like: list[str]) -> list[str]:
    """The expert weights a new adapter on a base of this config would train (expert_targets, before the model is
    built): those of a saved adapter of the same base (`like`) when the base is a mixture of experts and
    --lora_experts does not say no, else none."""
    moe = any(getattr(config, field, None) for field in ("num_experts", "num_local_experts", "n_routed_experts"))
    if not moe or model_args.lora_experts == "no":
        return []
    # A saved adapter that trains none tells nothing of the names: the new one trains the experts, whatever they are.
    return like or ["(the experts)"]


def linear_layer_names(model: "PreTrainedModel") -> list[str]:
    """Target names (peft matches them as name suffixes) of every linear layer of the decoder body, in
    model order: torch.nn.Linear, which bitsandbytes' Linear4bit and Linear8bitLt subclass, and
    transformers' Conv1D (GPT-2's c_attn/c_proj/c_fc). Only the body (model.base_model) is searched,
    so the LM head and task heads (score, classifier, ...) next to it are left out whatever their
    names; the output embedding is excluded by identity for a model whose body holds it."""
    from transformers.pytorch_utils import Conv1D

    output_embedding = model.get_output_embeddings()
    names = []
    for path, module in model.base_model.named_modules():
        if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not output_embedding:
            name = layer_suffix(path)
            if name not in names:
                names.append(name)
    return names


def layer_suffix(path: str) -> str:
    """The module path from its last non-numeric part: "layers.0.mlp.up_proj" -> "up_proj", and
    "mlp.fc.0" -> "fc.0", since a bare "0" would match every module whose name ends in ".0"."""
    parts = path.split(".")
    start = max((i for i, part in enumerate(parts) if not part.isdigit()), default=0)
    return ".".join(parts[start:])


def load_peft_adapter(model: "PreTrainedModel", path: str, is_trainable: bool, flag: str = "--peft_path",
                      low_cpu_mem_usage: bool = False) -> "PeftModel":
    """A saved LoRA adapter on model; an adapter made for another base is refused in one line.
    low_cpu_mem_usage: peft's, the adapter's weights put on the device of the layers they adapt (an
    empty skeleton's meta device)."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, path, is_trainable=is_trainable, low_cpu_mem_usage=low_cpu_mem_usage)
    except RuntimeError as err:
        if "size mismatch" in str(err):
            first = str(err).split("size mismatch", 1)[1].split("\n", 1)[0]
            raise InputError(f"{path}: {flag} adapter does not fit this base model (size mismatch{first})") from None
        raise


# Kinds of trained parameters, by a part of their name, first match wins: what a mixture-of-experts run trains is
# named in the log (a run that trains no expert says so by its zero).
PARAMETER_KINDS = (("shared experts", ("shared_expert.",)), ("experts", (".experts.",)),
                   ("router", ("shared_expert_gate", ".gate.weight", "router")),
                   ("embeddings", ("embed_tokens", "lm_head", "wte", "score")), ("attention", ("attn",)),
                   ("MLP", ("mlp",)))


def parameter_kind(name: str) -> str:
    return next((kind for kind, parts in PARAMETER_KINDS if any(part in name for part in parts)), "other")


def log_trainable(model: torch.nn.Module) -> None:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("trainable parameters: %d of %d (%.3f%%)", trainable, total, 100.0 * trainable / max(total, 1))
    if any(".experts." in name for name, _ in model.named_parameters()):
        kinds = dict.fromkeys(("attention", "experts", "shared experts", "router", "embeddings"), 0)
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                kind = parameter_kind(name)
                kinds[kind] = kinds.get(kind, 0) + parameter.numel()
        logger.info("trainable parameters by kind (mixture of experts): %s",
                    ", ".join(f"{kind} {count:,}" for kind, count in kinds.items()))
