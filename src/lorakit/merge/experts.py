"""Merging adapters that put LoRA on a mixture-of-experts model's fused expert parameters (peft's
target_parameters, e.g. "mlp.experts.gate_up_proj" [experts, 2 x intermediate, hidden]), through peft in memory.

Why not the streaming merge: transformers 5 fuses the per-expert tensors a checkpoint stores
(experts.N.gate_proj.weight, Mixtral's block_sparse_moe.experts.N.w1.weight, ...) into 3-D parameters at load and
splits them again at save_pretrained, by rules it keeps per architecture (its conversion mapping). Streaming would
have to invert those rules tensor by tensor; loading the model with transformers, merging with peft's
merge_and_unload and saving with save_pretrained writes exactly the layout transformers loads, for every
architecture peft and transformers support, at the price of memory: the whole base is held (see
PEAK_TIMES_THE_BASE).

The contract is the streaming merge's: every check (adapter configs, the recorded base, every adapter tensor's
shape against the base, the tokenizer's size, free space, the output directory) runs before any weight is loaded
or anything written; shapes are checked by loading the adapters into a skeleton of the model on the meta device,
which holds no memory. The result is built in a temporary sibling and renamed into place when complete."""

import argparse
import logging
import math
import os
import resource
import time
import warnings
from collections import Counter
from typing import Any

import torch

from lorakit.core.atomic import atomic_output_dir
from lorakit.core.model_files import check_recorded_base, expert_parameter_targets, expert_wrapper, lora_key_modules
from lorakit.merge.common import InputError
from lorakit.merge.inputs import (
    BaseModel,
    check_adapter_bases,
    check_adapter_config,
    read_adapter_config,
    read_adapter_tensors,
)
from lorakit.merge.output import check_free_space, copy_code_and_tokenizer, warn_about_leftovers
from lorakit.merge.plan import INPUT_EMBEDDING_SUFFIXES, choose_tokenizer, tokenizer_size
from lorakit.merge.verify import check_verified, verify_batches

logger = logging.getLogger("merge_llama_with_lora")

# This path's peak RSS above the torch + transformers + peft runtime, in multiples of the base's size on disk,
# measured on the CPU (docs/merge-and-vocabulary.md, "Adapters on experts": 2.8 x on a 356 MB Qwen3-MoE): the base's
# files mapped by the loader (~0.9 x, file pages the kernel can reclaim), the fused model (~1.15 x) and the
# per-expert copies save_pretrained makes of the fused tensors while it writes.
PEAK_TIMES_THE_BASE = 3
ALLOWED_FEATURES = frozenset({"target_parameters"})


def merge_expert_adapters(args: argparse.Namespace, adapter_paths: list[str], base: BaseModel,
                          max_shard_size: int | None, start_time: float) -> None:
    """merge_llama_with_lora's main() for a chain of adapters of which at least one has target_parameters."""
    check_expert_arguments(args, adapter_paths, base)
    check_adapter_bases(args.base_model, adapter_paths, args.allow_other_base)
    tokenizer_dir, tokenizer_names = choose_tokenizer(args.base_model, adapter_paths)
    tokens = tokenizer_size(tokenizer_dir) if tokenizer_names else None
    vocab_rows = dry_run(base, adapter_paths, args.trust_remote_code)
    if tokens is not None and vocab_rows is not None and tokens > vocab_rows:
        raise InputError(f"{tokenizer_dir}: the tokenizer has {tokens} tokens but the merged embeddings have "
                         f"{vocab_rows} rows: ids past the last row would crash the model "
                         "(was the adapter trained with this tokenizer and --modules_to_save embed_tokens,lm_head?)")
    base_bytes = sum(math.prod(entry.shape) * entry.dtype.itemsize for entry in base.tensors.values())
    warn_about_leftovers(args.output_dir)
    check_free_space(args.output_dir, base_bytes)
    logger.info("expert adapter (target_parameters): merged through peft in memory; peak ~ %d x the base (%.1f MB "
                "here)", PEAK_TIMES_THE_BASE, base_bytes / 1e6)
    # Without --max_shard_size no file outgrows the base's largest, so the output is sharded about as the base is.
    shard_limit = max_shard_size or max(os.path.getsize(os.path.join(base.path, name)) for name in base.files)

    model = load_and_merge(base, adapter_paths, vocab_rows, args.trust_remote_code)
    references = reference_logits(model, tokenizer_dir, vocab_rows, args.trust_remote_code) if args.verify else None
    with atomic_output_dir(args.output_dir) as tmp:
        model.save_pretrained(tmp, max_shard_size=shard_limit, save_original_format=True)
        del model  # --verify reloads the written copy: never two models at once
        copy_code_and_tokenizer(base.path, tokenizer_dir, tokenizer_names, tmp)
        merge_seconds = time.perf_counter() - start_time
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if references is not None:
            verify_written(args, tmp, references, tokenizer_dir, vocab_rows)
    files = [name for name in os.listdir(args.output_dir) if name.endswith(".safetensors")]
    total = sum(os.path.getsize(os.path.join(args.output_dir, name)) for name in files)
    print(f"merged {len(adapter_paths)} adapter(s) into {args.output_dir} through peft (expert adapter): "
          f"{len(files)} file(s), {total / 1e6:.1f} MB, vocab {vocab_rows}, {merge_seconds:.1f}s, "
          f"peak RSS {peak_mb:.0f} MiB", flush=True)


