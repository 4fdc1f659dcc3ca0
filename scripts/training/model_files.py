"""Facts about model, adapter and tokenizer directories read from their files alone: which files
make up a tokenizer, whether a directory holds one, and a safetensors file's weight names. No
torch and no transformers, so the merge tools, inference and training ask the same questions
the same way, and a check costs a directory listing."""

import json
import os
import re
import struct
from typing import Optional

# What makes a directory a tokenizer: the vocabulary itself, in the fast (tokenizer.json),
# SentencePiece (tokenizer.model) or GPT-2 byte-level BPE (vocab.json + merges.txt) form. A
# tokenizer_config.json alone names a class but holds no vocabulary to load.
TOKENIZER_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

# Every file a Hugging Face tokenizer directory may hold (what a merge copies with it).
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
)


def has_tokenizer(directory: Optional[str]) -> bool:
    """Whether directory holds a loadable tokenizer (its vocabulary, in any of the three forms)."""
    return bool(directory) and any(os.path.isfile(os.path.join(directory, name))
                                   for name in TOKENIZER_VOCABULARY_FILES)


def tokenizer_files(directory: str) -> list:
    """The tokenizer files present in directory (empty if it holds no tokenizer)."""
    if not has_tokenizer(directory):
        return []
    return [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, name))]


def safetensors_names(path: str) -> list:
    """Tensor names of a .safetensors file, from its header alone (an 8-byte little-endian
    length, then that many bytes of JSON); [] for a file too short to hold one."""
    with open(path, "rb") as handle:
        size_bytes = handle.read(8)
        if len(size_bytes) < 8:
            return []
        header = json.loads(handle.read(struct.unpack("<Q", size_bytes)[0]))
    return [name for name in header if name != "__metadata__"]


def checkpoint_weight_names(model_dir: str) -> list:
    """Weight names of a model directory, single file or sharded (its index), from headers only."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            return list(json.load(handle).get("weight_map", {}))
    single = os.path.join(model_dir, "model.safetensors")
    return safetensors_names(single) if os.path.isfile(single) else []


_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def complete_checkpoints(output_dir: str) -> list:
    """checkpoint-N directories holding trainer_state.json (the Trainer writes it after the
    weights and optimizer), oldest first: a crash mid-save leaves one without it. The training
    scripts resume from the last; the pipeline launcher decides from it whether a stage resumes."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isfile(os.path.join(path, "trainer_state.json")):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]
