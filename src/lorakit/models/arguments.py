"""The model flags every stage shares (ModelArguments), and how the names that Chinese-LLaMA-Alpaca-2's and
DeepSpeed-Chat's scripts pass map onto them."""

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lorakit.core.cli import InputError

if TYPE_CHECKING:  # typeshed's protocol of a dataclass instance
    from _typeshed import DataclassInstance

DTYPES = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# Resolved per model by lora_target_modules: Llama's q/k/v/o/gate/up/down, Phi-3's qkv_proj and
# gate_up_proj, GPT-2's c_attn/c_proj/c_fc, ... with no per-family name list to keep up to date.
ALL_LINEAR = "all-linear"


DEFAULT_LORA_TARGETS = ALL_LINEAR


def trust_remote_code_field() -> bool:
    """--trust_remote_code, the same in every stage's arguments (typed as its value, as dataclasses.field is)."""
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
    tokenizer_name_or_path: str | None = field(
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
    attn_implementation: str | None = field(
        default=None, metadata={"help": "eager, sdpa, flash_attention_2, flex_attention, torch_varlen (torch's varlen "
                                        "attention for --packing on a CUDA GPU), ...; default: transformers' "
                                        "choice."}
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
    lora_experts: str = field(
        default="auto",
        metadata={"help": "A mixture-of-experts model's fused expert weights (transformers 5's experts.gate_up_proj, "
                          "experts.down_proj: no nn.Linear, so --trainable never names them): auto trains them with "
                          "--trainable all-linear and refuses a --trainable list that would leave them frozen; yes "
                          "trains them with any --trainable; no leaves them frozen. Their adapter takes no dropout.",
                  "choices": ["auto", "yes", "no"]},
    )
    modules_to_save: str | None = field(
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
    peft_path: str | None = field(default=None, metadata={"help": "An existing adapter to continue training."})
    full_finetuning: bool = field(default=False, metadata={"help": "Train every weight; no LoRA."})
    lora_dim: int | None = field(
        default=None, metadata={"help": "DeepSpeed-Chat's LoRA rank: mapped to --lora_rank (0: --full_finetuning)."}
    )
    lora_module_name: str | None = field(
        default=None,
        metadata={"help": "DeepSpeed-Chat's LoRA scope (a module path part, e.g. 'layers.'): the decoder layers' "
                          "scope is mapped to --trainable all-linear."},
    )

    def __post_init__(self) -> None:
        # Logging is not configured yet; the scripts report these notes with the Trainer's own.
        self.mapped_flags: list[str] = []
        map_flags(self, DEEPSPEED_CHAT_MODEL_FLAGS, self.mapped_flags)


def lora_scope_targets(scope: str) -> str:
    """DeepSpeed-Chat's --lora_module_name puts LoRA on every linear layer whose module path contains
    it; its scripts pass the decoder layers ("decoder.layers." for OPT, "layers." for Llama), which is
    --trainable all-linear. Another scope has no counterpart in peft's target names."""
    if scope.strip(".").split(".")[-1] == "layers":
        return ALL_LINEAR
    raise InputError(f"--lora_module_name {scope}: only the decoder layers' scope ('layers.') maps to a set of LoRA "
                     "targets here; name the layers with --trainable (e.g. q_proj,v_proj, or all-linear)")


class MappedFlag(NamedTuple):
    """What another project's flag means here: our flag, its value, and why (None where the mapping says it all)."""

    flag: str
    value: Any
    why: str | None = None


# A flag table: another project's flag name -> its value translated to a MappedFlag.
FlagTable = dict[str, Callable[[Any], MappedFlag]]


def lora_dim_flag(dim: int) -> MappedFlag:
    """DeepSpeed-Chat's --lora_dim: the LoRA rank, or 0 for training every weight without LoRA."""
    if dim < 0:
        raise InputError(f"--lora_dim must be 0 (no LoRA) or a positive LoRA rank, got {dim}")
    if dim == 0:
        return MappedFlag("full_finetuning", True, "DeepSpeed-Chat's --lora_dim 0 trains every weight without LoRA")
    return MappedFlag("lora_rank", dim)


# DeepSpeed-Chat's model flags (steps 1-3) -> what each means here; map_flags applies them.
DEEPSPEED_CHAT_MODEL_FLAGS: FlagTable = {
    "lora_dim": lora_dim_flag,
    "lora_module_name": lambda scope: MappedFlag("trainable", lora_scope_targets(scope),
                                                 "every linear layer of the decoder"),
}


def field_default(args: "DataclassInstance", name: str) -> Any:
    """The default of a dataclass field of args (None when it has none)."""
    for item in fields(args):
        if item.name == name:
            if item.default is not MISSING:
                return item.default
            return item.default_factory() if item.default_factory is not MISSING else None
    raise KeyError(name)


def flag_text(name: str, value: Any) -> str:
    """A flag as a user types it: a bare --flag for a switched-on boolean, '' for an empty value."""
    return f"--{name}" if value is True else f"--{name} {value if value != '' else repr(value)}"


def map_flags(args: "DataclassInstance", table: FlagTable, notes: list[str]) -> None:
    """The one way every script accepts another project's flag name (Chinese-LLaMA-Alpaca-2's,
    DeepSpeed-Chat's, transformers 4's): each flag of table that was given (its value is not its
    default) sets the flag and value table[flag](value) returns, with an optional reason, noted as
    "--old value -> --new value" for the 'flag mapped' log line. The old flag is reset to its
    default, so mapping again (a copy of the arguments) changes nothing. A different value given to
    the new flag as well, or set by another old flag, is refused."""
    set_by: dict[str, str] = {}
    for old, translate in table.items():
        given = getattr(args, old)
        if given == field_default(args, old):
            continue
        new, value, reason = translate(given)
        why = f" ({reason})" if reason is not None else ""
        current = getattr(args, new)
        if current != value and (new in set_by or current != field_default(args, new)):
            other = set_by.get(new, flag_text(new, current))
            raise InputError(f"{flag_text(old, given)} and {other} both given: {flag_text(old, given)} means "
                             f"{flag_text(new, value)}; give only one" + why)
        setattr(args, new, value)
        setattr(args, old, field_default(args, old))
        set_by[new] = flag_text(old, given)
        notes.append(f"{flag_text(old, given)} -> {flag_text(new, value)}" + why)


def note_accepted_flags(args: "DataclassInstance", table: dict[str, str], notes: list[str]) -> None:
    """Flags other projects' scripts pass that need nothing here: each one given (not its default)
    is noted with table's reason why nothing changes."""
    for name, reason in table.items():
        value = getattr(args, name, None)
        if value is not None and value != field_default(args, name):
            notes.append(f"{flag_text(name, value)} accepted: {reason}")


def comma_list(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]
