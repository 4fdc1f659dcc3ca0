"""The one model loader (load_model) of every stage, every PPO role, the merged reward save,
inference and the demo: dtype, bitsandbytes k-bit quantization (QLoRA), attention
implementation, vocabulary resize with mean-initialised rows, a new, continued or folded-in peft
LoRA adapter, and DeepSpeed's communication set-up for ZeRO-3; the argument checks made before
any weight is loaded, the pad-token rule, and the reward model's pooled forward."""

import copy
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from typing import Optional

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BitsAndBytesConfig,
)
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.utils import ModelOutput

from lorakit.core.cli import InputError, read_json
from lorakit.core.model_files import check_adapter_fits_base, checkpoint_shapes
from lorakit.core.pair_segments import PAIR_CHOSEN, PAIR_REJECTED
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.models.chunked_loss import agreed_across_ranks, head_gives_logits, label_logprobs, token_logprobs
from lorakit.models.positions import last_position, positions_from_mask
from lorakit.models.zero3 import gathered
from lorakit.records.chat_templates import special_token_texts

logger = logging.getLogger(__name__)

DTYPES = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Resolved per model by lora_target_modules: Llama's q/k/v/o/gate/up/down, Phi-3's qkv_proj and
# gate_up_proj, GPT-2's c_attn/c_proj/c_fc, ... with no per-family name list to keep up to date.
ALL_LINEAR = "all-linear"
DEFAULT_LORA_TARGETS = ALL_LINEAR


def trust_remote_code_field():
    """--trust_remote_code, the same in every stage's arguments."""
    return field(
        default=False,
        metadata={"help": "Run the Python code a model directory ships (config.json auto_map) to build its config, "
                          "tokenizer and model. Only for directories you trust: that code runs with your rights."},
    )


