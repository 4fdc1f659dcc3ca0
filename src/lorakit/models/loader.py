"""The one model loader (load_model) of every stage, every PPO role, the merged reward save,
inference and the demo: dtype, bitsandbytes k-bit quantization (QLoRA), attention
implementation, vocabulary resize with mean-initialised rows, the LoRA adapter (models.adapters) or the task head
(models.heads) on top, and DeepSpeed's communication set-up for ZeRO-3; the argument checks made before
any weight is loaded, and the pad-token rule. The flags are models.arguments'."""

import copy
import dataclasses
import functools
import json
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.integrations import is_deepspeed_zero3_enabled

from lorakit.core.cli import InputError, read_json
from lorakit.core.model_files import check_adapter_fits_base, checkpoint_shapes
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.models.adapters import (
    attach_lora,
    check_foldable,
    fold_in_adapter,
    frozen,
    load_peft_adapter,
    log_trainable,
)
from lorakit.models.arguments import DTYPES, ModelArguments, comma_list
from lorakit.models.heads import answer_logps_model_class, reward_model_class
from lorakit.models.zero3 import gathered, weight_of
from lorakit.records.chat_templates import special_token_texts

if TYPE_CHECKING:  # peft, transformers' model classes and the Trainer's arguments load where they are used
    from bitsandbytes.nn import Linear4bit
    from peft import PeftModel
    from transformers import PreTrainedModel, TrainingArguments

    from lorakit.records.chat_templates import ChatTemplate

logger = logging.getLogger(__name__)


@functools.cache
def warn_remote_code(path: str) -> None:
    """One warning per directory (cached): a run loads the same directory's config and tokenizer several times."""
    logger.warning("--trust_remote_code: running the model's own code from %s", path)


def load_error(path: str, err: Exception, failure: str) -> InputError:
    """One line for a failed load; transformers' refusal of a directory's own code gives advice about its
    Python argument, so name our flag instead."""
    if "trust_remote_code" in str(err):
        return InputError(f"{path}: {failure}: it needs its own Python code (auto_map); if you trust that "
                          "directory, rerun with --trust_remote_code")
    return InputError(f"{path}: {failure} ({err})")


