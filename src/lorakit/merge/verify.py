"""--verify for the LoRA merge: the merged model's logits against peft's own merge of base + adapters (and against
the unmerged model as trained), and the exit 1 that keeps a merge above --verify_tolerance from being published.
transformers and peft are imported inside the functions, when --verify runs: the streaming merge itself needs torch
alone."""

import argparse
import logging
import sys
from typing import Any, NamedTuple

import torch

from lorakit.merge.common import tokenizer_files
from lorakit.merge.plan import OUTPUT_EMBEDDING, MergePlan, input_embedding_name

logger = logging.getLogger("merge_llama_with_lora")

VERIFY_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "我们今天学习中文模型的训练和词表扩展。",
    "def add(a, b):\n    return a + b  # 🎉",
)


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
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    transformers.logging.set_verbosity_error()
    auto = AutoModelForSequenceClassification if plan.sequence_classification else AutoModelForCausalLM
    extra: dict[str, Any] = ({"num_labels": plan.tensors["score.weight"].shape[0]}
                             if plan.sequence_classification else {})
    if trust_remote_code:
        logger.warning("--trust_remote_code: running the model's own code from %s", base_path)
    base = auto.from_pretrained(base_path, dtype=torch.float32, trust_remote_code=trust_remote_code, **extra)
    reference = peft_reference(base, adapter_paths, plan)
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
            dtype = written.get(name, written.get(embed) if name == OUTPUT_EMBEDDING and embed is not None else None)
            if dtype in (torch.float16, torch.bfloat16):
                parameter.copy_(parameter.to(dtype).float())
        difference = max((reference(input_ids=ids).logits - out).abs().max().item()
                         for ids, out in zip(batches, outputs, strict=True))
    return LogitDifferences(difference, as_trained)


def peft_reference(base: Any, adapter_paths: list[str], plan: MergePlan) -> Any:
    """base with the adapters applied by peft, in eval mode: each but the last merged, the last on top unmerged.
    Any: the base model, then peft's wrapper of it, then the merged model (no one class)."""
    from peft import PeftModel

    reference = base
    for i, adapter_path in enumerate(adapter_paths):
        rows = plan.embedding_rows_after[i]
        if rows is not None and rows != reference.get_input_embeddings().weight.shape[0]:
            reference.resize_token_embeddings(rows, mean_resizing=False)  # the adapter carries the rows
        reference = PeftModel.from_pretrained(reference, adapter_path)
        if i < len(adapter_paths) - 1:
            reference = reference.merge_and_unload()
    reference.eval()
    return reference


def verify_batches(tokenizer_dir: str, vocab_rows: int | None, trust_remote_code: bool) -> list[torch.Tensor]:
    """--verify's inputs: VERIFY_PROMPTS in the tokenizer of tokenizer_dir, or random ids where it holds none."""
    from transformers import AutoTokenizer

    if tokenizer_files(tokenizer_dir):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
        return [tokenizer(prompt, return_tensors="pt")["input_ids"] for prompt in VERIFY_PROMPTS]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(vocab_rows or 2, (1, 16), generator=generator) for _ in VERIFY_PROMPTS]


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
