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

The command runs the merge's stages, each a module of lorakit.merge: inputs (the base and the adapters, read and
checked), plan (everything checked before anything is written: adapter configs, every tensor's shape against the
base, vocabulary and tokenizer sizes; tied embeddings), output (free disk space, then the files, computed in row
chunks of at most --chunk_mb of float32 into a temporary directory renamed into place only when complete: memory and
safety) and, with --verify, verify. Only torch is imported on this path (transformers and peft cost ~4 s to import;
--verify loads them). An adapter with target_parameters (LoRA on a mixture-of-experts model's fused expert
parameters) is merged instead by lorakit.merge.experts, through peft in memory (about 3 x the base's size).
"""

import argparse
import logging
import resource
import time
from typing import Any, NamedTuple

from lorakit.core.atomic import atomic_output_dir
from lorakit.merge.common import InputError, check_output_dir, run_cli, setup_tool_logging
from lorakit.merge.inputs import BaseModel, check_adapter_bases, read_adapter, read_adapter_config, read_base_model
from lorakit.merge.merge_config import parse_args
from lorakit.merge.output import (
    OutputFile,
    check_free_space,
    parse_size,
    shard_layout,
    warn_about_leftovers,
    write_model,
    write_model_files,
)
from lorakit.merge.plan import (
    MergePlan,
    Workspace,
    check_tokenizer_fits,
    choose_tokenizer,
    plan_classifier_pad_token,
    plan_merge,
    tokenizer_size,
)
from lorakit.merge.verify import verify_or_exit

logger = logging.getLogger("merge_llama_with_lora")


def check_verify_can_load(args: argparse.Namespace, config: dict[str, Any]) -> None:
    """--verify loads the base with transformers: a model with its own code (auto_map) needs --trust_remote_code."""
    if args.verify and config.get("auto_map") and not args.trust_remote_code:
        raise InputError(f"{args.base_model}: --verify loads the model with transformers, which needs the model's "
                         "own Python code (config.json auto_map): add --trust_remote_code if you trust that directory")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start_time = time.perf_counter()
    adapter_paths, max_shard_size = check_arguments(args)
    base = read_base_model(args.base_model)
    check_verify_can_load(args, base.config)
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


def log_plan(plan: MergePlan, base: BaseModel, adapter_count: int, layout: list[OutputFile], total: int) -> None:
    for note in plan.notes:
        logger.info("%s", note)
    base_sources = {id(entry) for entry in base.tensors.values()}
    logger.info("merging %d adapter(s) into %s: %d LoRA updates, %d tensors saved whole by adapters, "
                "%d output file(s), %.1f MB", adapter_count, base.path,
                sum(len(tensor.deltas) for tensor in plan.tensors.values()),
                sum(1 for tensor in plan.tensors.values() if id(tensor.source) not in base_sources),
                len(layout), total / 1e6)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    setup_tool_logging()
    run_cli(main)


if __name__ == "__main__":
    entry_point()