def load_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase:
    path = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if not os.path.isdir(path):
        raise InputError(f"{path}: tokenizer directory does not exist")
    if model_args.trust_remote_code:
        warn_remote_code(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        raise load_error(path, err, "cannot load a tokenizer from this directory") from None


def load_model_config(model_args: ModelArguments) -> PreTrainedConfig:
    path = model_args.model_name_or_path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(f"{path}: --model_name_or_path is not a model directory (no config.json)")
    if model_args.trust_remote_code:
        warn_remote_code(os.path.abspath(path))
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise load_error(f"{path}/config.json", err, "cannot read the model config") from None


def read_adapter_config(peft_path: str) -> dict[str, Any]:
    config_path = os.path.join(peft_path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise InputError(f"{peft_path}: --peft_path is not a LoRA adapter (no adapter_config.json)")
    try:
        with open(config_path, encoding="utf-8") as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{config_path}: not valid JSON ({err})") from None


def check_model_inputs(model_args: ModelArguments, config: PreTrainedConfig, tokenizer: PreTrainedTokenizerBase,
                       adapter_flag: str = "--peft_path") -> None:
    """Refuse, before any weight is loaded, combinations that would train silently wrong."""
    if model_args.full_finetuning and model_args.load_in_kbits in (4, 8):
        raise InputError("--full_finetuning cannot train a --load_in_kbits quantized model; use LoRA (QLoRA)")
    if os.path.isdir(model_args.model_name_or_path or ""):
        checkpoint_shapes(model_args.model_name_or_path)  # a truncated or damaged weights file is refused here
    if model_args.peft_path:
        adapter = read_adapter_config(model_args.peft_path)
        check_adapter_fits_base(model_args.peft_path, model_args.model_name_or_path, adapter_flag)
        saved_to = adapter.get("modules_to_save") or []
    else:
        saved_to = comma_list(model_args.modules_to_save)
    rows = getattr(config, "vocab_size", None)
    if rows is not None and len(tokenizer) > rows and not model_args.full_finetuning:
        tied = getattr(config, "tie_word_embeddings", False)
        needed = ["embed_tokens"] if tied else ["embed_tokens", "lm_head"]
        missing = [name for name in needed if name not in saved_to]
        if missing:
            raise InputError(
                f"tokenizer has {len(tokenizer)} tokens but the model's embeddings have {rows} rows: "
                f"the new rows would never be trained; add --modules_to_save {','.join(needed)} "
                "(or use --full_finetuning)"
            )


def choose_pad_token(tokenizer: PreTrainedTokenizerBase, chat_template: "ChatTemplate | None" = None) -> int:
    """The one pad-token rule of every stage that pads (SFT, reward, PPO); returns the pad id. Our
    masks never compare ids with it, but saved models carry it, and transformers' own sequence
    classifiers score the last id that is not the pad id: padding with the token a row ends with
    (Llama-3 has no pad token, and its rows end with EOS = <|eot_id|>) would make such a model read
    one token early. The tokenizer's own pad token is kept unless a row may end with it (EOS, the
    template's turn end, BOS); otherwise unk, a special token named for padding, or another special
    token, in that order."""
    row_end_ids = []
    if chat_template is not None:
        rows = ConversationTokenizer(tokenizer, chat_template.text, 1 << 30, template_kwargs=chat_template.kwargs)
        row_end_ids = [rows.answer_end_id()] + rows.after_turn_end_ids()
    avoid = {*row_end_ids, tokenizer.eos_token_id, tokenizer.bos_token_id}
    if tokenizer.pad_token is not None and tokenizer.pad_token_id not in avoid:
        return tokenizer.pad_token_id
    specials = special_token_texts(tokenizer)
    candidates = [tokenizer.unk_token] + [t for t in specials if "pad" in t.lower()] + specials
    pad = next((t for t in candidates if t and tokenizer.convert_tokens_to_ids(t) not in avoid), tokenizer.eos_token)
    logger.info("pad token: %r (rows end with %r)", pad,
                tokenizer.convert_ids_to_tokens(row_end_ids or [tokenizer.eos_token_id]))
    tokenizer.pad_token = pad
    return tokenizer.pad_token_id


def init_deepspeed_distributed(training_args: "TrainingArguments | None") -> None:
    """Initialise DeepSpeed's own communication layer before the model is built.

    With ZeRO-3, from_pretrained builds the model under deepspeed.zero.Init, which reads the
    world size from DeepSpeed's comm layer. On GPU accelerate initialises it; on CPU nothing
    does, so zero.Init sees one process and the batch-size check fails. Initialising it here,
    over the process group torchrun set up, fixes that on every device."""
    if training_args is None or not training_args.deepspeed:
        return
    import deepspeed

    use_gpu = torch.cuda.is_available() and not training_args.use_cpu
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo")


def embedding_rows(model: "PreTrainedModel") -> int:
    """Rows of the input embedding; a ZeRO-3 partitioned weight reports shape 0, ds_shape is real."""
    weight = weight_of(model.get_input_embeddings())
    return weight.ds_shape[0] if hasattr(weight, "ds_shape") else weight.shape[0]


def resize_embeddings_with_mean(model: "PreTrainedModel", new_size: int,
                                sources: dict[int, list[int]] | None = None) -> None:
    """Grow the vocabulary; new rows start at the mean of the old ones, so new tokens begin as
    an 'average' token instead of random noise that would swamp the first steps. With sources
    ({new id: [old ids]}), a new row starts at the mean of those old rows instead (its pieces)."""
    old_size = embedding_rows(model)
    model.resize_token_embeddings(new_size, mean_resizing=False)
    embeddings = [model.get_input_embeddings()]
    output = model.get_output_embeddings()
    if output is not None and output.weight is not embeddings[0].weight:
        embeddings.append(output)
    for module in embeddings:
        with gathered([weight_of(module)], modifier_rank=0), torch.no_grad():
            weight = weight_of(module)
            weight[old_size:] = weight[:old_size].mean(dim=0, keepdim=True).to(weight.dtype)
            for new_id, old_ids in (sources or {}).items():
                weight[new_id] = weight[old_ids].mean(dim=0).to(weight.dtype)
    how = f"{len(sources)} from their pieces' rows, the rest" if sources else "new rows"
    logger.info("resized embeddings %d -> %d rows, %s = mean of the old ones", old_size, new_size, how)


def subword_sources(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase,
                    old_size: int) -> dict[int, list[int]]:
    """{new id: old ids}: each new token's text as the base model's own tokenizer segments it.
    The token's stored string goes through the base tokenizer's model (BPE/unigram) directly, so
    byte-level and SentencePiece-style tokens are split in their own alphabet, with no decoding."""
    base = load_tokenizer(ModelArguments(model_name_or_path=model_args.model_name_or_path,
                                         trust_remote_code=model_args.trust_remote_code))
    segmenter = base.backend_tokenizer.model
    sources = {}
    for new_id in range(old_size, len(tokenizer)):
        piece = tokenizer.convert_ids_to_tokens(new_id)
        old_ids = [token.id for token in segmenter.tokenize(piece) if token.id < old_size] if piece else []
        if old_ids:
            sources[new_id] = old_ids
    return sources


def grow_embeddings(model: "PreTrainedModel", model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> None:
    """Rows for the tokens the base lacks, as --new_embeddings_init says; the one rule of every
    load (an adapter that saved its embed_tokens/lm_head then overwrites them with its own)."""
    if len(tokenizer) <= embedding_rows(model):
        return
    sources = None
    if model_args.new_embeddings_init == "subword_mean":
        sources = subword_sources(model_args, tokenizer, embedding_rows(model))
    resize_embeddings_with_mean(model, len(tokenizer), sources)


def quantization_config(model_args: ModelArguments, compute_dtype: torch.dtype) -> BitsAndBytesConfig | None:
    if model_args.load_in_kbits == 4:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=model_args.quant_type,
            bnb_4bit_use_double_quant=model_args.double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    if model_args.load_in_kbits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def uses_gpu(training_args: "TrainingArguments | None") -> bool:
    return torch.cuda.is_available() and (training_args is None or not training_args.use_cpu)


def compute_dtype(model_args: ModelArguments, training_args: "TrainingArguments | None" = None) -> torch.dtype:
    """The dtype a quantized model computes in, one rule for every load: --torch_dtype when it
    names one; else the precision the run computes in: the Trainer's --bf16 / --fp16 when
    training, bfloat16 on a GPU when generating (training_args None); float32 otherwise."""
    dtype = DTYPES[model_args.torch_dtype]
    if isinstance(dtype, torch.dtype):  # the one other value is "auto"
        return dtype
    if training_args is None:
        return torch.bfloat16 if uses_gpu(None) else torch.float32
    if training_args.bf16:
        return torch.bfloat16
    return torch.float16 if training_args.fp16 else torch.float32


def load_model(model_args: ModelArguments, training_args: "TrainingArguments | None",
               tokenizer: PreTrainedTokenizerBase | None, task: str = "causal_lm",
               config: PreTrainedConfig | None = None, trainable: bool = True, adapter_flag: str = "--peft_path",
               fold_adapter: bool = False) -> "PreTrainedModel | PeftModel":
    """THE model loader of every stage, PPO role, the merged reward save, inference and the demo:
    the base (task "causal_lm", or "reward": the checkpoint's sequence classifier with one output
    pooled at each row's last attended token), in --torch_dtype, quantized with --load_in_kbits,
    its embeddings grown to the tokenizer, then either made trainable (a new LoRA adapter, the
    --peft_path one continued, or --full_finetuning; QLoRA on a quantized base) or, trainable
    False, frozen with the --peft_path adapter folded in (kept as LoRA layers on a quantized base),
    built whole outside DeepSpeed's zero.Init since it never enters the engine. A frozen model of a
    training run computes in its precision (frozen_precision); a trainable one keeps what it
    trains in float32 (keep_trainable_float32).

    config: the model config the run read and checked (trainers.common.start_run, rl.ppo_checks.check_models); read and
    checked here when None. training_args: the Trainer's (precision, device, DeepSpeed, activation
    checkpointing); None when generating. fold_adapter: the --peft_path adapter is folded into the
    base in memory and a new LoRA trained on top (DPO: the reference is base + that adapter)."""
    if config is None:
        config = load_model_config(model_args)
        if tokenizer is not None:
            check_model_inputs(model_args, config, tokenizer)
    if not trainable:
        model_args = frozen_precision(model_args, training_args)
        with outside_zero3_init():
            model, quantized = load_base(model_args, training_args, tokenizer, task, config)
            return frozen(model, model_args, quantized, adapter_flag)
    model, quantized = load_base(model_args, training_args, tokenizer, task, config)
    if fold_adapter and model_args.peft_path:
        model = fold_in_adapter(model, model_args.peft_path, adapter_flag)
        model_args = dataclasses.replace(model_args, peft_path=None)
    trained = made_trainable(model, quantized, model_args, training_args, task, adapter_flag)
    log_trainable(trained)
    return trained


def made_trainable(model: "PreTrainedModel", quantized: bool, model_args: ModelArguments,
                   training_args: "TrainingArguments | None", task: str,
                   adapter_flag: str) -> "PreTrainedModel | PeftModel":
    """load_model's trainable model: a quantized base prepared for k-bit training, then a LoRA adapter on it (the
    base itself under --full_finetuning)."""
    if quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing(training_args))
        keep_4bit_layers_differentiable(model)
    if model_args.full_finetuning:
        return model
    peft_model = attach_lora(model, model_args, task, adapter_flag)
    keep_trainable_float32(peft_model, training_args)
    if checkpointing(training_args):
        # Frozen embeddings give checkpointed blocks inputs without grad; this keeps LoRA's grads flowing.
        peft_model.enable_input_require_grads()
    return peft_model


def keep_4bit_layers_differentiable(model: torch.nn.Module) -> None:
    """bitsandbytes (0.50) repacks a 4-bit layer's weights for its AVX512-BF16 CPU kernel at the first forward in
    eval mode without grad (PPO's generation, an evaluation) and keeps them so: the layer's matmul then has no
    backward, and every LoRA below it silently stops learning (a QLoRA PPO actor trained nothing). A model that
    trains keeps the layout that has one."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            # Only bitsandbytes' Linear4bit has it; typed as one, its attribute is a bool (nn.Module's own typing
            # takes an attribute set on a module to be a Tensor or a Module).
            cast("Linear4bit", module).support_avx512bf16_for_cpu = False


def check_load_plan(model_args: ModelArguments, training_args: "TrainingArguments | None", config: PreTrainedConfig,
                    tokenizer: PreTrainedTokenizerBase | None, task: str = "causal_lm", trainable: bool = True,
                    adapter_flag: str = "--peft_path", fold_adapter: bool = False) -> None:
    """Refuse now what load_model would refuse later with the same arguments, so that a run refuses
    before its data is tokenized and cached (trainers.common.start_run and the RL commands call it
    first): a quantized base under ZeRO-3, an adapter to fold into ZeRO-3 partitions, and whatever peft
    refuses (an adapter of other shapes, in any file format; a --trainable that names no module, or one
    LoRA cannot adapt), found by doing what load_model does on the model's empty skeleton (empty_model: no
    weight read or allocated; about a second for a 70B Llama). The real load follows unchanged."""
    check_quantization(model_args)
    prepare_attention(model_args, training_args)
    if fold_adapter and model_args.peft_path:
        check_foldable(model_args.peft_path, adapter_flag)
    if model_args.peft_path and (fold_adapter or not trainable):
        # A frozen model keeps the adapter, a folded one has the base's shapes again for a new LoRA.
        load_peft_adapter(empty_model(model_args, config, task, tokenizer), model_args.peft_path, is_trainable=False,
                          flag=adapter_flag, low_cpu_mem_usage=True)
        model_args = dataclasses.replace(model_args, peft_path=None)
    if trainable and not model_args.full_finetuning:
        attach_lora(empty_model(model_args, config, task, tokenizer), model_args, task, adapter_flag, empty=True)


def check_quantization(model_args: ModelArguments) -> None:
    if model_args.load_in_kbits in (4, 8) and is_deepspeed_zero3_enabled():
        raise InputError("--load_in_kbits 4/8 cannot be combined with a ZeRO-3 DeepSpeed config; use ZeRO-2")


def prepare_attention(model_args: ModelArguments, training_args: "TrainingArguments | None") -> None:
    """--attn_implementation torch_varlen is ours (models.varlen_attention): registered with transformers before
    from_pretrained reads the name, or refused where this torch cannot run it. Imported only when asked: it loads the
    training data layer, which serving does without. flex_attention trains on a GPU only: torch's CPU flex attention
    runs forward but has no backward (refused here, not at the first step)."""
    if model_args.attn_implementation == "flex_attention" and training_args is not None and not uses_gpu(
            training_args):
        raise InputError("--attn_implementation flex_attention trains on a CUDA GPU only (torch's flex attention "
                         "has no backward on a CPU); use sdpa on this machine")
    if model_args.attn_implementation == "torch_varlen":
        from lorakit.models.varlen_attention import use_torch_varlen

        half = training_args is not None and (training_args.bf16 or training_args.fp16)
        use_torch_varlen(uses_gpu(training_args), float32_only=model_args.torch_dtype == "float32" and not half)


def empty_model(model_args: ModelArguments, config: PreTrainedConfig, task: str,
                tokenizer: PreTrainedTokenizerBase | None) -> "PreTrainedModel":
    """The model load_base builds, as an empty skeleton (accelerate's init_empty_weights): every
    module, each parameter on the meta device, the embeddings grown to the tokenizer."""
    from accelerate import init_empty_weights

    config = copy.deepcopy(config)
    model_class = task_model_class(task, config)
    with outside_zero3_init(), init_empty_weights():
        if model_class is AutoModelForCausalLM:
            model = model_class.from_config(config, trust_remote_code=model_args.trust_remote_code)
        else:
            model = model_class(config)
        if tokenizer is not None and len(tokenizer) > embedding_rows(model):
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    return model


def task_model_class(task: str, config: PreTrainedConfig) -> "type[PreTrainedModel] | type[AutoModelForCausalLM]":
    """The class a task loads: the causal LM; for "reward" the checkpoint's sequence classifier
    with one output (config.num_labels set to 1); for "answer_logps" the causal LM that returns its
    answer tokens' log-probabilities, its head run on answer positions only."""
    if task == "reward":
        config.num_labels = 1
        return reward_model_class(config)
    if task == "answer_logps":
        return answer_logps_model_class(config)
    return AutoModelForCausalLM


def checkpointing(training_args: "TrainingArguments | None") -> bool:
    return training_args is not None and bool(training_args.activation_checkpointing)


# safetensors' names of the float dtypes a model is saved in.
SAFETENSORS_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def checkpoint_dtype(model_dir: str) -> torch.dtype:
    """The dtype a model directory's weights are stored in (what a model merged from it is saved
    in): the float dtype holding most of its safetensors weights, else config.json's dtype
    (torch_dtype before transformers 5), else float32."""
    elements: dict[str, int] = {}
    for dtype, shape in checkpoint_shapes(model_dir).values():
        if dtype in SAFETENSORS_FLOAT_DTYPES:
            elements[dtype] = elements.get(dtype, 0) + math.prod(shape)
    if elements:
        return SAFETENSORS_FLOAT_DTYPES[max(elements, key=elements.__getitem__)]
    config_path = os.path.join(model_dir, "config.json")
    config = read_json(config_path, "config.json") if os.path.isfile(config_path) else {}
    named = DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))
    return named if isinstance(named, torch.dtype) else torch.float32