@dataclass
class ModelArguments:
    """Which model to load and how to make it trainable (names follow Chinese-LLaMA-Alpaca-2;
    DeepSpeed-Chat's LoRA flags are mapped onto them)."""

    model_name_or_path: str = field(metadata={"help": "Base model directory (HF format, safetensors)."})
    tokenizer_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer directory, if not the model's (e.g. an extended vocabulary)."}
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of the loaded weights.", "choices": list(DTYPES)},
    )
    load_in_kbits: int = field(
        default=16,
        metadata={"help": "4 or 8: quantize the base with bitsandbytes (QLoRA); 16: no.", "choices": [4, 8, 16]},
    )
    quant_type: str = field(default="nf4", metadata={"help": "4-bit quantization type.", "choices": ["nf4", "fp4"]})
    double_quant: bool = field(default=True, metadata={"help": "Quantize the 4-bit quantization constants too."})
    attn_implementation: Optional[str] = field(
        default=None, metadata={"help": "eager, sdpa, flash_attention_2, ...; default: transformers' choice."}
    )
    trust_remote_code: bool = trust_remote_code_field()
    trainable: str = field(
        default=DEFAULT_LORA_TARGETS,
        metadata={"help": "LoRA target modules, comma list; all-linear: every linear layer of the decoder "
                          "(not the LM head or a score head)."},
    )
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha (scaling = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    modules_to_save: Optional[str] = field(
        default=None,
        metadata={"help": "Modules trained in full and saved with the adapter, "
                          "comma list (e.g. embed_tokens,lm_head)."},
    )
    new_embeddings_init: str = field(
        default="mean",
        metadata={"help": "How rows for tokens the base model lacks (an extended vocabulary) start: 'mean' = the mean "
                  "of all old rows; 'subword_mean' = the mean of the rows of the base tokenizer's pieces for that "
                  "token (starts each new token close to what the model already knows of its text).",
                  "choices": ["mean", "subword_mean"]},
    )
    peft_path: Optional[str] = field(default=None, metadata={"help": "An existing adapter to continue training."})
    full_finetuning: bool = field(default=False, metadata={"help": "Train every weight; no LoRA."})
    lora_dim: Optional[int] = field(
        default=None, metadata={"help": "DeepSpeed-Chat's LoRA rank: mapped to --lora_rank (0: --full_finetuning)."}
    )
    lora_module_name: Optional[str] = field(
        default=None,
        metadata={"help": "DeepSpeed-Chat's LoRA scope (a module path part, e.g. 'layers.'): the decoder layers' "
                          "scope is mapped to --trainable all-linear."},
    )

    def __post_init__(self):
        # Logging is not configured yet; the scripts report these notes with the Trainer's own.
        self.mapped_flags = []
        map_flags(self, DEEPSPEED_CHAT_MODEL_FLAGS, self.mapped_flags)


def lora_scope_targets(scope: str) -> str:
    """DeepSpeed-Chat's --lora_module_name puts LoRA on every linear layer whose module path contains
    it; its scripts pass the decoder layers ("decoder.layers." for OPT, "layers." for Llama), which is
    --trainable all-linear. Another scope has no counterpart in peft's target names."""
    if scope.strip(".").split(".")[-1] == "layers":
        return ALL_LINEAR
    raise InputError(f"--lora_module_name {scope}: only the decoder layers' scope ('layers.') maps to a set of LoRA "
                     "targets here; name the layers with --trainable (e.g. q_proj,v_proj, or all-linear)")


def lora_dim_flag(dim: int) -> tuple:
    """DeepSpeed-Chat's --lora_dim: the LoRA rank, or 0 for training every weight without LoRA."""
    if dim < 0:
        raise InputError(f"--lora_dim must be 0 (no LoRA) or a positive LoRA rank, got {dim}")
    if dim == 0:
        return "full_finetuning", True, "DeepSpeed-Chat's --lora_dim 0 trains every weight without LoRA"
    return "lora_rank", dim


# DeepSpeed-Chat's model flags (steps 1-3) -> (our flag, value[, why]); map_flags applies them.
DEEPSPEED_CHAT_MODEL_FLAGS = {
    "lora_dim": lora_dim_flag,
    "lora_module_name": lambda scope: ("trainable", lora_scope_targets(scope), "every linear layer of the decoder"),
}


def field_default(args, name: str):
    """The default of a dataclass field of args (None when it has none)."""
    for item in fields(args):
        if item.name == name:
            if item.default is not MISSING:
                return item.default
            return item.default_factory() if item.default_factory is not MISSING else None
    raise KeyError(name)


def flag_text(name: str, value) -> str:
    """A flag as a user types it: a bare --flag for a switched-on boolean, '' for an empty value."""
    return f"--{name}" if value is True else f"--{name} {value if value != '' else repr(value)}"


def map_flags(args, table: dict, notes: list) -> None:
    """The one way every script accepts another project's flag name (Chinese-LLaMA-Alpaca-2's,
    DeepSpeed-Chat's, transformers 4's): each flag of table that was given (its value is not its
    default) sets the flag and value table[flag](value) returns, with an optional reason, noted as
    "--old value -> --new value" for the 'flag mapped' log line. The old flag is reset to its
    default, so mapping again (a copy of the arguments) changes nothing. A different value given to
    the new flag as well, or set by another old flag, is refused."""
    set_by = {}
    for old, translate in table.items():
        given = getattr(args, old)
        if given == field_default(args, old):
            continue
        new, value, *why = translate(given)
        current = getattr(args, new)
        if current != value and (new in set_by or current != field_default(args, new)):
            other = set_by.get(new, flag_text(new, current))
            raise InputError(f"{flag_text(old, given)} and {other} both given: {flag_text(old, given)} means "
                             f"{flag_text(new, value)}; give only one" + (f" ({why[0]})" if why else ""))
        setattr(args, new, value)
        setattr(args, old, field_default(args, old))
        set_by[new] = flag_text(old, given)
        notes.append(f"{flag_text(old, given)} -> {flag_text(new, value)}" + (f" ({why[0]})" if why else ""))


def note_accepted_flags(args, table: dict, notes: list) -> None:
    """Flags other projects' scripts pass that need nothing here: each one given (not its default)
    is noted with table's reason why nothing changes."""
    for name, reason in table.items():
        value = getattr(args, name, None)
        if value is not None and value != field_default(args, name):
            notes.append(f"{flag_text(name, value)} accepted: {reason}")


def comma_list(value: Optional[str]) -> list:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


@functools.lru_cache(maxsize=None)
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


def load_tokenizer(model_args: ModelArguments):
    path = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if not os.path.isdir(path):
        raise InputError(f"{path}: tokenizer directory does not exist")
    if model_args.trust_remote_code:
        warn_remote_code(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        raise load_error(path, err, "cannot load a tokenizer from this directory") from None


def load_model_config(model_args: ModelArguments):
    path = model_args.model_name_or_path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(f"{path}: --model_name_or_path is not a model directory (no config.json)")
    if model_args.trust_remote_code:
        warn_remote_code(os.path.abspath(path))
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise load_error(f"{path}/config.json", err, "cannot read the model config") from None


def read_adapter_config(peft_path: str) -> dict:
    config_path = os.path.join(peft_path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise InputError(f"{peft_path}: --peft_path is not a LoRA adapter (no adapter_config.json)")
    try:
        with open(config_path, encoding="utf-8") as handle:
            return json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{config_path}: not valid JSON ({err})") from None


def check_model_inputs(model_args: ModelArguments, config, tokenizer, adapter_flag: str = "--peft_path") -> None:
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


def choose_pad_token(tokenizer, chat_template=None) -> int:
    """The one pad-token rule of every stage that pads (SFT, reward, PPO); returns the pad id. Our
    masks never compare ids with it, but saved models carry it, and transformers' own sequence
    classifiers score the last id that is not the pad id: padding with the token a row ends with
    (Llama-3 has no pad token, and its rows end with EOS = <|eot_id|>) would make such a model read
    one token early. The tokenizer's own pad token is kept unless a row may end with it (EOS, the
    template's turn end, BOS); otherwise unk, a special token named for padding, or another special
    token, in that order."""
    row_end_ids = []
    if chat_template is not None:  # a chat_templates.ChatTemplate
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


def init_deepspeed_distributed(training_args) -> None:
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


def embedding_rows(model) -> int:
    """Rows of the input embedding; a ZeRO-3 partitioned weight reports shape 0, ds_shape is real."""
    weight = model.get_input_embeddings().weight
    return weight.ds_shape[0] if hasattr(weight, "ds_shape") else weight.shape[0]


def resize_embeddings_with_mean(model, new_size: int, sources: Optional[dict] = None) -> None:
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
        with gathered([module.weight], modifier_rank=0), torch.no_grad():
            weight = module.weight
            weight[old_size:] = weight[:old_size].mean(dim=0, keepdim=True).to(weight.dtype)
            for new_id, old_ids in (sources or {}).items():
                weight[new_id] = weight[old_ids].mean(dim=0).to(weight.dtype)
    how = f"{len(sources)} from their pieces' rows, the rest" if sources else "new rows"
    logger.info("resized embeddings %d -> %d rows, %s = mean of the old ones", old_size, new_size, how)


def subword_sources(model_args: ModelArguments, tokenizer, old_size: int) -> dict:
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


def grow_embeddings(model, model_args: ModelArguments, tokenizer) -> None:
    """Rows for the tokens the base lacks, as --new_embeddings_init says; the one rule of every
    load (an adapter that saved its embed_tokens/lm_head then overwrites them with its own)."""
    if len(tokenizer) <= embedding_rows(model):
        return
    sources = None
    if model_args.new_embeddings_init == "subword_mean":
        sources = subword_sources(model_args, tokenizer, embedding_rows(model))
    resize_embeddings_with_mean(model, len(tokenizer), sources)


def quantization_config(model_args: ModelArguments, compute_dtype):
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


def uses_gpu(training_args) -> bool:
    return torch.cuda.is_available() and (training_args is None or not training_args.use_cpu)


def compute_dtype(model_args: ModelArguments, training_args=None):
    """The dtype a quantized model computes in, one rule for every load: --torch_dtype when it
    names one; else the precision the run computes in: the Trainer's --bf16 / --fp16 when
    training, bfloat16 on a GPU when generating (training_args None); float32 otherwise."""
    dtype = DTYPES[model_args.torch_dtype]
    if dtype != "auto":
        return dtype
    if training_args is None:
        return torch.bfloat16 if uses_gpu(None) else torch.float32
    if training_args.bf16:
        return torch.bfloat16
    return torch.float16 if training_args.fp16 else torch.float32


def load_model(model_args: ModelArguments, training_args, tokenizer, task: str = "causal_lm", config=None,
               trainable: bool = True, adapter_flag: str = "--peft_path", fold_adapter: bool = False):
    """THE model loader of every stage, PPO role, the merged reward save, inference and the demo:
    the base (task "causal_lm", or "reward": the checkpoint's sequence classifier with one output
    pooled at each row's last attended token), in --torch_dtype, quantized with --load_in_kbits,
    its embeddings grown to the tokenizer, then either made trainable (a new LoRA adapter, the
    --peft_path one continued, or --full_finetuning; QLoRA on a quantized base) or, trainable
    False, frozen with the --peft_path adapter folded in (kept as LoRA layers on a quantized base),
    built whole outside DeepSpeed's zero.Init since it never enters the engine. A frozen model of a
    training run computes in its precision (frozen_precision); a trainable one keeps what it
    trains in float32 (keep_trainable_float32).

    config: the model config the run read and checked (start_run, run_ppo.check_models); read and
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
    if quantized:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing(training_args))
        keep_4bit_layers_differentiable(model)
    if not model_args.full_finetuning:
        model = attach_lora(model, model_args, task, adapter_flag)
        keep_trainable_float32(model, training_args)
        if checkpointing(training_args):
            # Frozen embeddings give checkpointed blocks inputs without grad; this keeps LoRA's grads flowing.
            model.enable_input_require_grads()
    log_trainable(model)
    return model


def keep_4bit_layers_differentiable(model) -> None:
    """bitsandbytes (0.50) repacks a 4-bit layer's weights for its AVX512-BF16 CPU kernel at the first forward in
    eval mode without grad (PPO's generation, an evaluation) and keeps them so: the layer's matmul then has no
    backward, and every LoRA below it silently stops learning (a QLoRA PPO actor trained nothing). A model that
    trains keeps the layout that has one."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def check_load_plan(model_args: ModelArguments, training_args, config, tokenizer, task: str = "causal_lm",
                    trainable: bool = True, adapter_flag: str = "--peft_path", fold_adapter: bool = False) -> None:
    """Refuse now what load_model would refuse later with the same arguments, so that a run refuses
    before its data is tokenized and cached (start_run and run_ppo call it first): a quantized base
    under ZeRO-3, an adapter to fold into ZeRO-3 partitions, and whatever peft refuses (an adapter
    of other shapes, in any file format; a --trainable that names no module, or one LoRA cannot
    adapt), found by doing what load_model does on the model's empty skeleton (empty_model: no
    weight read or allocated; about a second for a 70B Llama). The real load follows unchanged."""
    check_quantization(model_args)
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


def check_foldable(path: str, flag: str) -> None:
    if is_deepspeed_zero3_enabled():
        raise InputError(f"{flag} {path} with a ZeRO-3 DeepSpeed config: the adapter cannot be folded into "
                         "partitioned weights; merge it first (scripts/merge) and pass the merged model")


def empty_model(model_args: ModelArguments, config, task: str, tokenizer):
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


def task_model_class(task: str, config):
    """The class a task loads: the causal LM; for "reward" the checkpoint's sequence classifier
    with one output (config.num_labels set to 1); for "answer_logps" the causal LM that returns its
    answer tokens' log-probabilities, its head run on answer positions only."""
    if task == "reward":
        config.num_labels = 1
        return reward_model_class(config)
    if task == "answer_logps":
        return answer_logps_model_class(config)
    return AutoModelForCausalLM


def checkpointing(training_args) -> bool:
    return training_args is not None and bool(training_args.activation_checkpointing)


# safetensors' names of the float dtypes a model is saved in.
SAFETENSORS_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def checkpoint_dtype(model_dir: str) -> torch.dtype:
    """The dtype a model directory's weights are stored in (what a model merged from it is saved
    in): the float dtype holding most of its safetensors weights, else config.json's dtype
    (torch_dtype before transformers 5), else float32."""
    elements = {}
    for dtype, shape in checkpoint_shapes(model_dir).values():
        if dtype in SAFETENSORS_FLOAT_DTYPES:
            elements[dtype] = elements.get(dtype, 0) + math.prod(shape)
    if elements:
        return SAFETENSORS_FLOAT_DTYPES[max(elements, key=elements.get)]
    config_path = os.path.join(model_dir, "config.json")
    config = read_json(config_path, "config.json") if os.path.isfile(config_path) else {}
    named = DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")))
    return named if isinstance(named, torch.dtype) else torch.float32


def frozen_precision(model_args: ModelArguments, training_args) -> ModelArguments:
    """A frozen model of a training run (PPO's reference and reward models) loads in the run's
    --bf16 / --fp16 precision whatever its checkpoint's dtype: it never trains, so a float32 copy
    buys nothing, while a float32 reward model (a merged one saved so) would take twice the memory
    and run float32 matmuls, which flash attention refuses."""
    if training_args is None or not (training_args.bf16 or training_args.fp16):
        return model_args
    return dataclasses.replace(model_args, torch_dtype="bfloat16" if training_args.bf16 else "float16")


HALF_DTYPES = (torch.float16, torch.bfloat16)


def keep_trainable_float32(model, training_args=None) -> None:
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


def cast_float(value, dtype):
    """value cast to dtype if it is a floating-point tensor; anything else as it is."""
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def inputs_in_float32(module, args, kwargs) -> tuple:
    """Forward pre-hook of a module keep_trainable_float32 upcast: its inputs in float32 too."""
    return (tuple(cast_float(item, torch.float32) for item in args),
            {key: cast_float(item, torch.float32) for key, item in kwargs.items()})


def output_in_dtype(dtype, module, args, output):
    """Forward hook of a module keep_trainable_float32 upcast: its output in the model's dtype."""
    if isinstance(output, tuple):
        return tuple(cast_float(item, dtype) for item in output)
    return cast_float(output, dtype)


def load_base(model_args: ModelArguments, training_args, tokenizer, task: str, config) -> tuple:
    """(the base model, whether it is quantized), its pad id the tokenizer's and its embeddings
    grown to the tokenizer."""
    check_quantization(model_args)
    init_deepspeed_distributed(training_args)
    quant = quantization_config(model_args, compute_dtype(model_args, training_args))
    # A copy: a run hands one config to several roles, and each load sets its own task on it.
    config = copy.deepcopy(config)
    load_kwargs = {"config": config, "dtype": DTYPES[model_args.torch_dtype],
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
    return model, quant is not None


@contextmanager
def outside_zero3_init():
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


def frozen(model, model_args: ModelArguments, quantized: bool, adapter_flag: str):
    """A model that is only run: the --peft_path adapter folded into the weights (one plain forward
    per pass), or on a quantized base left as LoRA layers inside the model (folding would round
    it into the quantized weights); no parameter trains, eval mode."""
    if model_args.peft_path:
        model = load_peft_adapter(model, model_args.peft_path, is_trainable=False, flag=adapter_flag)
        model = model.get_base_model() if quantized else model.merge_and_unload()
    model.requires_grad_(False)
    return model.eval()


def fold_in_adapter(model, path: str, flag: str):
    """The adapter at path merged into the loaded base's weights (in memory, nothing written)."""
    check_foldable(path, flag)
    logger.info("folding the adapter %s into the base in memory: a new LoRA trains on base + adapter", path)
    return load_peft_adapter(model, path, is_trainable=False, flag=flag).merge_and_unload()


def attach_lora(model, model_args: ModelArguments, task: str = "causal_lm", adapter_flag: str = "--peft_path",
                empty: bool = False):
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
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # A tied model keeps one matrix for embed_tokens and lm_head; training two separate copies
    # would untie them and change what the merged model means.
    ensure_tying = tied and bool(modules_to_save) and bool({"embed_tokens", "lm_head"} & set(modules_to_save))
    lora_config = LoraConfig(
        # SEQ_CLS also trains the score head in full and saves it with the adapter.
        task_type=TaskType.SEQ_CLS if task == "reward" else TaskType.CAUSAL_LM,
        target_modules=targets,
        r=model_args.lora_rank,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        modules_to_save=modules_to_save or None,
        ensure_weight_tying=ensure_tying,
    )
    try:
        return get_peft_model(model, lora_config, low_cpu_mem_usage=empty)
    except ValueError as err:
        raise InputError(f"--trainable {model_args.trainable}: {err}") from None


def lora_target_modules(model, trainable: str, modules_to_save: list) -> list:
    """--trainable as peft target names: the comma list as given, or for all-linear the names found
    in this model (attach_lora logs them). Resolved here rather than by peft so adapter_config.json
    lists the layers by name, and a reader of the log sees what is trained."""
    if trainable.strip() != ALL_LINEAR:
        return comma_list(trainable)
    return [name for name in linear_layer_names(model) if name not in modules_to_save]


def linear_layer_names(model) -> list:
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


def load_peft_adapter(model, path: str, is_trainable: bool, flag: str = "--peft_path", low_cpu_mem_usage=False):
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


def log_trainable(model) -> None:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("trainable parameters: %d of %d (%.3f%%)", trainable, total, 100.0 * trainable / max(total, 1))


# Attention implementations that take an arbitrary 4D mask (flash attention does not).
MASKABLE_ATTENTION = ("sdpa", "eager")


def pair_attention_mask(pair_segments, attn_implementation: str, dtype):
    """The 4D mask of shared-prefix pair rows: causal, except that the rejected answer does not
    see the chosen one, so it sees exactly the prefix and itself, as in a row of its own. Padding
    is at the end, where causality already hides it from real tokens. sdpa takes it as bool
    (True: attend), eager as an additive float mask."""
    width = pair_segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=pair_segments.device).tril()
    hidden_chosen = (pair_segments[:, :, None] == PAIR_REJECTED) & (pair_segments[:, None, :] == PAIR_CHOSEN)
    allowed = (causal[None] & ~hidden_chosen)[:, None]
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def mask_pooled_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                        labels=None, pair_segments=None, **kwargs):
    """One score per row, read at the row's last attended token: right for left and right padding
    and mixed lengths. transformers' own pooling takes the last id that is not the pad id, which
    is wrong when the pad token is EOS, as it often is. Positions come from the mask, so left
    padding does not shift them; the head runs on the pooled rows only.

    With pair_segments (rows of prefix + chosen answer + rejected answer, their position_ids
    given), one row scores a pair: the chosen scores of all rows, then the rejected ones."""
    if pair_segments is not None:
        mask = pair_attention_mask(pair_segments, self.config._attn_implementation,
                                   self.get_input_embeddings().weight.dtype)
        hidden = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        pooled = torch.cat([hidden[rows, last_position(pair_segments == PAIR_CHOSEN)],
                            hidden[rows, last_position(pair_segments == PAIR_REJECTED)]])
        return SequenceClassifierOutputWithPast(logits=self.score(pooled))
    if attention_mask is None:
        attention_mask = torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)
    if position_ids is None:
        position_ids = positions_from_mask(attention_mask)
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state
    pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_position(attention_mask)]
    return SequenceClassifierOutputWithPast(logits=self.score(pooled))


