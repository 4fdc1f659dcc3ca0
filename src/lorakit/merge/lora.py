#!/usr/bin/env python
"""Fold one or more LoRA adapters into their base model, tensor by tensor, in bounded memory.

    python scripts/merge/merge_llama_with_lora.py --base_model BASE \
        --lora_model OUT_PT/pt_lora_model,OUT_SFT/sft_lora_model --output_dir MERGED [--verify]

Adapters are applied in the order given (the usual chain: the pretraining LoRA, then the SFT
LoRA trained on top of it). Each LoRA module adds scaling * B @ A to its weight (transposed for
fan_in_fan_out layers and embeddings), with scaling = alpha / r, or alpha / sqrt(r) for rsLoRA,
and r / alpha taken per module from rank_pattern / alpha_pattern. Whole tensors an adapter saved
(modules_to_save: embeddings, lm_head, a score head) replace the base's, which is how an
extended vocabulary arrives: the embedding rows come from the adapter and config.json's
vocab_size follows. A score head makes the result a sequence classifier (a reward model) whose
pad_token_id is that of the tokenizer copied beside it.

Memory: the base's safetensors files are read with plain reads, never mapped or loaded whole,
and every output tensor is computed and written in row chunks of at most --chunk_mb of float32,
so the peak is the torch runtime plus a few chunks, whatever the model's size. Only torch is
imported on this path (transformers and peft cost ~4 s to import; --verify loads them).
An adapter with target_parameters (LoRA on a mixture-of-experts model's fused expert parameters) is
merged instead by lorakit.merge.experts, through peft in memory (about 3 x the base's size).

Safety: inputs are only read; everything is checked (adapter configs, every tensor's shape
against the base, vocabulary and tokenizer sizes, free disk space) before anything is written;
the result is built in a temporary sibling of --output_dir (.<name>.tmp-<random>), synced to disk
(every file, then the directory) and renamed into place only when complete and, with --verify,
verified: a failed or killed merge publishes nothing. A temporary directory a killed merge left
behind is never used or removed by a later run (another merge may still be writing it); the
later run names it in a warning so its space can be reclaimed.

Tied embeddings: a base whose lm_head is its input embedding stays tied when the adapters keep
them equal (embed_tokens alone trained with peft's ensure_weight_tying, which our training
scripts use, saves identical embed_tokens and lm_head): only the embedding is written and
tie_word_embeddings stays true, so the merged model is the model that was trained, without an
extra vocab x hidden matrix. When an adapter trained them apart, the merge unties them: both are
written and tie_word_embeddings becomes false (what the trained peft model computes).
"""

import argparse
import contextlib
import json
import logging
import math
import os
import re
import resource
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from lorakit.core.atomic import atomic_output_dir
from lorakit.core.cli import ArgumentParser
from lorakit.core.fingerprints import FingerprintMemo, save_weights_memo, user_memo_root
from lorakit.core.model_files import check_adapter_base, check_recorded_base
from lorakit.merge.common import (
    InputError,
    check_output_dir,
    code_files,
    copy_files,
    read_json,
    run_cli,
    setup_tool_logging,
    tokenizer_files,
)

if TYPE_CHECKING:  # numpy comes with torch; named here only for a return type
    import numpy as np

logger = logging.getLogger("merge_llama_with_lora")

PEFT_PREFIX = "base_model.model."
INPUT_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
OUTPUT_EMBEDDING = "lm_head.weight"
# adapter_config.json features whose merge is not W += scaling * B @ A: refused, not approximated.
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA", "lora_bias": "lora_bias", "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices", "target_parameters": "target_parameters",
    "alora_invocation_tokens": "aLoRA", "use_qalora": "QALoRA", "use_bdlora": "BD-LoRA",
}
# These initialisations change the base weights: such an adapter needs the modified base.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
VERIFY_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "我们今天学习中文模型的训练和词表扩展。",
    "def add(a, b):\n    return a + b  # 🎉",
)


def build_parser() -> argparse.ArgumentParser:
    # argparse, not HfArgumentParser: transformers must stay out of the merge's imports.
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_model", required=True, help="Base model directory (config.json + safetensors).")
    parser.add_argument("--lora_model", required=True,
                        help="Adapter directory, or several separated by commas, applied in that order.")
    parser.add_argument("--output_dir", required=True, help="New directory for the merged model.")
    # No argparse choices: Chinese-LLaMA-Alpaca-2's "pth" gets our one-line refusal (parse_args), not a usage dump.
    parser.add_argument("--output_type", default="huggingface",
                        help="Only huggingface (safetensors); llama.cpp and vLLM read it directly.")
    parser.add_argument("--max_shard_size", default=None,
                        help="Largest output file, e.g. 2GB or 500MiB (default: one output file per base file).")
    parser.add_argument("--chunk_mb", type=float, default=16,
                        help="Rows computed at a time, in MiB of float32: bounds the merge's memory.")
    parser.add_argument("--verify", action="store_true",
                        help="Compare the merged model's logits with base+adapters in peft (needs both models in RAM).")
    parser.add_argument("--verify_tolerance", type=float, default=1e-3,
                        help="Largest accepted logit difference against peft's merge (rounded to the written dtype).")
    parser.add_argument("--allow_other_base", action="store_true",
                        help="Merge an adapter whose recorded base (lorakit_base.json) has other weights than "
                             "--base_model's (refused otherwise).")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="--verify: run the Python code the model directories ship (config.json auto_map) to "
                             "load them. The merge itself only copies that code; trust the directories first.")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.output_type != "huggingface":
        raise InputError(f"--output_type {args.output_type}: the merge writes the huggingface layout only "
                         "(config.json + *.safetensors + tokenizer, no consolidated.*.pth), which llama.cpp's "
                         "converter and vLLM read; drop --output_type or give huggingface")
    return args


# ----------------------------------------------------------------------------- safetensors I/O
# safetensors' Python API writes a file from a dict of tensors held in memory and reads through
# a memory map (whose touched pages count as resident memory). Streaming in bounded memory needs
# the format itself, which is small: 8 bytes little-endian header length, a JSON header
# {name: {dtype, shape, data_offsets}}, then the raw little-endian tensor bytes.