def frozen_precision(model_args: ModelArguments, training_args: "TrainingArguments | None") -> ModelArguments:
    """A frozen model of a training run (PPO's reference and reward models) loads in the run's
    --bf16 / --fp16 precision whatever its checkpoint's dtype: it never trains, so a float32 copy
    buys nothing, while a float32 reward model (a merged one saved so) would take twice the memory
    and run float32 matmuls, which flash attention refuses."""
    if training_args is None or not (training_args.bf16 or training_args.fp16):
        return model_args
    return dataclasses.replace(model_args, torch_dtype="bfloat16" if training_args.bf16 else "float16")


HALF_DTYPES = (torch.float16, torch.bfloat16)


def keep_trainable_float32(model: torch.nn.Module, training_args: "TrainingArguments | None" = None) -> None:
    """The trainable parameters of a half-precision model in float32, as peft keeps LoRA weights
    (its autocast_adapter_dtype covers the LoRA layers only, not the --modules_to_save copies nor
    PPO's value head): in bfloat16 an update below 1/256 of a weight rounds away, and float16
    weights cannot go under --fp16's grad scaler. Each module holding one computes in float32 and
    hands on the dtype its weights had, so it fits between the half-precision layers with or
    without autocast. Under DeepSpeed the engine keeps float32 master weights itself."""
    if training_args is not None and training_args.deepspeed:
        return
    # Modules first, then the cast: a tied copy (lm_head sharing embed_tokens' weight) needs its hooks too.
    half_modules = []
    for module in model.modules():
        dtypes = {p.dtype for p in module.parameters(recurse=False) if p.requires_grad and p.dtype in HALF_DTYPES}
        if dtypes:
            half_modules.append((module, dtypes.pop()))
    for module, dtype in half_modules:
        for parameter in module.parameters(recurse=False):
            if parameter.requires_grad and parameter.dtype in HALF_DTYPES:
                parameter.data = parameter.data.float()
        module.register_forward_pre_hook(inputs_in_float32, with_kwargs=True)
        module.register_forward_hook(functools.partial(output_in_dtype, dtype))
    if half_modules:
        logger.info("trainable parameters of %d half-precision module(s) kept in float32", len(half_modules))


