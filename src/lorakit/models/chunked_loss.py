"""Token log-probabilities and the causal-LM cross-entropy computed from hidden states over chunks of
positions, so that no float32 [positions, vocabulary] tensor of the whole batch is ever held.

At a 152k vocabulary the logits of 8 x 4096 positions are 20 GB in float32, and transformers' loss
upcasts a second copy. Here the LM head runs on one chunk of hidden states at a time (at most
LOGITS_PER_CHUNK logits, 64 MB in float32), each chunk is reduced at once to one value per position,
and under autograd each chunk is checkpointed: the backward pass recomputes its logits chunk by
chunk instead of keeping every chunk's for it. The head is called as the module it is (an
nn.Linear, peft's ModulesToSaveWrapper of a trained lm_head, a LoRA layer on it), so adapters,
trained copies and tied weights get their gradients as in the model's own forward.

Torch only: the trainers pass the head module and its hidden states."""

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lorakit.models.router import causal_model

if TYPE_CHECKING:  # torch only at run time
    from peft import PeftModel
    from transformers import PreTrainedModel

# Logits computed at once: chunks hold LOGITS_PER_CHUNK // vocabulary positions (110 at a 152k vocabulary,
# 512 at 32k: each chunk's matmul still fills a GPU; its float32 logits and their softmax take 128 MB).
LOGITS_PER_CHUNK = 1 << 24
IGNORE_INDEX = -100
# torch checkpoint's context_fn: the (forward, recompute) context managers of a checkpointed chunk.
RecomputeContext = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]


class ForwardOutput(Protocol):
    """What is read of a causal LM's forward output, by its fields: transformers' CausalLMOutputWithPast and its
    variants (a mixture of experts' MoeCausalLMOutputWithPast, ...), which share no base class with these fields."""

    @property
    def logits(self) -> torch.Tensor: ...

    @property
    def hidden_states(self) -> tuple[torch.Tensor, ...] | None: ...


def head_width(head: torch.nn.Module) -> int:
    """The head's output width, the vocabulary: its weight's rows (under ZeRO-3 the partitioned weight's ds_shape),
    or out_features where the weight is a quantized pack. Not out_features first: peft's ModulesToSaveWrapper of a
    tied lm_head (--modules_to_save embed_tokens,lm_head with ensure_weight_tying) reports the hidden size there,
    which made each chunk vocabulary/hidden times too wide."""
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        shape = tuple(getattr(weight, "ds_shape", None) or weight.shape)
        if len(shape) == 2:
            return shape[0]
    return getattr(head, "out_features", None) or 1


def positions_per_chunk(width: int) -> int:
    """Positions per chunk for a head `width` logits wide (estimate_memory sizes its loss term with it)."""
    return max(1, LOGITS_PER_CHUNK // max(1, width))


def chunk_positions(head: torch.nn.Module) -> int:
    """Positions per chunk for a head of its output width."""
    return positions_per_chunk(head_width(head))


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature) at each label, in float32: [..., V] and [...] -> [...]. The same
    reduction as rl.rl_math.logprobs_from_logits: the label's logit minus the logsumexp."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_logprobs(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    return label_logprobs(head(hidden), labels, temperature)