def _byte_view(tensor: torch.Tensor) -> "np.ndarray":
    """A writable numpy byte view of a contiguous tensor (any dtype, bfloat16 included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


@dataclass
class FileTensor:
    """A tensor inside a safetensors file, read on demand (rows start:stop)."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute position of its first byte

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start:stop (the whole tensor by default) in a new tensor."""
        if len(self.shape) == 0:
            out = torch.empty((), dtype=self.dtype)
        else:
            stop = self.shape[0] if stop is None else stop
            out = torch.empty((stop - start, *self.shape[1:]), dtype=self.dtype)
        return self.read_into(out, start)

    def read_into(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Fill out (contiguous, this dtype) with the rows from start on; plain reads, no mmap."""
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        buffer = memoryview(_byte_view(out))
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(self.offset + start * row_bytes)
            done = 0
            while done < len(buffer):
                got = handle.readinto(buffer[done:])
                if not got:
                    raise InputError(f"{self.path}: file is truncated (a tensor's data ends early)")
                done += got
        return out


@dataclass
class MemoryTensor:
    """A tensor already in memory (a legacy adapter_model.bin), with FileTensor's interface."""

    tensor: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        if self.tensor.dim() == 0:
            return self.tensor.clone()
        return self.tensor[start:stop].clone()

    def read_into(self, out: torch.Tensor, start: int = 0) -> torch.Tensor:
        return out.copy_(self.tensor if self.tensor.dim() == 0 else self.tensor[start:start + len(out)])


# A saved tensor, read on demand: from a safetensors file, or already in memory.
SavedTensor = FileTensor | MemoryTensor


def read_safetensors_header(path: str) -> dict[str, FileTensor]:
    """{name: FileTensor} for every tensor in a safetensors file, in the file's data order."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise InputError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InputError(f"{path}: not a safetensors file (header is not JSON: {err})") from None
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise InputError(f"{path}: tensor {name} has dtype {info.get('dtype')}, which the merge does not handle")
        begin, end = info["data_offsets"]
        numel = math.prod(info["shape"])
        if end - begin != numel * dtype.itemsize or 8 + length + end > size:
            raise InputError(f"{path}: tensor {name}: data offsets do not match its shape (damaged file?)")
        entries.append((begin, name, FileTensor(path, dtype, tuple(info["shape"]), 8 + length + begin)))
    return {name: entry for _, name, entry in sorted(entries)}


class SafetensorsWriter:
    """Writes a safetensors file whose tensors (names, dtypes, shapes) are known in advance:
    the header first, then each tensor's bytes as they are computed, chunk by chunk."""

    def __init__(self, path: str, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.path = path
        header, position = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [position, position + nbytes]}
            position += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)  # tensor data starts 8-byte aligned
        self.expected_end = 8 + len(encoded) + position
        self.handle = open(path, "wb")
        self.handle.write(len(encoded).to_bytes(8, "little"))
        self.handle.write(encoded)

    def write(self, chunk: torch.Tensor) -> None:
        self.handle.write(memoryview(_byte_view(chunk.contiguous())))

    def close(self) -> None:
        end = self.handle.tell()
        self.handle.close()
        if end != self.expected_end:  # a bug, not bad input: never leave a wrong file unnoticed
            raise RuntimeError(f"{self.path}: wrote {end} bytes, expected {self.expected_end}")


# ----------------------------------------------------------------------------- base model


@dataclass
class BaseModel:
    path: str
    config: dict[str, Any]
    tensors: dict[str, FileTensor]  # in file and data order
    files: list[str]  # weight files, in order
    tensor_file: dict[str, str]  # tensor name -> weight file name


def read_base_model(path: str) -> BaseModel:
    if not os.path.isdir(path):
        raise InputError(f"{path}: --base_model does not exist or is not a directory")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise InputError(f"{path}: --base_model is not a model directory (no config.json)")
    config = read_json(config_path, "config.json")
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        weight_map = read_json(index_path, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError(f"{index_path}: no weight_map")
        files = list(dict.fromkeys(sorted(weight_map.values())))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        weight_map, files = None, ["model.safetensors"]
    else:
        legacy = [name for name in os.listdir(path) if name.startswith("pytorch_model") and name.endswith(".bin")]
        hint = " (it has pytorch_model*.bin: re-save it with save_pretrained to get safetensors)" if legacy else ""
        raise InputError(f"{path}: --base_model has no model.safetensors or model.safetensors.index.json{hint}")
    tensors, tensor_file = {}, {}
    for name in files:
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise InputError(f"{index_path}: lists {name}, which does not exist")
        for tensor_name, entry in read_safetensors_header(file_path).items():
            if weight_map is not None and weight_map.get(tensor_name) != name:
                continue  # the index is authoritative for which file holds a tensor
            tensors[tensor_name] = entry
            tensor_file[tensor_name] = name
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise InputError(f"{index_path}: {missing[0]} is listed in {weight_map[missing[0]]} but not stored there")
    return BaseModel(path, config, tensors, files, tensor_file)


# ----------------------------------------------------------------------------- adapters


class LoraWeights(NamedTuple):
    """One module's A and B matrices, read in float32."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor


@dataclass
class LoraModule:
    """scaling * B @ A for one target weight; embedding/fan_in_fan_out deltas are transposed."""

    adapter: str
    module: str
    lora_a: SavedTensor
    lora_b: SavedTensor
    scaling: float
    transposed: bool
    embedding: bool = False

    def delta_shape(self) -> tuple[int, ...]:
        out_features, in_features = self.lora_b.shape[0], self.lora_a.shape[1]
        return (in_features, out_features) if self.transposed else (out_features, in_features)

    def add_to(self, rows: torch.Tensor, start: int, stop: int, loaded: LoraWeights) -> None:
        """rows (float32, rows start:stop of the weight) += the same rows of the delta."""
        weight_a, weight_b = loaded
        if self.transposed:  # delta = (B @ A).T: its rows are A's columns
            rows.addmm_(weight_a[:, start:stop].T, weight_b.T, alpha=self.scaling)
        else:
            rows.addmm_(weight_b[start:stop], weight_a, alpha=self.scaling)

    def load(self) -> LoraWeights:
        return LoraWeights(self.lora_a.read().float(), self.lora_b.read().float())


@dataclass
class Adapter:
    path: str
    config: dict[str, Any]
    lora: dict[str, LoraModule]  # target weight name -> its LoRA update
    replacements: dict[str, SavedTensor]  # target tensor name -> the tensor saved whole
    weights_file: str


def pattern_value(patterns: dict[str, float] | None, module: str, default: float) -> float:
    """peft's get_pattern_key: the first pattern key matching the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


class AdapterTensors(NamedTuple):
    """The adapter's weights file and the tensors saved in it, by name."""

    weights_file: str
    tensors: dict[str, SavedTensor]


def read_adapter_tensors(path: str) -> AdapterTensors:
    safetensors_path = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(safetensors_path):
        return AdapterTensors(safetensors_path, read_safetensors_header(safetensors_path))
    bin_path = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_path):
        try:  # never unpickle arbitrary objects from a file a user handed us
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure here means the file is unusable
            raise InputError(f"{bin_path}: cannot read it as a tensor state dict ({type(err).__name__})") from None
        return AdapterTensors(bin_path, {name: MemoryTensor(tensor) for name, tensor in state.items()})
    raise InputError(f"{path}: the adapter has no adapter_model.safetensors (or adapter_model.bin)")