def reward_model_class(config):
    """The checkpoint's own sequence-classification class with mask_pooled_forward."""
    mapping = AutoModelForSequenceClassification._model_mapping
    if type(config) not in mapping:
        # A --trust_remote_code config class: its own code may have no classifier, nor the
        # .model/.score layout mask_pooled_forward reads.
        raise InputError(f"{getattr(config, '_name_or_path', '')}: the reward model needs an architecture "
                         f"transformers has a sequence classifier for; {type(config).__name__} has none here")
    base = mapping[type(config)]
    # Named as its base: save_pretrained writes the class name into config.json's architectures,
    # and a saved (merged) reward model must name a class transformers has.
    return type(base.__name__, (base,), {"forward": mask_pooled_forward, "__doc__": mask_pooled_forward.__doc__})


def score_sequences(model, input_ids, attention_mask):
    """Scores of a batch from a model loaded with task="reward" (one float per row)."""
    return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()


def score_pairs(model, batch: dict) -> tuple:
    """(chosen, rejected) scores of a DataCollatorForPreferencePairs batch, either layout."""
    inputs = {name: value for name, value in batch.items() if name != "margin"}
    return model(**inputs).logits.squeeze(-1).float().chunk(2)


@dataclass
class AnswerLogps(ModelOutput):
    """answer_logps_forward's output: the log-probability of each answer token, float32 [len(answer_index)]."""

    token_logps: Optional[torch.FloatTensor] = None