def cast_float(value: Any, dtype: torch.dtype) -> Any:
    """value cast to dtype if it is a floating-point tensor; anything else as it is."""
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def inputs_in_float32(module: torch.nn.Module, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of a module keep_trainable_float32 upcast: its inputs in float32 too."""
    return (tuple(cast_float(item, torch.float32) for item in args),
            {key: cast_float(item, torch.float32) for key, item in kwargs.items()})


def output_in_dtype(dtype: torch.dtype, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """Forward hook of a module keep_trainable_float32 upcast: its output in the model's dtype."""
    if isinstance(output, tuple):
        return tuple(cast_float(item, dtype) for item in output)
    return cast_float(output, dtype)


class LoadedBase(NamedTuple):
    """load_base's model, and whether its weights are bitsandbytes-quantized (--load_in_kbits 4/8)."""

    model: "PreTrainedModel"
    quantized: bool


def load_base(model_args: ModelArguments, training_args: "TrainingArguments | None",
              tokenizer: PreTrainedTokenizerBase | None, task: str, config: PreTrainedConfig) -> LoadedBase:
    """LoadedBase (the base model, whether it is quantized), its pad id the tokenizer's and its embeddings
    grown to the tokenizer."""
    check_quantization(model_args)
    prepare_attention(model_args, training_args)
    init_deepspeed_distributed(training_args)
    quant = quantization_config(model_args, compute_dtype(model_args, training_args))
    # A copy: a run hands one config to several roles, and each load sets its own task on it.
    config = copy.deepcopy(config)
    load_kwargs: dict[str, Any] = {"config": config, "dtype": DTYPES[model_args.torch_dtype],
                                   "trust_remote_code": model_args.trust_remote_code}
    if model_args.attn_implementation:
        load_kwargs["attn_implementation"] = model_args.attn_implementation
    if quant is not None:
        load_kwargs["quantization_config"] = quant
        if uses_gpu(training_args):
            # Quantized weights must land on this rank's own GPU, not all on GPU 0.
            load_kwargs["device_map"] = {"": training_args.local_process_index if training_args else 0}
    model = task_model_class(task, config).from_pretrained(model_args.model_name_or_path, **load_kwargs)
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if tokenizer is not None:
        grow_embeddings(model, model_args, tokenizer)
    return LoadedBase(model, quant is not None)


@contextmanager
def outside_zero3_init() -> Iterator[None]:
    """Build a model whole on every rank, outside DeepSpeed's zero.Init: a model that never enters
    the engine (a frozen PPO role, the merged reward save) would find nothing to gather its
    partitioned weights; a PPO critic is merged first and partitioned by the engine afterwards."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