def read_adapter_config(path: str) -> dict[str, Any]:
    """The adapter directory's adapter_config.json, or an InputError naming what is missing."""
    if not os.path.isdir(path):
        raise InputError(f"{path}: --lora_model directory does not exist")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise InputError(f"{path}: --lora_model is not a LoRA adapter (no adapter_config.json)")
    return read_json(config_path, "adapter_config.json")


def read_adapter(path: str) -> Adapter:
    config = read_adapter_config(path)
    check_adapter_config(os.path.join(path, "adapter_config.json"), config)
    weights_file, tensors = read_adapter_tensors(path)
    pairs, replacements = sort_adapter_tensors(weights_file, tensors)
    lora = lora_modules(path, config, pairs, weights_file)
    return Adapter(path, config, lora, replacements, weights_file)


def check_adapter_config(config_path: str, config: dict[str, Any], allowed: frozenset[str] = frozenset()) -> None:
    """Refuse an adapter whose merge is not W += scaling * B @ A on the unchanged base. allowed: the
    UNSUPPORTED_FEATURES keys a caller merges another way (the expert path merges target_parameters in peft)."""
    if config.get("peft_type", "LORA") != "LORA":
        raise InputError(f"{config_path}: peft_type is {config.get('peft_type')}; only LoRA adapters can be merged")
    for key, name in UNSUPPORTED_FEATURES.items():
        if config.get(key) and key not in allowed:
            raise InputError(f"{config_path}: {name} adapters are not supported by this merge "
                             f"({key}={config[key]!r}); merge with peft's merge_and_unload instead")
    init = str(config.get("init_lora_weights", True)).lower()
    if init.startswith(BASE_CHANGING_INITS):
        raise InputError(f"{config_path}: init_lora_weights={config['init_lora_weights']!r} changes the base "
                         "weights; convert the adapter to a plain LoRA first "
                         "(peft's path_initial_model_for_weight_conversion)")
    if "r" not in config or "lora_alpha" not in config:
        raise InputError(f"{config_path}: field 'r' or 'lora_alpha' is missing")


class AdapterParts(NamedTuple):
    """An adapter's tensors sorted: LoRA matrices by module, and tensors saved whole by model tensor name."""

    pairs: dict[str, dict[str, SavedTensor]]  # module name -> {"A"/"B" ("eA"/"eB" for embeddings): matrix}
    replacements: dict[str, SavedTensor]


def sort_adapter_tensors(weights_file: str, tensors: dict[str, SavedTensor]) -> AdapterParts:
    """(pairs, replacements) from the adapter's saved tensors: pairs maps a module name to its
    LoRA matrices by kind (A, B, or eA, eB for an embedding); replacements maps a model tensor
    name to a tensor the adapter saved whole (modules_to_save)."""
    pairs, replacements, aliases = {}, {}, {}
    for key, entry in tensors.items():
        if not key.startswith(PEFT_PREFIX):
            raise InputError(f"{weights_file}: tensor {key} does not start with {PEFT_PREFIX!r}: "
                             "not a peft LoRA adapter")
        name = key[len(PEFT_PREFIX):]
        for suffix, kind in ((".lora_A.weight", "A"), (".lora_B.weight", "B"),
                             (".lora_embedding_A", "eA"), (".lora_embedding_B", "eB")):
            if name.endswith(suffix):
                pairs.setdefault(name[: -len(suffix)], {})[kind] = entry
                break
        else:
            if ".lora_" in name or "lora_magnitude" in name:
                raise InputError(f"{weights_file}: tensor {key} is a LoRA variant this merge does not handle")
            if ".original_module." in name:
                continue  # the untrained module a modules_to_save wrapper keeps aside: not used
            if ".modules_to_save." in name or ".base_layer." in name:
                # When the vocabulary was resized peft also saves whole embedding layers as they sit in
                # the model: the trained copy under "modules_to_save." (the same values as the plain
                # key it always writes), a LoRA-wrapped embedding's resized weight under "base_layer.".
                aliases[name.replace(".modules_to_save.", ".").replace(".base_layer.", ".")] = entry
            else:
                replacements[name] = entry  # modules_to_save: peft writes the trained copy under the plain name
    return AdapterParts(pairs, {**aliases, **replacements})