def head_alone_gives_logits(model, input_ids) -> bool:
    """Whether the output embeddings applied to the last hidden states give the model's own logits (no
    soft-capping or scaling after the head), checked on one row in eval mode (dropout, of a LoRA on the head
    say, would make the two differ). The model's own forward is called as a function, not through the module,
    so it can run inside answer_logps_forward (under ZeRO-3 only the submodules' gathering hooks run, as in
    any forward)."""
    forward = super(type(model), model).forward
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(forward).parameters else {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = forward(input_ids=input_ids[:1], use_cache=False, output_hidden_states=True, **keep)
            return head_gives_logits(model.get_output_embeddings(), outputs)
    finally:
        model.train(was_training)


def answer_logps_forward(self, input_ids=None, attention_mask=None, position_ids=None, pair_segments=None,
                         answer_index=None, answer_targets=None, **kwargs):
    """With answer_index (flat indices into the batch's [rows * width] positions) and answer_targets (the
    token each of those positions predicts): AnswerLogps, each answer token's log-probability. The LM head
    runs on those positions only, in chunks of positions recomputed in backward (self.chunked_loss,
    chunked_loss.token_logprobs): no vocabulary-wide work on prompt or padding positions, no float32
    [answer tokens, vocabulary] tensor kept. A model that changes its logits after the head (Gemma-2's
    soft-capping; found on the first call) gets its own full forward instead. pair_segments: shared-prefix
    pair rows with their position ids, masked as the reward model masks them. Without answer_index, the
    model's own forward."""
    own_forward = super(type(self), self).forward
    if answer_index is None:
        return own_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    if self.answer_head_exact is None:
        self.answer_head_exact = agreed_across_ranks(head_alone_gives_logits(self, input_ids),
                                                     self.get_output_embeddings(), input_ids.device)
        if not self.answer_head_exact:
            logger.info("answer log-probs from the model's full logits: its forward changes the logits after "
                        "the output embeddings")
    if pair_segments is not None:
        attention_mask = pair_attention_mask(pair_segments, self.config._attn_implementation,
                                             self.get_input_embeddings().weight.dtype)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": False}
    if not self.answer_head_exact:
        return AnswerLogps(label_logprobs(own_forward(**inputs).logits.flatten(0, 1)[answer_index], answer_targets))
    hidden = self.base_model(**inputs).last_hidden_state.flatten(0, 1)[answer_index]
    head = self.get_output_embeddings()
    if self.chunked_loss:
        return AnswerLogps(token_logprobs(hidden, head, answer_targets))
    return AnswerLogps(label_logprobs(head(hidden), answer_targets))


def answer_logps_model_class(config):
    """The checkpoint's own causal-LM class with answer_logps_forward, named as its base so a saved config
    names a class transformers has. chunked_loss: set from --chunked_loss by the stage; answer_head_exact:
    decided on the first call with answers."""
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise InputError(f"{getattr(config, '_name_or_path', '')}: DPO needs an architecture transformers has a "
                         f"causal LM for; {type(config).__name__} has none here")
    base = mapping[type(config)]
    return type(base.__name__, (base,), {"forward": answer_logps_forward, "__doc__": answer_logps_forward.__doc__,
                                         "chunked_loss": True, "answer_head_exact": None})
