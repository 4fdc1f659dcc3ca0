"""Inside a child: the packing check of a packed SFT run of ours, before it trains.

The first two packed rows that hold two samples or more, as one batch through the model (the run's collator:
position_ids restarting per sample, and the samples' bounds under a flash attention or torch_varlen), each sample's
mean loss against the same sample run alone; max |diff| <= tolerance (bf16: 2e-2; float32: 1e-4).
Its control must be able to fail: the same packed rows with their restarting position_ids kept (so RoPE is the same)
and a causal mask over each whole row passed as a 4D attention_mask (lorakit.data.build_dataset's
whole_row_causal_mask; transformers takes a 4D mask as it is), so only the attention differs: each sample attends to
the samples before it in its row. Run under the run's own attention where it takes a 4D mask, else (a flash
attention) under sdpa. The check passes when packed = alone and the control differs from alone by at least
CONTROL_MARGIN (10) times the tolerance: a control only just past the tolerance cannot tell a broken separation from
rounding. A control under that is reported as "control could not fail" and the check fails.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from itertools import pairwise
from typing import Any

# Attentions that take a 4D attention_mask as given, and the mask's form: sdpa (and torch_varlen, which runs sdpa
# on a batch without sample bounds) a bool mask, eager and flex_attention an additive one. A flash attention takes
# none: the packing check's control then runs under sdpa.
MASK_FORM = {"sdpa": "bool", "torch_varlen": "bool", "eager": "additive", "flex_attention": "additive"}
# The control must differ from alone by at least this many times the tolerance (issue 44), not merely exceed it.
CONTROL_MARGIN = 10


def sample_spans(position_ids: list) -> list:
    """(start, end) of each sample of a packed row: its positions restart at 0 where a sample starts."""
    starts = [index for index, position in enumerate(position_ids) if position == 0]
    return list(pairwise(starts + [len(position_ids)]))


def check_rows(dataset: Any, count: int = 2) -> list:
    """The first count packed rows that hold two samples or more: in a row of one sample nothing can attend across
    samples, so the control could not differ there (the longest samples, one to a row, come first)."""
    shared = [index for index, positions in enumerate(dataset["position_ids"]) if list(positions).count(0) >= 2]
    return [dataset[index] for index in (shared or range(len(dataset)))[:count]]


def span_losses(logits: Any, labels: Any, spans: list) -> list:
    """Mean next-token cross-entropy (float32) of each sample span of one row whose span has labels."""
    import torch.nn.functional as F

    losses = []
    for start, end in spans:
        targets = labels[start + 1:end]
        keep = targets != -100
        if bool(keep.any()):
            losses.append(float(F.cross_entropy(logits[start:end - 1][keep].float(), targets[keep])))
    return losses


def logits_of(trainer: Any, batch: dict) -> Any:
    """The model's logits for a collated batch (labels left out), without gradients, in the run's precision."""
    import torch

    device = trainer.args.device
    inputs = {name: value.to(device) if hasattr(value, "to") else value  # max_length_q/k are ints
              for name, value in batch.items() if name != "labels"}
    with torch.no_grad(), trainer.accelerator.autocast():
        return trainer.model(**inputs).logits


def packed_row_losses(logits: Any, rows: list) -> list:
    """Each sample's loss in packed rows, from the rows' logits (a sample: where its positions restart at 0)."""
    import torch

    losses = []
    for index, row in enumerate(rows):
        labels = torch.tensor(row["labels"], device=logits.device)
        losses += span_losses(logits[index], labels, sample_spans(row["position_ids"]))
    return losses


def alone_losses(trainer: Any, collator: Callable, rows: list) -> list:
    """Each sample of the packed rows run alone, as an unpacked batch of one."""
    import torch

    losses = []
    for row in rows:
        for start, end in sample_spans(row["position_ids"]):
            sample = {"input_ids": row["input_ids"][start:end], "labels": row["labels"][start:end]}
            labels = torch.tensor(sample["labels"], device=trainer.args.device)
            losses += span_losses(logits_of(trainer, collator([sample]))[0], labels, [(0, end - start)])
    return losses


def control_losses(trainer: Any, packed_batch: dict, rows: list) -> tuple[list, str]:
    """(each sample's loss, the attention it ran under) with the packed rows' restarting position_ids kept (RoPE as
    packed) and a causal mask over each whole row as the 4D attention_mask, which transformers takes as it is: each
    sample attends to the samples before it, the one thing a broken separation would change. The samples' bounds
    are left out (they would separate the samples again); a flash attention takes no 4D mask: sdpa runs it."""
    import torch

    from lorakit.data.build_dataset import whole_row_causal_mask

    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    attention = base.config._attn_implementation
    control_attention = attention if attention in MASK_FORM else "sdpa"
    batch = {name: packed_batch[name] for name in ("input_ids", "labels", "position_ids")}
    form = MASK_FORM[control_attention]
    dtype = torch.bool if form == "bool" else base.get_input_embeddings().weight.dtype
    batch["attention_mask"] = whole_row_causal_mask(*batch["input_ids"].shape, dtype)
    if control_attention != attention:
        base.set_attn_implementation(control_attention)
    try:
        return packed_row_losses(logits_of(trainer, batch), rows), control_attention
    finally:
        if control_attention != attention:
            base.set_attn_implementation(attention)


def control_difference(trainer: Any, packed_batch: dict, rows: list, alone: list) -> tuple:
    """(the control's max |diff| from alone, its attention, why it could not run): a control that cannot run fails
    the check, not the run."""
    try:
        control, control_attention = control_losses(trainer, packed_batch, rows)
        return max(abs(a - b) for a, b in zip(control, alone, strict=True)), control_attention, None
    except Exception as err:  # noqa: BLE001 - whatever stops the control is reported with the check
        return None, None, f"{type(err).__name__}: {err}"[:300]


def packing_check(trainer: Any, collator: Callable, rows: list) -> dict:
    """Each sample's loss in the packed rows (one batch through the run's collator) against the sample run alone,
    and the control (control_losses), which must differ from alone by at least CONTROL_MARGIN x the tolerance for
    the check to pass: a control that cannot fail proves nothing."""
    trainer.model.eval()
    packed_batch = collator([{k: row[k] for k in ("input_ids", "labels", "position_ids")} for row in rows])
    packed = packed_row_losses(logits_of(trainer, packed_batch), rows)
    alone = alone_losses(trainer, collator, rows)
    control_diff, control_attention, control_error = control_difference(trainer, packed_batch, rows, alone)
    trainer.model.train()
    tolerance = 2e-2 if trainer.args.bf16 else 1e-4
    packed_diff = max(abs(a - b) for a, b in zip(packed, alone, strict=True))
    control_bound = CONTROL_MARGIN * tolerance
    equal, control_differs = packed_diff <= tolerance, control_diff is not None and control_diff >= control_bound
    verdict = ("passes" if equal and control_differs else "packed != alone" if not equal
               else f"control could not run: {control_error}" if control_error
               else f"control could not fail (differs by {control_diff:.1e} < {CONTROL_MARGIN} x the tolerance)")
    return {"samples": len(alone), "mean_loss": statistics.mean(alone), "packed_max_abs_diff": packed_diff,
            "control_max_abs_diff": control_diff, "control_attention": control_attention,
            "control_mask": "lorakit.data.build_dataset.whole_row_causal_mask", "tolerance": tolerance,
            "control_required_abs_diff": control_bound,
            "equal": equal, "control_differs": control_differs, "passes": equal and control_differs,
            "verdict": verdict}
