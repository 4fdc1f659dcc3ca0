"""The LoRA merge's output: the merged model's files (its safetensors files, laid out as the base's or by
--max_shard_size, config.json, the base's code and the chosen tokenizer), and what the output directory needs first
(free space; the leftovers of an interrupted merge, named).

Memory: every output tensor is computed and written in row chunks of at most --chunk_mb of float32, read from the
base's files with plain reads (lorakit.merge.safetensors_stream), so the peak is the torch runtime plus a few chunks,
whatever the model's size.

Safety: the result is built in a temporary sibling of --output_dir (.<name>.tmp-<random>, lorakit.core.atomic),
synced to disk (every file, then the directory) and renamed into place only when complete and, with --verify,
verified: a failed or killed merge publishes nothing. A temporary directory a killed merge left behind is never used
or removed by a later run (another merge may still be writing it); the later run names it in a warning so its space
can be reclaimed."""

import contextlib
import json
import logging
import math
import os
import re
import shutil
import sys
from typing import Any, NamedTuple

import torch

from lorakit.merge.common import InputError, code_files, copy_files
from lorakit.merge.inputs import BaseModel
from lorakit.merge.plan import MergePlan, TensorPlan, Workspace
from lorakit.merge.safetensors_stream import SafetensorsWriter

logger = logging.getLogger("merge_llama_with_lora")

SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


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
        shards, size = [], 0
        current: list[TensorPlan] = []
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
        index: dict[str, dict[str, Any]] = {
            "metadata": {"total_size": total},
            "weight_map": {tensor.name: file_name for file_name, tensors in layout for tensor in tensors}}
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as handle:
            json.dump(index, handle, indent=2)
            handle.write("\n")


# ----------------------------------------------------------------------------- the output directory


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
