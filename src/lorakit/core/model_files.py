"""Facts about model, adapter and tokenizer directories read from their files alone: which files
make up a tokenizer, whether a directory holds one, a safetensors file's weight names and shapes,
and whether an adapter fits a base (check_adapter_fits_base, called by every entry point that
puts an adapter on a base: training, PPO's roles, chat and serving; the merge's plan). No
torch and no transformers, so the merge tools, inference and training ask the same questions
the same way, and a check costs a directory listing."""

import filecmp
import json
import os
import re
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple, TypeGuard

from lorakit.core.cli import InputError, read_json
from lorakit.core.fingerprints import FingerprintMemo, weights_fingerprint

# What makes a directory a tokenizer: the vocabulary itself, in the fast (tokenizer.json),
# SentencePiece (tokenizer.model) or GPT-2 byte-level BPE (vocab.json + merges.txt) form. A
# tokenizer_config.json alone names a class but holds no vocabulary to load.
TOKENIZER_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

# The chat template's keyword arguments training used (enable_thinking, ...), saved beside the tokenizer.
TEMPLATE_KWARGS_FILE = "chat_template_kwargs.json"
# Every file a Hugging Face tokenizer directory may hold, and ours (what a merge copies with it: the merged
# model then renders prompts as the adapter did).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    TEMPLATE_KWARGS_FILE,
)


def has_tokenizer(directory: str | None) -> TypeGuard[str]:
    """Whether directory holds a loadable tokenizer (its vocabulary, in any of the three forms)."""
    if not directory:
        return False
    return any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_VOCABULARY_FILES)


def tokenizer_files(directory: str) -> list[str]:
    """The tokenizer files present in directory (empty if it holds no tokenizer)."""
    if not has_tokenizer(directory):
        return []
    return [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, name))]


def safetensors_names(path: str) -> list[str]:
    """Tensor names of a .safetensors file, from its header alone (an 8-byte little-endian
    length, then that many bytes of JSON); [] for a file too short to hold one."""
    with open(path, "rb") as handle:
        size_bytes = handle.read(8)
        if len(size_bytes) < 8:
            return []
        header = json.loads(handle.read(struct.unpack("<Q", size_bytes)[0]))
    return [name for name in header if name != "__metadata__"]


def checkpoint_weight_names(model_dir: str) -> list[str]:
    """Weight names of a model directory, single file or sharded (its index), from headers only."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            return list(json.load(handle).get("weight_map", {}))
    single = os.path.join(model_dir, "model.safetensors")
    return safetensors_names(single) if os.path.isfile(single) else []


_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# Written last into checkpoint-N, once every rank's files and the adapter copy are on disk (trainers.checkpoints):
# the run identity and every file of the checkpoint with its size (checked here) and content hash (checked by the
# resume: trainers.checkpoints.content_problem). A checkpoint without it was cut short.
COMPLETION_MARKER = "checkpoint_complete.json"


def checkpoint_problem(path: str) -> str | None:
    """Why checkpoint directory `path` cannot be resumed from (its completion marker missing or damaged, or a
    file the marker lists missing or of another size than when it was saved), or None when it is complete."""
    if not os.path.isdir(path):
        return "no such directory"
    marker = os.path.join(path, COMPLETION_MARKER)
    if not os.path.isfile(marker):
        return f"no {COMPLETION_MARKER}: its save did not finish"
    try:
        with open(marker, encoding="utf-8") as handle:
            files = json.load(handle).get("files")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        files = None
    if not isinstance(files, dict):
        return f"its {COMPLETION_MARKER} is damaged"
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name}, saved with it, is missing"
        if os.path.getsize(file) != size:
            return f"{name} holds {os.path.getsize(file)} bytes, {size} when it was saved"
    return None


class CheckpointState(NamedTuple):
    """One checkpoint-N directory of an output_dir."""

    step: int  # N
    path: str
    problem: str | None  # why it cannot be resumed from (checkpoint_problem), None when complete


def checkpoint_states(output_dir: str) -> list[CheckpointState]:
    """The checkpoint-N directories in output_dir, by step."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            found.append((int(match.group(1)), path))
    return [CheckpointState(step, path, checkpoint_problem(path)) for step, path in sorted(found)]


def complete_checkpoints(output_dir: str) -> list[str]:
    """checkpoint-N directories holding a completion marker whose files are all there, oldest first: a crash
    mid-save leaves one without it. The training scripts resume from the last; the pipeline launcher decides from
    it whether a stage resumes."""
    return [path for _, path, problem in checkpoint_states(output_dir) if problem is None]


