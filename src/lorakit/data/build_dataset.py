"""The cached tokenize-and-group pipelines of every stage (pretraining blocks, SFT samples,
preference pairs) and their collators. Records come from records.readers, the cache from data.cache,
the answer masks from data.conversation_tokenizer."""

import logging
import os
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset
from datasets.table import InMemoryTable
from tqdm.auto import tqdm

from lorakit.core.cli import InputError
from lorakit.core.pair_segments import PAIR_CHOSEN, PAIR_PADDING, PAIR_PREFIX, PAIR_REJECTED
from lorakit.data.cache import DatasetCheck, FingerprintMemo, build_or_load_cached, cache_key, tokenizer_fingerprint
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.splits import phase_part
from lorakit.records.readers import (
    Conversation,
    LocatedRecord,
    Message,
    find_pretraining_files,
    preference_of,
    read_conversations,
    read_documents,
    records_of,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# The parts of map_shards and shards_of that pass through them unchanged.
State = TypeVar("State")
Item = TypeVar("Item")
Result = TypeVar("Result")

# Part of every cache key: bump it whenever a change here changes the blocks produced.
# 2: a byte order mark is dropped and a lone "\r" ends a document (core.text_lines).
PRETRAINING_CACHE_VERSION = "pt-blocks-2"
TOKENIZE_BATCH_LINES = 1000


# ----------------------------------------------------------------------------- pretraining


class DocumentAffixes(NamedTuple):
    """Ids around each document: the tokenizer's own BOS convention before it, then EOS after it."""

    prefix: list[int]
    suffix: list[int]


def document_affixes(tokenizer: "PreTrainedTokenizerBase") -> DocumentAffixes:
    """Ids around each document: the tokenizer's own BOS convention, then EOS between documents."""
    special = tokenizer("", add_special_tokens=True)["input_ids"]
    prefix = [i for i in special if i != tokenizer.eos_token_id]
    if tokenizer.eos_token_id is None:
        raise InputError("the tokenizer has no eos_token: documents could not be separated")
    return DocumentAffixes(prefix, [tokenizer.eos_token_id])


def encode_lines(tokenizer: "PreTrainedTokenizerBase", lines: list[str]) -> list[list[int]]:
    if getattr(tokenizer, "is_fast", False):
        # The Rust tokenizer directly: skips building offsets and BatchEncoding objects we never use.
        return [encoding.ids for encoding in
                tokenizer.backend_tokenizer.encode_batch_fast(lines, add_special_tokens=False)]
    return tokenizer(lines, add_special_tokens=False)["input_ids"]


def tokenize_documents(tokenizer: "PreTrainedTokenizerBase", documents: list[str], prefix: list[int],
                       suffix: list[int]) -> np.ndarray:
    """One flat int32 array: prefix + ids + suffix for each document, in order."""
    parts: list[list[int]] = []
    for start in range(0, len(documents), TOKENIZE_BATCH_LINES):
        for ids in encode_lines(tokenizer, documents[start : start + TOKENIZE_BATCH_LINES]):
            parts.extend((prefix, ids, suffix))
    # chain.from_iterable runs in C: no per-document list copies before the one array.
    return np.fromiter(chain.from_iterable(parts), dtype=np.int32, count=sum(map(len, parts)))


# What forked workers run with, set in the parent just before the fork: inherited, never pickled.
_FORKED_STATE = None


def _with_forked_state(task: tuple[Callable[[Any, list[Any]], Any], list[Any]]) -> Any:
    function, shard = task
    return function(_FORKED_STATE, shard)


def map_shards(function: Callable[[State, list[Item]], Result], state: State, shards: list[list[Item]], num_proc: int,
               progress: tqdm) -> list[Result]:
    """[function(state, shard) for shard in shards], in order, over num_proc forked processes when
    there is more than one shard (the state, a tokenizer, is inherited by the workers); progress
    advances by each shard's length. An InputError in a worker is raised here."""
    global _FORKED_STATE
    results = []
    if num_proc <= 1 or len(shards) <= 1:
        for shard in shards:
            results.append(function(state, shard))
            progress.update(len(shard))
        return results
    _FORKED_STATE = state
    try:
        with get_context("fork").Pool(min(num_proc, len(shards))) as pool:
            results_in_order = pool.imap(_with_forked_state, [(function, s) for s in shards])
            for shard, result in zip(shards, results_in_order, strict=True):
                results.append(result)
                progress.update(len(shard))
    finally:
        _FORKED_STATE = None
    return results


def shards_of(items: list[Item], num_proc: int, smallest: int) -> list[list[Item]]:
    """items cut into about 4 shards per process (so a slow shard does not idle the others), each
    at least `smallest` long."""
    size = max(smallest, -(-len(items) // max(num_proc, 1) // 4))
    return [items[i : i + size] for i in range(0, len(items), size)]


def tokenize_all(tokenizer: "PreTrainedTokenizerBase", documents: list[str], num_proc: int) -> np.ndarray:
    prefix, suffix = document_affixes(tokenizer)
    with tqdm(total=len(documents), desc="Tokenizing", unit="doc", unit_scale=True) as progress:
        arrays = map_shards(tokenize_document_shard, (tokenizer, prefix, suffix),
                            shards_of(documents, num_proc, TOKENIZE_BATCH_LINES), num_proc, progress)
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)


def tokenize_document_shard(state: tuple["PreTrainedTokenizerBase", list[int], list[int]],
                            documents: list[str]) -> np.ndarray:
    tokenizer, prefix, suffix = state
    return tokenize_documents(tokenizer, documents, prefix, suffix)


def group_into_blocks(flat_ids: np.ndarray, block_size: int, fingerprint: str | None = None) -> Dataset:
    """Cut the token stream into block_size rows (the tail shorter than a block is dropped, as in
    run_clm) with one reshape: no per-example Python lists, no O(n^2) concatenation.

    fingerprint: the cache key, which already identifies the content; without one, datasets
    hashes the whole table with dill (~0.05-0.2 s for 4.5 M tokens, serial)."""
    num_blocks = len(flat_ids) // block_size
    values = pa.array(flat_ids[: num_blocks * block_size], type=pa.int32())
    column = pa.FixedSizeListArray.from_arrays(values, block_size)
    return Dataset(InMemoryTable(pa.table({"input_ids": column})), fingerprint=fingerprint)


def build_pretraining_blocks(
    dataset_dir: str,
    tokenizer: "PreTrainedTokenizerBase",
    block_size: int,
    cache_dir: str,
    num_proc: int = 1,
    check: DatasetCheck | None = None,
) -> Dataset:
    """Documents of every file in dataset_dir -> token blocks of block_size, cached (check: see
    data.cache.build_or_load_cached, as for the other builders).

    The cache key covers each file's content, the tokenizer, the block size and
    PRETRAINING_CACHE_VERSION, so a changed file or tokenizer never reuses stale blocks."""
    files = find_pretraining_files(dataset_dir)
    memo = FingerprintMemo(cache_dir)
    key = cache_key(
        {
            "version": PRETRAINING_CACHE_VERSION,
            "files": [(os.path.basename(path), memo(path)) for path in files],
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "block_size": block_size,
        }
    )

    def build(tmp_dir: str) -> None:
        documents = [document for path in files for document in read_documents(path)]
        flat_ids = tokenize_all(tokenizer, documents, num_proc)
        blocks = group_into_blocks(flat_ids, block_size, fingerprint=key)
        if len(blocks) == 0:
            raise InputError(
                f"{dataset_dir}: {len(flat_ids)} tokens in all is less than one block of --block_size {block_size}"
            )
        logger.info("%d documents, %d tokens -> %d blocks of %d", len(documents), len(flat_ids), len(blocks),
                    block_size)
        blocks.save_to_disk(tmp_dir)

    blocks, hit = build_or_load_cached(cache_dir, f"pt-{key}", build, check, memo)
    logger.info("pretraining blocks: cache %s (%s, %d blocks)", "hit" if hit else "miss, built", key, len(blocks))
    return blocks


class DataCollatorForPretraining:
    """Stack equal-length blocks; labels are the inputs (the model shifts them)."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids = torch.tensor([feature["input_ids"] for feature in features], dtype=torch.long)
        return {"input_ids": input_ids, "labels": input_ids.clone()}


# ----------------------------------------------------------------------------- supervised data

# 3: a special token's text in a record is encoded as text (records.control_text). Not moved by the drop of records
# over ConversationTokenizer.record_byte_limit: it changes only a cache that held one (a record of hundreds of KB cut
# to max_length), and a new key would refuse every interrupted run's resume.
SFT_CACHE_VERSION = "sft-3"
PREPARE_DATA_ONLY_HELP = (
    "Build (or check) the tokenized data cache these arguments need, print its entries and exit, without a process "
    "group or the model: run it as one process per node (python, not torchrun) before the training launch, whose "
    "ranks then load the cache instead of waiting at a barrier (--ddp_timeout) while one process tokenizes.")


class PreparesData(Protocol):
    """Data arguments with --prepare_data_only (pretraining's and the conversation stages')."""

    prepare_data_only: bool


def check_prepare_data_only(data_args: PreparesData) -> None:
    """--prepare_data_only is one process (per node): under a launcher (WORLD_SIZE > 1), the training arguments,
    parsed next, would start the process group it does without, and every rank would wait on every other."""
    if data_args.prepare_data_only and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise InputError("--prepare_data_only runs as one process per node (python script.py ...), not under "
                         "torchrun or deepspeed: it builds the data cache without a process group")


@dataclass
class ConversationDataArguments:
    """Data arguments of the stages that read conversations (SFT, reward, PPO prompts)."""

    dataset_dir: str | None = field(
        default=None, metadata={"help": "Directory of *.json / *.jsonl files."}
    )
    data_path: list[str] | None = field(
        default=None,
        metadata={"help": "Data files, each its own dataset (DeepSpeed-Chat style), split by --data_split.",
                  "nargs": "+"},
    )
    data_split: str | None = field(
        default=None, metadata={"help": "Weights of the SFT,reward,PPO parts of each dataset, e.g. 6,2,2."}
    )
    data_phase: int = field(
        default=1, metadata={"help": "Which part of --data_split this stage takes (1 SFT, 2 reward, 3 PPO)."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Held-out data for eval."})
    validation_split_percentage: float = field(
        default=0.0, metadata={"help": "Without --validation_file: held-out share of samples (fraction if < 1)."}
    )
    template: str | None = field(
        default=None,
        metadata={"help": "llama2, alpaca, chatml or human_assistant; default: the tokenizer's own chat_template."},
    )
    template_kwargs: str | None = field(
        default=None, metadata={"help": "Keyword arguments the chat template is rendered with, as a JSON object "
                                "(e.g. '{\"enable_thinking\": false}'); saved with the adapter for inference."})
    enable_thinking: bool | None = field(
        default=None, metadata={"help": "Passed to templates that take it (Qwen3): false renders the empty "
                                "<think></think> of non-thinking mode in the prompt."})
    max_seq_length: int | None = field(default=None, metadata={"help": "Tokens per sequence (prompt + answer)."})
    preprocessing_num_workers: int = field(
        default=1, metadata={"help": "Processes that tokenize (the result does not depend on it)."}
    )
    data_cache_dir: str | None = field(default=None, metadata={"help": "Where tokenized data is cached."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most this many train samples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep at most this many eval samples."})
    prepare_data_only: bool = field(default=False, metadata={"help": PREPARE_DATA_ONLY_HELP})

    def __post_init__(self) -> None:
        check_prepare_data_only(self)


# Conversations or pairs per shard of parallel tokenization: enough to amortise the hand-off.
ROWS_PER_SHARD = 256


class TokenizedShard(NamedTuple):
    """The dataset columns tokenized from a shard of records, and how many records were dropped."""

    rows: dict[str, list[Any]]
    dropped: int
    control_text: int = 0  # records whose text held a special token's text (encoded as text: records.control_text)
    cut_answers: int = 0  # samples whose last answer max_length cut, so that it lost its turn end
    identical_when_cut: int = 0  # pairs dropped: chosen and rejected became the same token ids when cut to max_length
    too_large: int = 0  # of dropped: records with more text than max_length tokens can hold, dropped untokenized


def tokenize_conversation_shard(conversation_tokenizer: ConversationTokenizer,
                                sources: list[Conversation]) -> TokenizedShard:
    """Conversations -> their rows, and the samples dropped (no answer token fits, or too much text to tokenize)."""
    rows: dict[str, list[Any]] = {"input_ids": [], "labels": [], "length": []}
    dropped, control_text, cut_answers, too_large = 0, 0, 0, 0
    for where, messages, tools in sources:
        oversized = conversation_tokenizer.too_large(messages, tools)
        sample = None if oversized else conversation_tokenizer(where, messages, tools)
        if sample is None:
            dropped, too_large = dropped + 1, too_large + oversized
            continue
        control_text += sample["control_text"]
        cut_answers += sample["cut_answer"]
        rows["input_ids"].append(sample["input_ids"])
        rows["labels"].append(sample["labels"])
        rows["length"].append(len(sample["input_ids"]))
    return TokenizedShard(rows, dropped, control_text, cut_answers, too_large=too_large)


def joined(parts: list[TokenizedShard]) -> TokenizedShard:
    """The shards' rows, in order, and their counts, as one."""
    rows: dict[str, list[Any]] = {name: [] for name in parts[0].rows} if parts else {}
    for part in parts:
        for name, values in part.rows.items():
            rows[name] += values
    counts = [sum(getattr(part, name) for part in parts) for name in TokenizedShard._fields[1:]]
    return TokenizedShard(rows, *counts)


def report_control_text(count: int, total: int, what: str) -> None:
    if count:
        logger.warning("%d of %d %s hold a special token's text (such as an end-of-turn token) in their messages: it "
                       "is trained as plain text, as the server reads it", count, total, what)


def report_cut_answers(count: int, total: int, max_length: int) -> None:
    if count:
        logger.warning("%d of %d answers cut by --max_seq_length %d; they lose their turn end (the model is not "
                       "taught to stop after them): raise --max_seq_length or shorten those conversations", count,
                       total, max_length)


def build_sft_dataset(
    files: list[str],
    tokenizer: "PreTrainedTokenizerBase",
    template: str,
    max_length: int,
    cache_dir: str,
    train_on_last_turn_only: bool = False,
    data_split: str | None = None,
    data_phase: int = 1,
    seed: int = 42,
    unsplit_files: tuple[str, ...] = (),
    template_kwargs: dict[str, Any] | None = None,
    num_proc: int = 1,
    check: DatasetCheck | None = None,
) -> Dataset:
    """Conversations of every file -> tokenized, masked samples, cached. With data_split, each
    file except those in unsplit_files (--sft_only_data_path) contributes only its data_phase part.
    num_proc processes tokenize (--preprocessing_num_workers); the result does not depend on it."""
    memo = FingerprintMemo(cache_dir)
    key = cache_key({"version": SFT_CACHE_VERSION,
                     "files": [(os.path.abspath(p), memo(p), p in unsplit_files) for p in files],
                     "tokenizer": tokenizer_fingerprint(tokenizer), "template": template,
                     "template_kwargs": template_kwargs or {}, "max_length": max_length,
                     "last_turn_only": train_on_last_turn_only, "split": [data_split, data_phase, seed]})
    conversation_tokenizer = ConversationTokenizer(tokenizer, template, max_length, train_on_last_turn_only,
                                                   template_kwargs=template_kwargs)

    def build(tmp_dir: str) -> None:
        sources = [record for path in files
                   for record in phase_part(read_conversations(path), None if path in unsplit_files else data_split,
                                            data_phase, seed)]
        rows = tokenized_sft_rows(conversation_tokenizer, sources, num_proc)
        if not rows.get("input_ids"):
            raise InputError(f"no trainable sample left in {', '.join(files)} "
                             f"(all dropped by --max_seq_length {max_length})")
        Dataset.from_dict(rows).save_to_disk(tmp_dir)

    dataset, hit = build_or_load_cached(cache_dir, f"sft-{key}", build, check, memo)
    logger.info("supervised samples: cache %s (%s, %d samples)", "hit" if hit else "miss, built", key, len(dataset))
    return dataset


def tokenized_sft_rows(conversation_tokenizer: ConversationTokenizer, sources: list[Conversation],
                       num_proc: int) -> dict[str, list[Any]]:
    """The SFT samples' columns, tokenized by num_proc processes; what was dropped, cut or held control text is
    said in the log."""
    max_length = conversation_tokenizer.max_length
    byte_limit = conversation_tokenizer.record_byte_limit  # here, once, not in each forked worker
    with tqdm(total=len(sources), desc="Tokenizing conversations", unit="sample") as progress:
        tokenized = joined(map_shards(tokenize_conversation_shard, conversation_tokenizer,
                                      shards_of(sources, num_proc, ROWS_PER_SHARD), num_proc, progress))
    report_control_text(tokenized.control_text, len(sources), "samples")
    report_cut_answers(tokenized.cut_answers, len(sources), max_length)
    if tokenized.dropped:
        logger.warning("dropped %d of %d samples: no answer token fits in --max_seq_length %d (%d of them hold "
                       "over %d bytes of text, more than that many tokens can: not tokenized)", tokenized.dropped,
                       len(sources), max_length, tokenized.too_large, byte_limit)
    return tokenized.rows


def pack_samples(dataset: Dataset, max_length: int) -> Dataset:
    """Pack samples into rows of at most max_length tokens (first fit, longest first), each
    sample keeping its own position_ids from 0 so attention never crosses samples. Rows stay
    bounded by max_length: one row per batch would make sdpa attention cost O(row^2)."""
    lengths = np.asarray(dataset["length"])
    bins: list[list[int]] = []
    # Best fit, longest first: rooms[k] is the free space of bin room_bins[k], kept sorted.
    rooms: list[int] = []
    room_bins: list[int] = []
    for index in np.argsort(-lengths, kind="stable"):
        size = int(lengths[index])
        k = bisect_left(rooms, size)
        if k == len(rooms):
            bins.append([])
            slot, room = len(bins) - 1, max_length
        else:
            slot, room = room_bins.pop(k), rooms.pop(k)
        bins[slot].append(int(index))
        k = bisect_left(rooms, room - size)
        rooms.insert(k, room - size)
        room_bins.insert(k, slot)
    input_ids, labels = dataset["input_ids"], dataset["labels"]
    rows: dict[str, list[Any]] = {"input_ids": [], "labels": [], "position_ids": [], "length": []}
    for members in bins:
        rows["input_ids"].append([t for i in members for t in input_ids[i]])
        rows["labels"].append([t for i in members for t in labels[i]])
        rows["position_ids"].append([p for i in members for p in range(len(input_ids[i]))])
        rows["length"].append(len(rows["input_ids"][-1]))
    logger.info("packed %d samples into %d rows of at most %d tokens (%.1f%% of row capacity used)",
                len(dataset), len(bins), max_length, 100.0 * lengths.sum() / max(len(bins) * max_length, 1))
    return Dataset.from_dict(rows)


PACKING_CACHE_VERSION = "packed-1"


def cached_packed_rows(dataset: Dataset, max_length: int, cache_dir: str) -> Dataset:
    """pack_samples(dataset, max_length), cached beside the samples: packed once (the main process, first), then
    loaded by the other ranks and by later runs. The key is the samples' datasets fingerprint (their cache entry's,
    moved by the held-out split and --max_train_samples selections) and max_length. Not part of the run's record
    of its data (note_data): the samples' entry is, and those selections are part of the run's identity."""
    key = cache_key({"version": PACKING_CACHE_VERSION, "samples": dataset._fingerprint, "max_length": max_length})
    packed, hit = build_or_load_cached(cache_dir, f"packed-{key}",
                                       lambda tmp_dir: pack_samples(dataset, max_length).save_to_disk(tmp_dir),
                                       record=False)
    logger.info("packed rows: cache %s (%s, %d rows)", "hit" if hit else "miss, built", key, len(packed))
    return packed


# Attention implementations whose masks transformers builds from position_ids (masking_utils finds
# the packed samples where positions restart), so packed samples stay apart at any batch size.
POSITION_MASKED_ATTENTION = ("sdpa", "eager", "flex_attention")
# torch's own varlen attention kernel (torch.nn.attention.varlen), registered with transformers under this name by
# models.varlen_attention: it takes the packed samples' bounds, as flash attention does.
TORCH_VARLEN = "torch_varlen"


def is_flash_attention(attn_implementation: str | None) -> bool:
    """transformers' own rule (is_flash_attention_requested): an implementation named flash
    (flash_attention_2/3/4, a hub kernel such as kernels-community/flash-attn2) runs its flash path."""
    return attn_implementation is not None and "flash" in attn_implementation


def takes_sample_bounds(attn_implementation: str | None) -> bool:
    """Whether packed rows must carry their samples' bounds (flash_varlen_kwargs) for this attention: a flash
    attention (transformers finds them from position_ids only in a batch of one row) and torch_varlen (never)."""
    return is_flash_attention(attn_implementation) or attn_implementation == TORCH_VARLEN


def check_packing_attention(attn_implementation: str | None) -> None:
    """Refuse --packing with an attention implementation that cannot keep packed samples apart:
    transformers builds no mask for it, and it takes no sequence boundaries (None: transformers'
    default, sdpa or eager)."""
    if (attn_implementation is None or attn_implementation in POSITION_MASKED_ATTENTION
            or takes_sample_bounds(attn_implementation)):
        return
    raise InputError(f"--packing with --attn_implementation {attn_implementation}: that attention gets no mask and no "
                     "sample boundaries, so packed samples would attend to each other; use sdpa, eager, "
                     f"flex_attention, {TORCH_VARLEN} or a flash attention, or drop --packing")


class SampleBounds(NamedTuple):
    """The segments of packed rows in the batch flattened to one sequence, as varlen attention kernels take them."""

    cu_seqlens: torch.Tensor  # int32 [segments + 1]: where each segment starts, then the end of the last
    max_length: int  # the longest segment's length


def sample_bounds(position_ids: torch.Tensor) -> SampleBounds:
    """The SampleBounds of packed rows from their position_ids, [batch, width] or [width]: a segment (a sample, or
    a row's padding) starts where positions restart at 0, and at each row's start whatever its first position, so
    that no segment crosses from one row into the next."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    starts = rows == 0
    starts[:, :1] = True
    end = torch.tensor([rows.numel()], device=rows.device)
    cu_seqlens = torch.cat([starts.flatten().nonzero().flatten(), end]).to(torch.int32)
    return SampleBounds(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))


def flash_varlen_kwargs(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """transformers' FlashAttentionKwargs for padded packed rows (as DataCollatorWithFlattening
    writes them), which torch_varlen takes too: cu_seq_lens_q/k and max_length_q/k, the rows'
    sample_bounds (queries and keys alike: no cache)."""
    bounds = sample_bounds(position_ids)
    return {"cu_seq_lens_q": bounds.cu_seqlens, "cu_seq_lens_k": bounds.cu_seqlens,
            "max_length_q": bounds.max_length, "max_length_k": bounds.max_length}


def whole_row_causal_mask(batch_size: int, width: int, dtype: torch.dtype = torch.bool,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """A 4D attention mask [batch_size, 1, width, width], causal over each whole row, as the control that packing
    can fail: passed as attention_mask with packed rows and their restarting position_ids (so RoPE is unchanged),
    it lets each sample attend to the samples before it in its row, since transformers takes a 4D mask as it is
    and derives none from the positions. bool: True attends (sdpa); a float dtype: additive, 0 or the dtype's
    minimum (eager)."""
    allowed = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(batch_size, 1, width, width)
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


class DataCollatorForSupervisedDataset:
    """Right-pad to the longest row (rounded up to pad_to_multiple_of: 8 on a GPU): labels -100 on
    padding. Masks come from the lengths, never from comparing ids with the pad id (the pad id may
    be EOS, which answers end with). Packed rows carry position_ids and no attention mask: padding becomes one more
    segment with positions from 0, which attends only to itself and has no labels. Under a flash
    attention or torch_varlen (attn_implementation, the model's: takes_sample_bounds) packed rows also carry the
    segments' bounds: flash finds them from position_ids only in a batch of one row, and would otherwise run
    each row as one causal sequence across its samples; torch_varlen runs packed rows on the bounds alone."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 8,
                 attn_implementation: str | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of
        self.with_bounds = takes_sample_bounds(attn_implementation)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor | int]:
        longest = max(len(f["input_ids"]) for f in features)
        width = -(-longest // self.multiple) * self.multiple
        packed = "position_ids" in features[0]
        batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": [],
                                             ("position_ids" if packed else "attention_mask"): []}
        for feature in features:
            pad = width - len(feature["input_ids"])
            batch["input_ids"].append(list(feature["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(feature["labels"]) + [-100] * pad)
            if packed:
                batch["position_ids"].append(list(feature["position_ids"]) + list(range(pad)))
            else:
                batch["attention_mask"].append([1] * len(feature["input_ids"]) + [0] * pad)
        tensors = {name: torch.tensor(values, dtype=torch.long) for name, values in batch.items()}
        bounds = flash_varlen_kwargs(tensors["position_ids"]) if packed and self.with_bounds else {}
        return {**tensors, **bounds}


# ----------------------------------------------------------------------------- preference pairs

# 5: a special token's text in a record is encoded as text (records.control_text).
# 6: pairs whose chosen and rejected token ids are the same once cut to max_length are dropped.
PREFERENCE_CACHE_VERSION = "pairs-6"


def build_preference_dataset(
    files: list[str],
    tokenizer: "PreTrainedTokenizerBase",
    template: str,
    max_length: int,
    cache_dir: str,
    data_split: str | None = None,
    data_phase: int = 2,
    seed: int = 42,
    template_kwargs: dict[str, Any] | None = None,
    num_proc: int = 1,
    check: DatasetCheck | None = None,
) -> Dataset:
    """Pairs of every file -> chosen/rejected token ids (each the whole conversation up to the
    end of its answer's turn: the score is read there), cached. A pair whose prompt alone fills
    max_length is refused: it cannot be scored on its answers. num_proc processes tokenize."""
    memo = FingerprintMemo(cache_dir)
    key = cache_key({"version": PREFERENCE_CACHE_VERSION, "files": [(os.path.abspath(p), memo(p)) for p in files],
                     "tokenizer": tokenizer_fingerprint(tokenizer), "template": template,
                     "template_kwargs": template_kwargs or {}, "max_length": max_length,
                     "split": [data_split, data_phase, seed]})
    conversation_tokenizer = ConversationTokenizer(tokenizer, template, max_length, keep_after_turn_end=True,
                                                   template_kwargs=template_kwargs)

    def build(tmp_dir: str) -> None:
        records = [item for path in files for item in phase_part(records_of(path), data_split, data_phase, seed)]
        rows = tokenized_pair_rows(conversation_tokenizer, records, num_proc)
        if not rows.get("margin"):
            raise InputError(f"no preference pair left in {', '.join(files)}")
        Dataset.from_dict(rows).save_to_disk(tmp_dir)

    dataset, hit = build_or_load_cached(cache_dir, f"pairs-{key}", build, check, memo)
    logger.info("preference pairs: cache %s (%s, %d pairs)", "hit" if hit else "miss, built", key, len(dataset))
    return dataset


def tokenized_pair_rows(conversation_tokenizer: ConversationTokenizer, records: list[LocatedRecord],
                        num_proc: int) -> dict[str, list[Any]]:
    """The pairs' columns, tokenized by num_proc processes; the pairs dropped (identical answers, or identical once
    cut to --max_seq_length) and those holding control text are said in the log."""
    with tqdm(total=len(records), desc="Tokenizing pairs", unit="pair") as progress:
        tokenized = joined(map_shards(tokenize_pair_shard, conversation_tokenizer,
                                      shards_of(records, num_proc, ROWS_PER_SHARD), num_proc, progress))
    report_control_text(tokenized.control_text, len(records), "pairs")
    if tokenized.dropped:
        logger.warning("dropped %d pairs whose chosen and rejected answers are identical", tokenized.dropped)
    if tokenized.identical_when_cut:
        logger.warning("dropped %d of %d pairs whose chosen and rejected token ids are identical once cut to "
                       "--max_seq_length %d (the answers differ only past it): nothing to score them on",
                       tokenized.identical_when_cut, len(records), conversation_tokenizer.max_length)
    return tokenized.rows


def tokenize_pair_shard(conversation_tokenizer: ConversationTokenizer,
                        records: list[LocatedRecord]) -> TokenizedShard:
    """[(where, record)] of preference pairs -> their rows, and the pairs dropped: identical answers, and answers
    whose token ids are identical once cut to max_length."""
    rows: dict[str, list[Any]] = {"chosen_input_ids": [], "rejected_input_ids": [], "chosen_answer_start": [],
                                  "rejected_answer_start": [], "margin": [], "length": []}
    identical = 0
    control_text = identical_when_cut = 0
    for where, record in records:
        context, chosen, rejected, margin = preference_of(where, record)
        if chosen.strip() == rejected.strip():
            identical += 1
            continue
        pair = [pair_side(conversation_tokenizer, where, context, answer) for answer in (chosen, rejected)]
        if pair[0].input_ids == pair[1].input_ids:
            identical_when_cut += 1
            continue
        for side, tokenized in zip(("chosen", "rejected"), pair, strict=True):
            rows[f"{side}_input_ids"].append(tokenized.input_ids)
            rows[f"{side}_answer_start"].append(tokenized.answer_start)
        rows["margin"].append(margin)
        rows["length"].append(max(len(side.input_ids) for side in pair))
        control_text += any(side.control_text for side in pair)
    return TokenizedShard(rows, identical, control_text, identical_when_cut=identical_when_cut)


class PairSide(NamedTuple):
    """One answer of a pair tokenized after its context, and where that answer's tokens start (the last trained
    span, which DPO scores)."""

    input_ids: list[int]
    answer_start: int
    control_text: bool  # the side's text held a special token's text


def pair_side(conversation_tokenizer: ConversationTokenizer, where: str, context: list[Message],
              answer: str) -> PairSide:
    """The token ids of the context followed by one answer of a pair, and where that answer's tokens start."""
    sample = conversation_tokenizer(where, context + [{"role": "assistant", "content": answer}])
    if sample is None:
        raise InputError(f"{where}: the prompt alone fills --max_seq_length {conversation_tokenizer.max_length}; "
                         "raise it or shorten the prompt")
    labels = sample["labels"]
    last = max(i for i, label in enumerate(labels) if label != -100)
    answer_start = next(i for i in range(last, -1, -1) if i == 0 or labels[i - 1] == -100)
    return PairSide(sample["input_ids"], answer_start, sample["control_text"])


class DataCollatorForPreferencePairs:
    """The chosen and the rejected sequence of each pair padded together into one batch of 2B
    (chosen first, then rejected), so one forward scores both. Right padding with an attention
    mask from the lengths; the score is read at each row's last attended token.

    share_prefix: one row per pair instead, the tokens both sequences share (the system prompt,
    the question, the template) once, then the chosen answer, then the rejected answer, with
    their own position ids and pair_segments, from which the model builds the mask that keeps
    the rejected answer from seeing the chosen one (models.heads.pair_attention_mask). The same
    scores from a fifth to a half fewer tokens, the longer the shared prompt the more."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 8, share_prefix: bool = False) -> None:
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of
        self.share_prefix = share_prefix

    def padded_width(self, longest: int) -> int:
        return -(-longest // self.multiple) * self.multiple

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        margin = torch.tensor([float(f.get("margin", 0.0)) for f in features], dtype=torch.float32)
        if self.share_prefix:
            return {**self.shared_prefix_rows(features), "margin": margin}
        sequences = [f["chosen_input_ids"] for f in features] + [f["rejected_input_ids"] for f in features]
        width = self.padded_width(max(len(s) for s in sequences))
        input_ids = [list(s) + [self.pad_token_id] * (width - len(s)) for s in sequences]
        attention_mask = [[1] * len(s) + [0] * (width - len(s)) for s in sequences]
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "attention_mask": torch.tensor(attention_mask, dtype=torch.long),
            "margin": margin,
        }

    def shared_prefix_rows(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows: list[tuple[list[int], list[int], list[int]]] = []  # ids, positions, segments
        for feature in features:
            chosen, rejected = list(feature["chosen_input_ids"]), list(feature["rejected_input_ids"])
            shared = 0
            # Each answer keeps at least its last token: that is where its score is read.
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            ids = chosen + rejected[shared:]
            positions = list(range(len(chosen))) + list(range(shared, len(rejected)))
            segments = ([PAIR_PREFIX] * shared + [PAIR_CHOSEN] * (len(chosen) - shared)
                        + [PAIR_REJECTED] * (len(rejected) - shared))
            rows.append((ids, positions, segments))
        width = self.padded_width(max(len(ids) for ids, _, _ in rows))
        batch: dict[str, list[list[int]]] = {"input_ids": [], "position_ids": [], "pair_segments": []}
        for ids, positions, segments in rows:
            pad = width - len(ids)
            batch["input_ids"].append(ids + [self.pad_token_id] * pad)
            batch["position_ids"].append(positions + [0] * pad)
            batch["pair_segments"].append(segments + [PAIR_PADDING] * pad)
        return {name: torch.tensor(values, dtype=torch.long) for name, values in batch.items()}
