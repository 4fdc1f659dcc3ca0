"""The LoRA merge's inputs, read and checked: the base model directory (config.json and its safetensors files, as
tensors read on demand) and the adapter directories (adapter_config.json, the LoRA matrices by module with their
scaling, and the tensors saved whole), and whether the first adapter was trained on this base. Shared with the
expert-adapter path (lorakit.merge.experts), which reads the same directories."""

import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from lorakit.core.fingerprints import FingerprintMemo, save_weights_memo, user_memo_root
from lorakit.core.model_files import check_adapter_base
from lorakit.merge.common import InputError, read_json
from lorakit.merge.safetensors_stream import FileTensor, MemoryTensor, SavedTensor, file_tensors

logger = logging.getLogger("merge_llama_with_lora")

PEFT_PREFIX = "base_model.model."
# adapter_config.json features whose merge is not W += scaling * B @ A: refused, not approximated.
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA", "lora_bias": "lora_bias", "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices", "target_parameters": "target_parameters",
    "alora_invocation_tokens": "aLoRA", "use_qalora": "QALoRA", "use_bdlora": "BD-LoRA",
}
# These initialisations change the base weights: such an adapter needs the modified base.
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")


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
        for tensor_name, entry in file_tensors(file_path).items():
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
    tensors: Mapping[str, SavedTensor]  # read only: a safetensors file's hold FileTensors alone


def read_adapter_tensors(path: str) -> AdapterTensors:
    safetensors_path = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(safetensors_path):
        return AdapterTensors(safetensors_path, file_tensors(safetensors_path))
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


def sort_adapter_tensors(weights_file: str, tensors: Mapping[str, SavedTensor]) -> AdapterParts:
    """(pairs, replacements) from the adapter's saved tensors: pairs maps a module name to its
    LoRA matrices by kind (A, B, or eA, eB for an embedding); replacements maps a model tensor
    name to a tensor the adapter saved whole (modules_to_save)."""
    pairs: dict[str, dict[str, SavedTensor]] = {}
    replacements: dict[str, SavedTensor] = {}
    aliases: dict[str, SavedTensor] = {}
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


# ----------------------------------------------------------------------------- the adapters' base


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