def lora_modules(path: str, config: dict[str, Any], pairs: dict[str, dict[str, SavedTensor]],
                 weights_file: str) -> dict[str, LoraModule]:
    """Target weight name -> LoraModule, with each module's rank and alpha from the patterns."""
    lora = {}
    fan_in_fan_out = bool(config.get("fan_in_fan_out", False))
    for module, parts in pairs.items():
        embedding = "eA" in parts or "eB" in parts
        weight_a, weight_b = (parts.get("eA"), parts.get("eB")) if embedding else (parts.get("A"), parts.get("B"))
        if weight_a is None or weight_b is None:
            raise InputError(f"{weights_file}: module {module} has only one of its two LoRA matrices")
        if len(weight_a.shape) != 2 or len(weight_b.shape) != 2 or weight_a.shape[0] != weight_b.shape[1]:
            raise InputError(f"{weights_file}: module {module}: LoRA matrices of shapes {list(weight_a.shape)} and "
                             f"{list(weight_b.shape)} do not form B @ A (convolution LoRA is not supported)")
        rank = pattern_value(config.get("rank_pattern"), module, config["r"])
        alpha = pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        if weight_a.shape[0] != rank:
            raise InputError(f"{weights_file}: module {module} has rank {weight_a.shape[0]} but adapter_config.json "
                             f"gives r={rank} (r / rank_pattern)")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        lora[f"{module}.weight"] = LoraModule(path, module, weight_a, weight_b, scaling,
                                              transposed=embedding or fan_in_fan_out, embedding=embedding)
    return lora


# ----------------------------------------------------------------------------- merge plan


@dataclass
class TensorPlan:
    """One output tensor: where its values start from, then the LoRA deltas added in order."""

    name: str
    source: SavedTensor
    dtype: torch.dtype  # written dtype: the base tensor's
    deltas: list[LoraModule] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class MergePlan:
    tensors: dict[str, TensorPlan]  # output name -> its plan, in output order
    config: dict[str, Any]  # the output config.json
    home: dict[str, str | None]  # output name -> base weight file it came from (None: new tensor)
    notes: list[str]
    vocab_rows: int | None
    embedding_rows_after: list[int | None]  # input embedding rows after each adapter (for --verify)
    sequence_classification: bool


class Workspace:
    """Buffers reused from chunk to chunk: a fresh allocation per chunk would page-fault on every
    use and fragment the heap, and the peak would drift above the chunk size."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self.buffers.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            self.buffers[slot] = buffer = None  # let the old one go first
            self.buffers[slot] = buffer = torch.empty(max(nbytes, 8), dtype=torch.uint8)
        return buffer[:nbytes].view(dtype).view(shape)


def same_values(first: SavedTensor, second: SavedTensor, workspace: Workspace, chunk_bytes: int = 16 * 2**20) -> bool:
    """Whether two saved tensors hold the same values, compared a block of rows at a time."""
    if first.dtype != second.dtype or tuple(first.shape) != tuple(second.shape):
        return False
    shape = tuple(first.shape)
    if len(shape) <= 1:
        return torch.equal(first.read(), second.read())
    step = max(1, chunk_bytes // (math.prod(shape[1:]) * first.dtype.itemsize))
    for start in range(0, shape[0], step):
        block = (min(step, shape[0] - start), *shape[1:])
        if not torch.equal(first.read_into(workspace.get("source", block, first.dtype), start),
                           second.read_into(workspace.get("output", block, second.dtype), start)):
            return False
    return True


def input_embedding_name(tensors: dict[str, Any]) -> str | None:
    for name in tensors:
        if name.endswith(INPUT_EMBEDDING_SUFFIXES):
            return name
    return None


def plan_merge(base: BaseModel, adapters: list[Adapter], workspace: Workspace | None = None) -> MergePlan:
    """Apply the adapters to the base's shapes and check everything; read no weights except to
    compare a tied model's two saved embeddings."""
    plan, embed, tied = base_plan(base)
    for adapter in adapters:
        # The model type where the recorded base is here; every tensor's shape below, wherever it is.
        check_recorded_base(adapter.path, adapter.config, base.config, "--lora_model")
        replacements = dict(adapter.replacements)
        if tied and ({embed, OUTPUT_EMBEDDING} & (set(adapter.lora) | set(replacements))):
            tied = plan_tied_embeddings(plan, embed, adapter, replacements, workspace)
        plan_replacements(plan, base, embed, adapter, replacements)
        plan_lora_updates(plan, base, adapter)
        plan.embedding_rows_after.append(plan.tensors[embed].shape[0] if embed else None)
    plan_vocabulary(plan, embed)
    if plan.sequence_classification:
        plan_sequence_classifier(plan)
    return plan


class BasePlan(NamedTuple):
    """The base model as a plan, its input embedding's name, and whether its output embedding is tied to it."""

    plan: MergePlan
    embed: str | None
    tied: bool


def base_plan(base: BaseModel) -> BasePlan:
    """(plan, input embedding name, tied): the base model unchanged, as a plan to apply adapters to."""
    config = dict(base.config)
    notes = []
    tensors = {name: TensorPlan(name, entry, entry.dtype) for name, entry in base.tensors.items()}
    embed = input_embedding_name(tensors)
    if "tie_word_embeddings" in config:
        tied = bool(config["tie_word_embeddings"]) and embed is not None
    else:
        tied = embed is not None and OUTPUT_EMBEDDING not in tensors
    if tied and OUTPUT_EMBEDDING in tensors:
        # transformers re-ties a tied model at load time, ignoring a stored lm_head.
        del tensors[OUTPUT_EMBEDDING]
        notes.append("the base is tied and also stores lm_head.weight: it is dropped, as transformers ignores it")
    plan = MergePlan(tensors, config, dict(base.tensor_file), notes, vocab_rows=None, embedding_rows_after=[],
                     sequence_classification=False)
    return BasePlan(plan, embed, tied)