# ----------------------------------------------------------------------------- does an adapter fit a base

ADAPTER_PREFIX = "base_model.model."  # peft's prefix on every saved adapter tensor
INPUT_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
OUTPUT_EMBEDDING = "lm_head.weight"
LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_embedding_A": "eA", ".lora_embedding_B": "eB"}


def link_identical_files(directory: str, reference_dir: str) -> int:
    """Replace each file of `directory` that is byte for byte the file of the same name in `reference_dir` by a
    hard link to that file; return the bytes freed. A checkpoint's <stage>_lora_model/ repeats the adapter the
    Trainer wrote at the checkpoint's top: several GB a checkpoint once the embeddings train in full. Where the
    file system has no hard links both copies stay."""
    freed = 0
    for name in sorted(os.listdir(directory)):
        path, reference = os.path.join(directory, name), os.path.join(reference_dir, name)
        if not (os.path.isfile(path) and os.path.isfile(reference)) or os.path.samefile(path, reference):
            continue
        if os.path.getsize(path) != os.path.getsize(reference) or not filecmp.cmp(path, reference, shallow=False):
            continue
        linked = path + ".link"
        try:
            os.link(reference, linked)
        except OSError:
            continue
        os.replace(linked, path)
        freed += os.path.getsize(path)
    return freed


def safetensors_header(path: str) -> dict[str, dict[str, Any]]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a .safetensors file, from its header alone; a file
    whose header is damaged, or whose tensors would lie beyond its end, is an InputError naming it."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise InputError(f"{path}: not a safetensors file (bad header length; truncated or damaged?)")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"{path}: not a safetensors file (header is not JSON: {err})") from None
    if not isinstance(header, dict):
        raise InputError(f"{path}: not a safetensors file (header is not a JSON object)")
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    for name, info in tensors.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(info.get("shape"), list)
                and all(type(offset) is int and offset >= 0 for offset in offsets)):
            raise InputError(f"{path}: tensor {name}: no shape or data offsets in the header (damaged file?)")
        if 8 + length + offsets[1] > size:
            raise InputError(f"{path}: tensor {name} lies beyond the end of the file (truncated?)")
    return tensors


class TensorInfo(NamedTuple):
    """A saved tensor's safetensors dtype name ("BF16", ...; None if the header has none) and shape."""

    dtype: str | None
    shape: tuple[int, ...]


