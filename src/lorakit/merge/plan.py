"""The LoRA merge's plan: the adapters applied, in order, to the base's tensor shapes, with every check made before
anything is written (each LoRA update's shape against its weight, the tensors an adapter saved whole, the
vocabulary's size in both embeddings and config.json, a score head that makes a sequence classifier), and the
tokenizer the merged model gets. No weight is read here, except to compare a tied model's two saved embeddings.

Tied embeddings: a base whose lm_head is its input embedding stays tied when the adapters keep
them equal (embed_tokens alone trained with peft's ensure_weight_tying, which our training
scripts use, saves identical embed_tokens and lm_head): only the embedding is written and
tie_word_embeddings stays true, so the merged model is the model that was trained, without an
extra vocab x hidden matrix. When an adapter trained them apart, the merge unties them: both are
written and tie_word_embeddings becomes false (what the trained peft model computes)."""

import logging
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from lorakit.core.model_files import check_recorded_base
from lorakit.merge.common import InputError, read_json, tokenizer_files
from lorakit.merge.inputs import Adapter, BaseModel, LoraModule
from lorakit.merge.safetensors_stream import SavedTensor

logger = logging.getLogger("merge_llama_with_lora")

INPUT_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
OUTPUT_EMBEDDING = "lm_head.weight"
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


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
            self.buffers.pop(slot, None)
            buffer = None  # let the old one go first
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
        if tied and embed is not None and ({embed, OUTPUT_EMBEDDING} & (set(adapter.lora) | set(replacements))):
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
    if new_head is None:
        assert new_embed is not None  # the caller comes here when the adapter saved one of the two (no LoRA on them)
        if tuple(new_embed.shape) != tensors[embed].shape:
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