def plan_tied_embeddings(plan: MergePlan, embed: str, adapter: Adapter, replacements: dict[str, SavedTensor],
                         workspace: Workspace | None) -> bool:
    """An adapter that touches a tied model's embeddings: whether the model stays tied. Trained
    as one matrix (both saved, equal), the saved lm_head is dropped from replacements; trained
    apart, the plan gets its own lm_head and an untied config."""
    label = adapter.path
    if {embed, OUTPUT_EMBEDDING} & set(adapter.lora):
        raise InputError(f"{label}: LoRA on the embeddings of a tied model is not supported; "
                         "train them with --modules_to_save embed_tokens instead")
    new_embed, new_head = replacements.get(embed), replacements.get(OUTPUT_EMBEDDING)
    if new_embed is not None and new_head is not None and same_values(new_embed, new_head, workspace or Workspace()):
        del replacements[OUTPUT_EMBEDDING]  # trained as one matrix: stays one
        return True
    tensors = plan.tensors
    if new_head is None and tuple(new_embed.shape) != tensors[embed].shape:
        raise InputError(
            f"{label}: the adapter resizes the embeddings of a tied model to {new_embed.shape[0]} rows "
            "but saves only embed_tokens, so the output embedding's new rows are not in it; "
            "train with ensure_weight_tying (as our training scripts do) or "
            "--modules_to_save embed_tokens,lm_head")
    # Trained apart: the output embedding keeps what it was (or what the adapter saved).
    tensors[OUTPUT_EMBEDDING] = replace(tensors[embed], name=OUTPUT_EMBEDDING, deltas=list(tensors[embed].deltas))
    plan.home[OUTPUT_EMBEDDING] = plan.home.get(embed)
    plan.config["tie_word_embeddings"] = False
    plan.notes.append(f"{label} trains the input and output embeddings apart: the merged model is untied "
                      "(lm_head.weight written, tie_word_embeddings false)")
    return False


def plan_replacements(plan: MergePlan, base: BaseModel, embed: str | None, adapter: Adapter,
                      replacements: dict[str, SavedTensor]) -> None:
    """Tensors the adapter saved whole take the place of the base's (embeddings may grow rows);
    a sequence classifier's score head is new."""
    tensors = plan.tensors
    for name, entry in replacements.items():
        current = tensors.get(name)
        if current is None:
            if adapter.config.get("task_type") == "SEQ_CLS" and name.startswith("score."):
                tensors[name] = TensorPlan(name, entry, tensors[embed].dtype if embed else entry.dtype)
                plan.home[name] = None
                plan.sequence_classification = True
                continue
            raise InputError(f"{adapter.weights_file}: saved tensor {name} matches no tensor of the base model "
                             f"{base.path}: an adapter for another model?")
        resizable = name in (embed, OUTPUT_EMBEDDING)
        fits = tuple(entry.shape) == current.shape or (
            resizable and len(entry.shape) == 2 and entry.shape[1] == current.shape[1])
        if not fits:
            raise InputError(f"{adapter.weights_file}: saved tensor {name} has shape {list(entry.shape)} but the "
                             f"model has {list(current.shape)}: an adapter for another model?")
        if entry.dtype not in FLOAT_DTYPES or current.dtype not in FLOAT_DTYPES:
            if entry.dtype != current.dtype:
                raise InputError(f"{adapter.weights_file}: saved tensor {name} is {entry.dtype}, "
                                 f"the base's is {current.dtype}")
        tensors[name] = TensorPlan(name, entry, current.dtype)


def plan_lora_updates(plan: MergePlan, base: BaseModel, adapter: Adapter) -> None:
    """Each LoRA module's delta goes onto its weight, after those of earlier adapters."""
    for name, module in adapter.lora.items():
        current = plan.tensors.get(name)
        if current is None:
            raise InputError(f"{adapter.weights_file}: LoRA module {module.module} matches no weight of the base "
                             f"model {base.path}: an adapter for another model?")
        if module.delta_shape() != current.shape:
            raise InputError(f"{adapter.weights_file}: LoRA module {module.module} makes a "
                             f"{list(module.delta_shape())} update but the weight is {list(current.shape)}: "
                             "an adapter for another model (or a fan_in_fan_out mismatch)?")
        if current.dtype not in FLOAT_DTYPES:
            raise InputError(f"{name}: the base weight is {current.dtype} (quantized?); merge into a float base")
        current.deltas.append(module)


def plan_vocabulary(plan: MergePlan, embed: str | None) -> None:
    """The vocabulary size after every adapter: both embeddings agree, config.json follows."""
    plan.vocab_rows = vocab_rows = plan.tensors[embed].shape[0] if embed else None
    head = plan.tensors.get(OUTPUT_EMBEDDING)
    if head is not None and vocab_rows is not None and head.shape[0] != vocab_rows:
        raise InputError(f"after the adapters the input embedding has {vocab_rows} rows but lm_head has "
                         f"{head.shape[0]}: an adapter resized only one of them (train both: --modules_to_save "
                         "embed_tokens,lm_head)")
    config = plan.config
    if vocab_rows is not None and isinstance(config.get("vocab_size"), int) and config["vocab_size"] != vocab_rows:
        plan.notes.append(f"vocab_size {config['vocab_size']} -> {vocab_rows} (embedding rows from the adapter)")
        config["vocab_size"] = vocab_rows


def plan_sequence_classifier(plan: MergePlan) -> None:
    """A score head from an adapter makes the merged model a sequence classifier: no lm_head,
    the classifier architecture and its labels in config.json."""
    tensors, config = plan.tensors, plan.config
    tensors.pop(OUTPUT_EMBEDDING, None)
    labels = tensors["score.weight"].shape[0] if "score.weight" in tensors else config.get("num_labels", 2)
    config["architectures"] = [arch.replace("ForCausalLM", "ForSequenceClassification")
                               for arch in config.get("architectures", [])]
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(labels)}
    config["label2id"] = {f"LABEL_{i}": i for i in range(labels)}
    plan.notes.append(f"score head from the adapter: the merged model is a sequence classifier with {labels} label(s)")


# ----------------------------------------------------------------------------- tokenizer