def checkpoint_shapes(model_dir: str) -> dict[str, TensorInfo]:
    """{weight name: (dtype, shape)} of a model directory's safetensors weights, single file or sharded, from
    headers only; {} when it holds none (a legacy .bin model: its loader compares shapes itself)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set((read_json(index, "model.safetensors.index.json").get("weight_map") or {}).values()))
    else:
        files = ["model.safetensors"] if os.path.isfile(os.path.join(model_dir, "model.safetensors")) else []
    shapes = {}
    for name in files:
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            raise InputError(f"{index}: lists {name}, which does not exist")
        for tensor, info in safetensors_header(path).items():
            shapes[tensor] = TensorInfo(info.get("dtype"), tuple(info["shape"]))
    return shapes


def check_recorded_base(adapter_dir: str, adapter_config: dict[str, Any], base_config: dict[str, Any],
                        flag: str) -> None:
    """Where the adapter's recorded base is a directory here, its model type must be the base's (the path itself
    may differ: a moved copy, or the merged model a later stage trained on)."""
    recorded = adapter_config.get("base_model_name_or_path")
    config_path = os.path.join(recorded, "config.json") if isinstance(recorded, str) and recorded else None
    if config_path is None or not os.path.isfile(config_path):
        return
    theirs, ours = read_json(config_path, "config.json").get("model_type"), base_config.get("model_type")
    if theirs and ours and theirs != ours:
        raise InputError(f"{adapter_dir}: the {flag} adapter was trained on {recorded}, a {theirs} model, but the "
                         f"base is a {ours} model: an adapter for another model?")


def base_weight(name: str, base: dict[str, Any]) -> str | None:
    """The base checkpoint's name for a weight of the model peft wrapped: the same, or without the leading
    module (a checkpoint saved from the bare model, or GPT-2's un-prefixed one); a tied lm_head is the input
    embedding."""
    for candidate in (name, name.split(".", 1)[-1]):
        if candidate in base:
            return candidate
    if name == OUTPUT_EMBEDDING:
        return next((key for key in base if key.endswith(INPUT_EMBEDDING_SUFFIXES)), None)
    return None


def adapter_updates(adapter_config: dict[str, Any],
                    tensors: dict[str, dict[str, Any]]) -> dict[str, tuple[int, ...] | None]:
    """{weight name: the shape the adapter needs the base's weight to have} for every LoRA module (B @ A,
    transposed for fan_in_fan_out and embeddings) and every tensor the adapter saved whole (modules_to_save)."""
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    needed: dict[str, tuple[int, ...] | None] = {}
    for key, info in tensors.items():
        name = key[len(ADAPTER_PREFIX):] if key.startswith(ADAPTER_PREFIX) else key
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if suffix:
            pairs.setdefault(name[: -len(suffix)], {})[LORA_SUFFIXES[suffix]] = tuple(info["shape"])
        elif not any(part in name for part in (".modules_to_save.", ".original_module.", ".base_layer.")):
            needed[name] = tuple(info["shape"])
    for module, parts in pairs.items():
        if expert_wrapper(module, adapter_config):
            # peft's ParamWrapper of fused expert weights (target_parameters, nested once per parameter): only that
            # the base has that experts module is checked here (a checkpoint stores its experts fused or one by one,
            # as transformers' conversion for the architecture has it); a shape peft cannot fit, its load refuses.
            needed[module.removesuffix(".base_layer")] = None
            continue
        embedding = "eA" in parts
        lora_a, lora_b = (parts.get("eA"), parts.get("eB")) if embedding else (parts.get("A"), parts.get("B"))
        if lora_a is None or lora_b is None or len(lora_a) != 2 or len(lora_b) != 2:
            continue  # not a plain LoRA pair: peft's own load reports it
        transposed = embedding or bool(adapter_config.get("fan_in_fan_out"))
        needed[f"{module}.weight"] = (lora_a[1], lora_b[0]) if transposed else (lora_b[0], lora_a[1])
    return needed


def expert_parameter_targets(target_parameters: Any) -> list[str]:
    """An adapter's target_parameters (peft matches each as a name suffix) as one sorted list, each parameter once:
    a name that is the dotted tail of another listed name is that one. peft 0.22 adds bare names beside ours on
    Qwen2-MoE (its v4-to-v5 conversion maps the shared expert's gate_proj/up_proj/down_proj targets onto the fused
    experts' gate_up_proj and down_proj too), so the same experts read as ["mlp.experts.down_proj", "down_proj", ...]
    there and ["mlp.experts.down_proj", ...] under 0.21."""
    names = set(target_parameters or ())
    return sorted(name for name in names if not any(other.endswith(f".{name}") for other in names))


def expert_wrapper(module: str, adapter_config: dict[str, Any]) -> bool:
    """Whether an adapter's LoRA module is peft's wrapper of a targeted parameter (target_parameters: a MoE
    model's fused experts), whose names and shapes are not a Linear's. A bare parameter name names no module, so it
    marks none (its module is then checked as a Linear, and refused if it is not one)."""
    targets = expert_parameter_targets(adapter_config.get("target_parameters"))
    owners = {owner for owner, _, _ in (name.rpartition(".") for name in targets) if owner}
    return any(module.removesuffix(".base_layer").endswith(owner) for owner in owners)


def lora_key_modules(tensor_names: Iterable[str]) -> dict[str, list[str]]:
    """{module of the model peft wrapped: the adapter's LoRA keys on it} (peft's prefix and any .base_layer, which
    peft nests once per targeted parameter of one module, taken off), whatever wrote the adapter."""
    modules: dict[str, list[str]] = {}
    for key in tensor_names:
        name = key[len(ADAPTER_PREFIX):] if key.startswith(ADAPTER_PREFIX) else key
        suffix = next((s for s in LORA_SUFFIXES if name.endswith(s)), None)
        if suffix:
            module = name[: -len(suffix)]
            while module.endswith(".base_layer"):
                module = module.removesuffix(".base_layer")
            modules.setdefault(module, []).append(key)
    return modules


def has_experts_module(name: str, base: dict[str, Any]) -> bool:
    """Whether a checkpoint holds the experts module `name` of the model in memory: under that name (fused, or one
    tensor per expert), or, in the same layer, under the name the architecture's checkpoints use (Mixtral's
    model.layers.0.mlp.experts is stored as model.layers.0.block_sparse_moe.experts.N.w1.weight: transformers
    renames it at load)."""
    prefixes = (f"{name}.", f"{name.split('.', 1)[-1]}.")
    if any(key.startswith(prefixes) for key in base):
        return True
    parts = name.split(".")
    layer_end = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if layer_end is None:
        return False
    layers = tuple(f"{'.'.join(parts[first:layer_end + 1])}." for first in range(min(2, layer_end + 1)))
    return any(key.startswith(layers) and f".{parts[-1]}." in key for key in base)


def shape_mismatch(name: str, needed: tuple[int, ...] | None, base: dict[str, Any],
                   adapter_config: dict[str, Any]) -> str | None:
    """Why the base cannot take the adapter's weight `name` of shape `needed` (None: a module, any weights under
    it), or None if it can."""
    if needed is None:
        return None if has_experts_module(name, base) else f"{name} matches no module of the base"
    found = base_weight(name, base)
    if found is None:
        if adapter_config.get("task_type") == "SEQ_CLS" and name.startswith("score."):
            return None  # a reward model's score head is new: the base has none
        return f"{name} matches no weight of the base"
    dtype, shape = base[found]
    if str(dtype).startswith(("U", "I")):
        return None  # a quantized checkpoint's packed weight: its loader checks it
    # An extended vocabulary gives the embeddings more rows than the base's: the loader grows the base's.
    resizable = found.endswith(INPUT_EMBEDDING_SUFFIXES) or found == OUTPUT_EMBEDDING
    if needed == shape or (resizable and len(needed) == len(shape) == 2 and needed[1] == shape[1]):
        return None
    return f"{name} needs a base weight of shape {list(needed)}, the base's is {list(shape)}"


def check_adapter_fits_base(adapter_dir: str, base_dir: str, flag: str) -> None:
    """Refuse, from adapter_config.json and the safetensors headers alone (no weight is read), an adapter made for
    another base: a recorded base of another model type, or any adapted module whose shape is not the base's.
    A base that is not a local directory, or legacy .bin weights, leave the comparison to peft's load."""
    weights = os.path.join(adapter_dir, "adapter_model.safetensors")
    tensors = safetensors_header(weights) if os.path.isfile(weights) else {}  # a damaged file is refused here
    if not base_dir or not os.path.isfile(os.path.join(base_dir, "config.json")):
        return
    adapter_config = read_json(os.path.join(adapter_dir, "adapter_config.json"), "adapter_config.json")
    check_recorded_base(adapter_dir, adapter_config, read_json(os.path.join(base_dir, "config.json"), "config.json"),
                        flag)
    base = checkpoint_shapes(base_dir)
    if not base:
        return
    for name, needed in adapter_updates(adapter_config, tensors).items():
        problem = shape_mismatch(name, needed, base, adapter_config)
        if problem:
            raise InputError(f"{weights}: the {flag} adapter does not fit the base {base_dir}: {problem} "
                             "(an adapter for another model?)")


# ----------------------------------------------------------------------------- which base an adapter was trained on

# Written beside every adapter the toolkit saves (trainers.checkpoints.save_adapter): the base it was trained on, by
# path and by its weights' fingerprint (core.fingerprints.weights_fingerprint). Merge and serving compare it.
BASE_RECORD = "lorakit_base.json"


def check_adapter_base(adapter_dir: str, base_dir: str, flag: str, memo: FingerprintMemo | None = None,
                       allow_other_base: bool = False) -> str | None:
    """Refuse an adapter whose BASE_RECORD names other base weights than base_dir's (one line naming both);
    return a warning line instead where that cannot be checked (an adapter made elsewhere records no base) or
    where allow_other_base lets it pass; None when the weights are the recorded ones."""
    record_path = os.path.join(adapter_dir, BASE_RECORD)
    if not os.path.isdir(base_dir):
        return None  # not a local directory: nothing to fingerprint
    if not os.path.isfile(record_path):
        return (f"{adapter_dir}: the {flag} adapter records no base (one made elsewhere: TRL, LLaMA-Factory, the "
                f"hub?): not checked that it was trained on {base_dir}")
    record = read_json(record_path, BASE_RECORD)
    recorded = record.get("weights") if isinstance(record, dict) else None
    current = weights_fingerprint(base_dir, memo)
    if recorded is None or current is None or recorded == current:
        return None
    problem = (f"{adapter_dir}: the {flag} adapter was trained on {record.get('base_model_name_or_path')} (weights "
               f"{recorded}), not on the base {base_dir} (weights {current}): another base of the same shape, or the "
               "same weights re-saved in another layout (shards, dtype), which counts as different")
    if allow_other_base:
        return f"{problem}; --allow_other_base: used anyway"
    raise InputError(f"{problem}; pass --allow_other_base to use it anyway")