def check_expert_arguments(args: argparse.Namespace, adapter_paths: list[str], base: BaseModel) -> None:
    """What this path cannot do, refused in one line before anything is loaded."""
    for path in adapter_paths:
        config = read_adapter_config(path)
        check_adapter_config(os.path.join(path, "adapter_config.json"), config, allowed=ALLOWED_FEATURES)
        check_recorded_base(path, config, base.config, "--lora_model")
        if config.get("task_type") == "SEQ_CLS":
            raise InputError(f"{path}: a sequence-classifier (reward model) adapter with target_parameters is not "
                             "supported by this merge")
    if base.config.get("auto_map") and not args.trust_remote_code:
        raise InputError(f"{args.base_model}: an expert adapter (target_parameters) is merged in transformers, which "
                         "needs the model's own Python code (config.json auto_map): add --trust_remote_code if you "
                         "trust that directory")


def base_dtype(base: BaseModel) -> torch.dtype:
    """The floating dtype holding most of the base's bytes: the model is loaded, merged and written in it."""
    sizes: Counter[torch.dtype] = Counter()
    for entry in base.tensors.values():
        if entry.dtype.is_floating_point:
            sizes[entry.dtype] += math.prod(entry.shape) * entry.dtype.itemsize
    return sizes.most_common(1)[0][0] if sizes else torch.float32


def saved_embedding_rows(adapter_path: str) -> int | None:
    """Rows of the input embedding the adapter saved whole (modules_to_save on a resized vocabulary), or None."""
    _, tensors = read_adapter_tensors(adapter_path)
    for key, entry in tensors.items():
        name = key.replace(".modules_to_save.", ".").replace(".base_layer.", ".")
        if ".lora_" not in name and ".original_module." not in name and name.endswith(INPUT_EMBEDDING_SUFFIXES):
            return entry.shape[0]
    return None


def wrapped_parameters(module: Any, module_name: str, targets: list[str]) -> list[str]:
    """The parameters of `module` (named module_name in the model) that peft's target_parameters wrap: it matches
    each target against the end of a parameter's full name."""
    full_names = (f"{module_name}.{name}" for name, _ in module.named_parameters(recurse=False))
    return [full for full in full_names if any(full == target or full.endswith(f".{target}") for target in targets)]