def tokenizer_size(directory: str) -> int | None:
    """Number of ids the tokenizer in directory can produce (from tokenizer.json), or None."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    data = read_json(path, "tokenizer.json")
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids = list(vocab.values())
    elif isinstance(vocab, list):
        ids = [len(vocab) - 1]
    else:
        return None
    ids += [token.get("id", 0) for token in data.get("added_tokens") or []]
    return max(ids) + 1 if ids else None


def tokenizer_pad_id(directory: str) -> int | None:
    """The id of the pad token that directory's tokenizer_config.json (or special_tokens_map.json) names,
    looked up in its tokenizer.json; None where any of them is missing."""
    pad_token = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(directory, name)
        if pad_token is None and os.path.isfile(path):
            pad_token = read_json(path, name).get("pad_token")
    if isinstance(pad_token, dict):  # a serialized AddedToken
        pad_token = pad_token.get("content")
    path = os.path.join(directory, "tokenizer.json")
    if not isinstance(pad_token, str) or not os.path.isfile(path):
        return None
    data = read_json(path, "tokenizer.json")
    for token in data.get("added_tokens") or []:
        if token.get("content") == pad_token:
            return token.get("id")
    vocab = (data.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return vocab.get(pad_token)
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs in id order
        return next((i for i, entry in enumerate(vocab) if entry and entry[0] == pad_token), None)
    return None


def plan_classifier_pad_token(plan: MergePlan, tokenizer_dir: str) -> None:
    """transformers' sequence classifiers score each row at its last token that is not config.json's
    pad_token_id: it must be the pad token of the tokenizer copied beside the model (the one the adapter was
    trained with), not the base's, or rows are read at the wrong position (or, without one, refused)."""
    pad_id = tokenizer_pad_id(tokenizer_dir)
    if pad_id is None or plan.config.get("pad_token_id") == pad_id:
        return
    plan.notes.append(f"pad_token_id {plan.config.get('pad_token_id')} -> {pad_id} "
                      f"(the pad token of the tokenizer from {tokenizer_dir})")
    plan.config["pad_token_id"] = pad_id


class TokenizerSource(NamedTuple):
    """The directory whose tokenizer the merged model gets, and its tokenizer files."""

    directory: str
    files: list[str]


def choose_tokenizer(base_path: str, adapter_paths: list[str]) -> TokenizerSource:
    """(directory, files): the last adapter's tokenizer (it may carry an extended vocabulary and
    the chat template training used), else the base's."""
    for path in reversed(adapter_paths):
        files = tokenizer_files(path)
        if files:
            return TokenizerSource(path, files)
    return TokenizerSource(base_path, tokenizer_files(base_path))