def partitioned_across_ranks(head: torch.nn.Module) -> bool:
    """Whether calling the head is a collective: under DeepSpeed ZeRO-3 with several ranks each call gathers
    its partitioned parameters from every rank, so every rank must call it as often as the others."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1 and any(hasattr(p, "ds_id") for p in head.parameters()))


def max_across_ranks(value: int, device: torch.device) -> int:
    count = torch.tensor([value], device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return int(count.item())


def agreed_across_ranks(flag: bool, head: torch.nn.Module, device: torch.device) -> bool:
    """flag where every rank found it (a partitioned head: ranks taking different paths would wait forever on
    each other's gathers), else this rank's own flag."""
    if not partitioned_across_ranks(head):
        return flag
    return max_across_ranks(int(not flag), device) == 0


def token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, temperature: float = 1.0,
                   recompute_context: RecomputeContext | None = None) -> torch.Tensor:
    """log softmax(head(hidden) / temperature) at each label: hidden [..., H], labels [...] (valid ids)
    -> [...] float32, chunk_positions(head) positions at a time.

    Under ZeRO-3 every rank runs as many chunks as the rank with the most positions: the extra ones on one
    position, weighted 0 in the result, so that each rank gathers the head's weight as often in the forward
    and in the backward pass (different counts hang the job).

    recompute_context: torch checkpoint's context_fn, for a head whose behaviour depends on state
    that may change before the backward pass (the PPO policy's active adapter)."""
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    size = chunk_positions(head)
    chunks = [(flat_hidden[start : start + size], flat_labels[start : start + size])
              for start in range(0, flat_labels.numel(), size)]
    padding = 0
    if partitioned_across_ranks(head):
        padding = max_across_ranks(len(chunks), flat_hidden.device) - len(chunks)
    if padding:
        # One position (of this rank's own, or a zero one joined to hidden's graph), run like a real chunk.
        spare = (flat_hidden[:1], flat_labels[:1]) if chunks else (
            flat_hidden.new_zeros(1, flat_hidden.shape[-1]) + flat_hidden.sum(), flat_labels.new_zeros(1))
    # No check of the recomputed tensors' shapes: under ZeRO-3 the head's weight is saved as the partitioned
    # parameter, released (empty) after each forward and gathered again by DeepSpeed before its backward.
    options: dict[str, Any] = {"use_reentrant": False, "determinism_check": "none",
                               **({"context_fn": recompute_context} if recompute_context else {})}

    def run(chunk_hidden: torch.Tensor, chunk_labels: torch.Tensor) -> torch.Tensor:
        # Checkpointed, a chunk keeps only its inputs for the backward pass, not its [chunk, V] logits.
        if torch.is_grad_enabled():
            return checkpoint(_chunk_logprobs, head, chunk_hidden, chunk_labels, temperature, **options)
        return _chunk_logprobs(head, chunk_hidden, chunk_labels, temperature)

    pieces = [run(*chunk) for chunk in chunks]
    result = torch.cat(pieces) if pieces else flat_hidden.sum(-1).float()
    for _ in range(padding):
        result = result + 0.0 * run(*spare).sum()
    return result.reshape(labels.shape)


def causal_lm_loss(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor | None = None,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' causal-LM loss (ForCausalLMLoss) from the last hidden states [B, T, H]: position t
    predicts labels[t + 1] (or shift_labels[t], already shifted, as a collator may give them), -100
    ignored; the sum over predicted tokens divided by num_items_in_batch (the Trainer's count over the
    whole accumulated batch) when given, else their mean. Only positions with a label reach the head."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    targets = shift_labels.reshape(-1).to(hidden.device)
    labelled = targets != IGNORE_INDEX
    rows, weight = torch.nonzero(labelled).squeeze(-1), 1.0
    if rows.numel() == 0:
        # Still through the head, weighted 0: a data-parallel step expects every trained weight's gradient.
        rows, weight = rows.new_zeros(1), 0.0
    logprobs = token_logprobs(hidden.reshape(-1, hidden.shape[-1])[rows], head, targets[rows].clamp(min=0))
    denominator = labelled.sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(denominator):
        denominator = denominator.to(logprobs.device)
    return -logprobs.sum() * weight / denominator


def head_gives_logits(head: torch.nn.Module, outputs: ForwardOutput) -> bool:
    """Whether the head applied to a forward's last hidden states gives the logits that forward returned, at the
    last position (a forward run with output_hidden_states, with or without logits_to_keep=1): False where the
    model soft-caps or scales its logits after the head (Gemma-2's final_logit_softcapping, say)."""
    if not outputs.hidden_states:
        return False
    recomputed = head(outputs.hidden_states[-1][:, -1:]).float()
    returned = outputs.logits[:, -1:].float()
    return recomputed.shape == returned.shape and torch.allclose(recomputed, returned, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def head_reproduces_logits(model: "PreTrainedModel | PeftModel", model_inputs: dict[str, torch.Tensor]) -> bool:
    """Whether the chunked loss equals the model's own: its forward takes logits_to_keep (so that it can
    skip the full logits), and its output embeddings applied to hidden_states[-1] give the logits its
    forward returns (head_gives_logits). model: the unwrapped (peft) causal LM; checked on model_inputs
    (no labels) in eval mode, where dropout cannot make the two differ."""
    base = causal_model(model)
    head = model.get_output_embeddings()
    if head is None or "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return False
    was_training = model.training
    model.eval()
    try:
        return head_gives_logits(head, model(**model_inputs, output_hidden_states=True, logits_to_keep=1))
    finally:
        model.train(was_training)