def check_adapter_taken(model: Any, path: str, base_path: str) -> None:
    """Refuse an adapter on fused experts (target_parameters) with LoRA keys the model would not take: peft loads the
    rest and only warns about "unexpected adapter keys" (the expert LoRA of a mixture of experts onto a dense base
    with the same attention: the merge would drop the experts' training and exit 0). Each LoRA module must be one of
    the model's, and one peft reaches through target_parameters must hold a parameter they name. From the adapter's
    files, whatever wrote it (lorakit_base.json or not), against the model transformers builds. An adapter without
    target_parameters is left to peft: one written under transformers 4 names modules that peft renames for 5."""
    config = read_adapter_config(path)
    if not config.get("target_parameters"):
        return
    weights_file, tensors = read_adapter_tensors(path)
    targets = expert_parameter_targets(config.get("target_parameters"))
    modules = dict(model.named_modules())
    dropped = []
    for name, keys in lora_key_modules(tensors).items():
        module = modules.get(name)
        if module is None or (expert_wrapper(name, config) and not wrapped_parameters(module, name, targets)):
            dropped += keys
    if dropped:
        experts = any(expert_wrapper(lora_module, config) for lora_module in lora_key_modules(dropped))
        what, hint = ((f"expert LoRA keys (target_parameters {targets})", " (trained on a mixture of experts, "
                       "merged onto a dense base?)") if experts else ("LoRA keys", ""))
        raise InputError(f"{weights_file}: the --lora_model adapter does not fit the base {base_path}: "
                         f"{len(dropped)} of its {what}, e.g. {dropped[0]}, name weights the base does not have; "
                         f"peft would drop them and merge the rest: an adapter for another model{hint}")


def apply_adapters(model: Any, adapter_paths: list[str], base_path: str) -> Any:
    """model with every adapter merged in order (a later adapter was trained on the merge of the earlier ones)."""
    from peft import PeftModel

    for path in adapter_paths:
        check_adapter_taken(model, path, base_path)
        rows = saved_embedding_rows(path)
        if rows is not None and rows != model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(rows, mean_resizing=False)  # the adapter carries the rows
        try:
            model = PeftModel.from_pretrained(model, path).merge_and_unload()
        except (RuntimeError, ValueError, KeyError) as err:
            # peft lists every mismatching tensor, one a line: the first names the problem.
            first = str(err).strip().splitlines()
            detail = next((line.strip() for line in first if "mismatch" in line or "not found" in line), first[0])
            detail = detail.rstrip(".")
            raise InputError(f"{path}: the adapter does not fit the base model: {detail}: an adapter for another "
                             "model?") from None
    return model


def dry_run(base: BaseModel, adapter_paths: list[str], trust_remote_code: bool) -> int | None:
    """Load the adapters into a skeleton of the base on the meta device (no memory, no weights read): peft refuses
    any tensor whose shape is not the base's. Returns the input embedding's rows after the adapters."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(base.path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    with warnings.catch_warnings():
        # Copying the adapter's tensors into meta parameters is a no-op torch warns about, once per tensor.
        warnings.simplefilter("ignore")
        model = apply_adapters(model, adapter_paths, base.path)
    embeddings = model.get_input_embeddings()
    return embeddings.weight.shape[0] if embeddings is not None else None


def load_and_merge(base: BaseModel, adapter_paths: list[str], vocab_rows: int | None, trust_remote_code: bool) -> Any:
    """The base loaded by transformers in its own dtype, every adapter merged in by peft."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base.path, dtype=base_dtype(base), trust_remote_code=trust_remote_code)
    model = apply_adapters(model.eval(), adapter_paths, base.path)
    if vocab_rows is not None and model.config.vocab_size != vocab_rows:
        model.config.vocab_size = vocab_rows
    return model


def reference_logits(model: Any, tokenizer_dir: str, vocab_rows: int | None,
                     trust_remote_code: bool) -> list[torch.Tensor]:
    """--verify: the merged model's float32 logits on the verify prompts, before it is written."""
    with torch.no_grad():
        return [model(input_ids=ids).logits.float() for ids in verify_batches(tokenizer_dir, vocab_rows,
                                                                                trust_remote_code)]


def verify_written(args: argparse.Namespace, merged_dir: str, references: list[torch.Tensor], tokenizer_dir: str,
                   vocab_rows: int | None) -> None:
    """--verify: the written model, loaded back by transformers, computes the logits of peft's merge in memory
    (this checks the write, in particular the split of fused experts back to the checkpoint's layout); exit 1 and
    publish nothing above --verify_tolerance."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir, trust_remote_code=args.trust_remote_code).eval()
    with torch.no_grad():
        difference = max((merged(input_ids=ids).logits.float() - reference).abs().max().item() for ids, reference
                         in zip(verify_batches(tokenizer_dir, vocab_rows, args.trust_remote_code), references,
                                strict=True))
    print(f"verify: max abs logit difference, peft's merge in memory vs written: {difference:.3g} "
          f"(tolerance {args.verify_tolerance:g})", flush=True)
    check_verified(args, difference, "the written model's")