# ----------------------------------------------------------------------------- output layout


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise InputError(f"--max_shard_size {text}: expected a size such as 2GB, 500MB or 4GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


class OutputFile(NamedTuple):
    """One safetensors file of the merged model and the tensors it holds, in order."""

    name: str
    tensors: list[TensorPlan]


def shard_layout(plan: MergePlan, base: BaseModel, max_shard_size: int | None) -> list[OutputFile]:
    """The output files and their tensors."""
    if max_shard_size is None:  # mirror the base: one output file per base file
        groups: dict[str, list[TensorPlan]] = {name: [] for name in base.files}
        last = base.files[-1]
        for tensor in plan.tensors.values():
            groups[plan.home.get(tensor.name) or last].append(tensor)
        shards = [tensors for tensors in groups.values() if tensors]
    else:
        shards, current, size = [], [], 0
        for tensor in plan.tensors.values():
            if current and size + tensor.nbytes > max_shard_size:
                shards.append(current)
                current, size = [], 0
            current.append(tensor)
            size += tensor.nbytes
        if current:
            shards.append(current)
    if len(shards) == 1:
        return [OutputFile("model.safetensors", shards[0])]
    return [OutputFile(f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", tensors)
            for i, tensors in enumerate(shards)]


def write_tensor(writer: SafetensorsWriter, tensor: TensorPlan, chunk_bytes: int, workspace: Workspace) -> None:
    """Compute and write one output tensor, a block of rows at a time: read the base (or saved)
    rows, add every LoRA delta's rows in float32, cast to the output dtype. 0-D and 1-D
    tensors (norms, biases) are small and go in one piece."""
    shape = tensor.shape
    if len(shape) <= 1:
        rows, step = 1, 1
    else:
        rows, step = shape[0], max(1, chunk_bytes // (4 * math.prod(shape[1:])))
    loaded = [delta.load() for delta in tensor.deltas]
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        block = shape if len(shape) <= 1 else (stop - start, *shape[1:])
        values = tensor.source.read_into(workspace.get("source", block, tensor.source.dtype), start)
        if tensor.deltas:
            if values.dtype != torch.float32:
                values = workspace.get("accumulator", block, torch.float32).copy_(values)
            for delta, weights in zip(tensor.deltas, loaded, strict=True):
                delta.add_to(values, start, stop, weights)
        if values.dtype != tensor.dtype:
            values = workspace.get("output", block, tensor.dtype).copy_(values)
        writer.write(values)


def write_model(plan: MergePlan, layout: list[OutputFile], out_dir: str, chunk_bytes: int,
                workspace: Workspace) -> None:
    total = sum(tensor.nbytes for _, tensors in layout for tensor in tensors)
    try:
        from tqdm import tqdm
        progress = tqdm(total=total, unit="B", unit_scale=True, desc="merging", file=sys.stdout,
                        disable=not sys.stdout.isatty())
    except ImportError:  # progress is a nicety
        progress = None
    for file_name, tensors in layout:
        writer = SafetensorsWriter(os.path.join(out_dir, file_name),
                                   [(tensor.name, tensor.dtype, tensor.shape) for tensor in tensors])
        for tensor in tensors:
            write_tensor(writer, tensor, chunk_bytes, workspace)
            if progress is not None:
                progress.update(tensor.nbytes)
        writer.close()
    if progress is not None:
        progress.close()
    if len(layout) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {tensor.name: file_name for file_name, tensors in layout for tensor in tensors}}
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
            json.dump(index, handle, indent=2)
            handle.write("\n")


# ----------------------------------------------------------------------------- verify


class LogitDifferences(NamedTuple):
    """--verify's largest |logit difference| of the merged model against peft's merge, and against the
    unmerged model as trained."""

    difference: float
    as_trained: float


def verify(base_path: str, adapter_paths: list[str], merged_path: str, plan: MergePlan,
           trust_remote_code: bool = False) -> LogitDifferences:
    """(difference, as_trained): max |logit difference| of the merged model against peft's own
    merge of base+adapters, and against base+adapters unmerged (the model as trained).

    Both are computed in float32. peft's merged weights are first rounded to the dtype each is
    written in: a 16-bit checkpoint cannot hold W + scaling * B @ A exactly, which moves logits by
    up to ~0.5 on its own; the first figure checks the merge, the second shows that rounding.
    Earlier adapters are merged by peft (a later adapter was trained on top of them)."""
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()
    auto = AutoModelForSequenceClassification if plan.sequence_classification else AutoModelForCausalLM
    extra = {"num_labels": plan.tensors["score.weight"].shape[0]} if plan.sequence_classification else {}
    if trust_remote_code:
        logger.warning("--trust_remote_code: running the model's own code from %s", base_path)
    reference = auto.from_pretrained(base_path, dtype=torch.float32, trust_remote_code=trust_remote_code, **extra)
    for i, adapter_path in enumerate(adapter_paths):
        rows = plan.embedding_rows_after[i]
        if rows is not None and rows != reference.get_input_embeddings().weight.shape[0]:
            reference.resize_token_embeddings(rows, mean_resizing=False)  # the adapter carries the rows
        reference = PeftModel.from_pretrained(reference, adapter_path)
        if i < len(adapter_paths) - 1:
            reference = reference.merge_and_unload()
    reference.eval()
    merged = auto.from_pretrained(merged_path, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()

    batches = verify_batches(merged_path, plan.vocab_rows, trust_remote_code)
    with torch.no_grad():
        outputs = [merged(input_ids=ids).logits for ids in batches]
        as_trained = max((reference(input_ids=ids).logits - out).abs().max().item()
                         for ids, out in zip(batches, outputs, strict=True))
        reference = reference.merge_and_unload()
        written = {name: tensor.dtype for name, tensor in plan.tensors.items()}
        embed = input_embedding_name(plan.tensors)
        for name, parameter in reference.named_parameters():
            dtype = written.get(name, written.get(embed) if name == OUTPUT_EMBEDDING else None)
            if dtype in (torch.float16, torch.bfloat16):
                parameter.copy_(parameter.to(dtype).float())
        difference = max((reference(input_ids=ids).logits - out).abs().max().item()
                         for ids, out in zip(batches, outputs, strict=True))
    return LogitDifferences(difference, as_trained)


def verify_batches(tokenizer_dir: str, vocab_rows: int | None, trust_remote_code: bool) -> list[torch.Tensor]:
    """--verify's inputs: VERIFY_PROMPTS in the tokenizer of tokenizer_dir, or random ids where it holds none."""
    from transformers import AutoTokenizer

    if tokenizer_files(tokenizer_dir):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        return [tokenizer(prompt, return_tensors="pt")["input_ids"] for prompt in VERIFY_PROMPTS]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(vocab_rows or 2, (1, 16), generator=generator) for _ in VERIFY_PROMPTS]


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start_time = time.perf_counter()
    adapter_paths, max_shard_size = check_arguments(args)
    base = read_base_model(args.base_model)
    if args.verify and base.config.get("auto_map") and not args.trust_remote_code:
        raise InputError(f"{args.base_model}: --verify loads the model with transformers, which needs the model's "
                         "own Python code (config.json auto_map): add --trust_remote_code if you trust that directory")
    if any(read_adapter_config(path).get("target_parameters") for path in adapter_paths):
        # LoRA on fused expert parameters: merged by peft in memory. Imported here, as that path imports
        # transformers and peft, which the streaming path never does.
        from lorakit.merge.experts import merge_expert_adapters

        merge_expert_adapters(args, adapter_paths, base, max_shard_size, start_time)
        return
    adapters = [read_adapter(path) for path in adapter_paths]
    check_adapter_bases(args.base_model, adapter_paths, args.allow_other_base)
    # Before any buffer exists: parsing a large tokenizer.json is the other transient peak.
    tokenizer_dir, tokenizer_names = choose_tokenizer(args.base_model, adapter_paths)
    tokens = tokenizer_size(tokenizer_dir) if tokenizer_names else None
    workspace = Workspace()
    plan = plan_merge(base, adapters, workspace)
    check_tokenizer_fits(tokenizer_dir, tokens, plan, base)
    if plan.sequence_classification and tokenizer_names:
        plan_classifier_pad_token(plan, tokenizer_dir)
    layout = shard_layout(plan, base, max_shard_size)
    total = sum(tensor.nbytes for _, tensors in layout for tensor in tensors)
    warn_about_leftovers(args.output_dir)
    check_free_space(args.output_dir, total)
    log_plan(plan, base, len(adapters), layout, total)

    with atomic_output_dir(args.output_dir) as tmp:
        write_model(plan, layout, tmp, int(args.chunk_mb * 2**20), workspace)
        write_model_files(plan, args.base_model, tokenizer_dir, tokenizer_names, tmp)
        merge_seconds = time.perf_counter() - start_time
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if args.verify:
            verify_or_exit(args, adapter_paths, tmp, plan)
    print(f"merged {len(adapters)} adapter(s) into {args.output_dir}: {len(layout)} file(s), "
          f"{total / 1e6:.1f} MB, vocab {plan.vocab_rows}, {merge_seconds:.1f}s, peak RSS {peak_mb:.0f} MiB",
          flush=True)


def check_adapter_bases(base_model: str, adapter_paths: list[str], allow_other_base: bool) -> None:
    """The first adapter must have been trained on --base_model's weights (core.model_files.check_adapter_base; its
    fingerprint memoized user-wide, so a base is read once). A later adapter was trained on the merge of the earlier
    ones into the base, which no file here holds: it is not checked."""
    memo = FingerprintMemo(user_memo_root())
    warning = check_adapter_base(adapter_paths[0], base_model, "--lora_model", memo, allow_other_base)
    if warning:
        logger.warning(warning)
    save_weights_memo(memo, user_memo_root())
    if len(adapter_paths) > 1:
        logger.info("adapters after the first (%s) are not checked against a base: each was trained on the merge of "
                    "the ones before it", ", ".join(adapter_paths[1:]))


class CheckedArguments(NamedTuple):
    """The adapter directories, in order, and the largest output file in bytes (None: mirror the base's files)."""

    adapter_paths: list[str]
    max_shard_size: int | None


def check_arguments(args: argparse.Namespace) -> CheckedArguments:
    """(adapter directories, largest output file in bytes or None), or an InputError."""
    adapter_paths = [path.strip() for path in args.lora_model.split(",") if path.strip()]
    if not adapter_paths:
        raise InputError("--lora_model names no adapter directory")
    check_output_dir(args.output_dir, {"--base_model": args.base_model,
                                       **{f"--lora_model {p}": p for p in adapter_paths}})
    max_shard_size = parse_size(args.max_shard_size) if args.max_shard_size else None
    if args.chunk_mb <= 0:
        raise InputError(f"--chunk_mb must be positive, got {args.chunk_mb}")
    return CheckedArguments(adapter_paths, max_shard_size)


def check_tokenizer_fits(tokenizer_dir: str, tokens: int | None, plan: MergePlan, base: BaseModel) -> None:
    """Every id the copied tokenizer produces must have an embedding row."""
    if tokens is None or plan.vocab_rows is None:
        return
    if tokens > plan.vocab_rows:
        raise InputError(f"{tokenizer_dir}: the tokenizer has {tokens} tokens but the merged embeddings have "
                         f"{plan.vocab_rows} rows: ids past the last row would crash the model "
                         "(was the adapter trained with this tokenizer and "
                         "--modules_to_save embed_tokens,lm_head?)")
    if tokens < plan.vocab_rows and plan.vocab_rows != base.config.get("vocab_size"):
        logger.warning("the embeddings grew to %d rows but the tokenizer copied from %s has only %d tokens",
                       plan.vocab_rows, tokenizer_dir, tokens)


def check_free_space(output_dir: str, total: int) -> None:
    """Refuse before writing when the disk under output_dir cannot hold total bytes."""
    existing = os.path.dirname(os.path.abspath(output_dir))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if total > free:
        raise InputError(f"{output_dir}: the merged model needs {total / 1e9:.2f} GB but only "
                         f"{free / 1e9:.2f} GB are free there")


def leftover_temp_dirs(output_dir: str) -> list[str]:
    """Temporary directories of earlier merges into output_dir that never completed (killed while
    writing), by the name core.atomic.atomic_output_dir gives them: .<output name>.tmp-<random>."""
    parent, name = os.path.split(os.path.abspath(output_dir))
    if not os.path.isdir(parent):
        return []
    prefix = f".{name}.tmp-"
    return [os.path.join(parent, entry) for entry in sorted(os.listdir(parent))
            if entry.startswith(prefix) and os.path.isdir(os.path.join(parent, entry))]


def warn_about_leftovers(output_dir: str) -> None:
    """A merge killed mid-write leaves its temporary directory behind, never published. This run
    ignores it (another merge may still be writing it) and names it, since it can hold as much as
    a whole model and make the free-space check fail."""
    for path in leftover_temp_dirs(output_dir):
        logger.warning("%s: %.1f MB left by an interrupted merge into %s (never published, not used); "
                       "delete it to free the space", path, directory_bytes(path) / 1e6, output_dir)


def directory_bytes(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):  # gone meanwhile: a merge that was still running finished
                total += os.path.getsize(os.path.join(root, name))
    return total


def log_plan(plan: MergePlan, base: BaseModel, adapter_count: int, layout: list[OutputFile], total: int) -> None:
    for note in plan.notes:
        logger.info("%s", note)
    base_sources = {id(entry) for entry in base.tensors.values()}
    logger.info("merging %d adapter(s) into %s: %d LoRA updates, %d tensors saved whole by adapters, "
                "%d output file(s), %.1f MB", adapter_count, base.path,
                sum(len(tensor.deltas) for tensor in plan.tensors.values()),
                sum(1 for tensor in plan.tensors.values() if id(tensor.source) not in base_sources),
                len(layout), total / 1e6)


def write_model_files(plan: MergePlan, base_dir: str, tokenizer_dir: str, tokenizer_names: list[str],
                      out_dir: str) -> None:
    """Everything beside the weights: config.json, the base's generation config and code, the tokenizer."""
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(plan.config, handle, indent=2, ensure_ascii=False)
        handle.write("\n")
    if os.path.isfile(os.path.join(base_dir, "generation_config.json")):
        copy_files(base_dir, ["generation_config.json"], out_dir)
    copy_code_and_tokenizer(base_dir, tokenizer_dir, tokenizer_names, out_dir)


def copy_code_and_tokenizer(base_dir: str, tokenizer_dir: str, tokenizer_names: list[str], out_dir: str) -> None:
    """The base's own model code (config.json auto_map) and the chosen tokenizer, beside the merged weights."""
    copy_files(base_dir, code_files(base_dir), out_dir)
    copy_files(tokenizer_dir, tokenizer_names, out_dir)
    if tokenizer_names:
        logger.info("tokenizer files from %s: %s", tokenizer_dir, ", ".join(tokenizer_names))


def verify_or_exit(args: argparse.Namespace, adapter_paths: list[str], merged_dir: str, plan: MergePlan) -> None:
    """--verify: print the logit differences; exit 1 (the output is never renamed into place)
    when the merged model is further from peft's merge than --verify_tolerance."""
    difference, as_trained = verify(args.base_model, adapter_paths, merged_dir, plan, args.trust_remote_code)
    print(f"verify: max abs logit difference, peft base+adapters vs merged: {difference:.3g} "
          f"(tolerance {args.verify_tolerance:g}); against the unmerged float32 model as trained: "
          f"{as_trained:.3g}", flush=True)
    check_verified(args, difference, "the merged model's")


def check_verified(args: argparse.Namespace, difference: float, written: str) -> None:
    """Exit 1 (the output is never renamed into place) when the written model's logits (`written` names them) are
    further from peft's merge than --verify_tolerance; a NaN fails too."""
    if not difference <= args.verify_tolerance:
        print(f"error: --verify failed: {written} logits differ from peft's merge by up to {difference:.3g}, "
              f"above --verify_tolerance {args.verify_tolerance:g}; nothing was written to {args.output_dir}",
              file=sys.stderr, flush=True)
        sys.exit(1)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    setup_tool_logging()
    run_cli(main)


if __name__ == "__main__":
    entry_point()
