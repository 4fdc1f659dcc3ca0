"""--attn_implementation torch_varlen: torch's own variable-length attention kernel
(torch.nn.attention.varlen.varlen_attn, a flash attention kernel on CUDA, torch 2.10 and later) as a transformers
attention implementation, so that --packing runs each packed sample as its own causal sequence on a GPU without the
flash-attn package.

A packed batch carries its samples' bounds (data.build_dataset.flash_varlen_kwargs: cu_seq_lens_q/k,
max_length_q/k, which the collator adds under torch_varlen), and the kernel runs the batch flattened to one sequence
on them. Everything else (an unpacked padded batch, generation with a cache, a layer the kernel cannot run) runs
transformers' sdpa with the mask transformers built for it: the mask function registered with this implementation is
sdpa's, which takes padding, packed samples (from restarting position ids) and sliding windows into account. That
mask is also built, and not used, for a packed batch: [batch, 1, width, width] bools once per forward.

The kernel's signature changed between torch releases; varlen_attention_forward reads it once (kernel_options)."""

import functools
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from lorakit.core.cli import InputError
from lorakit.data.build_dataset import TORCH_VARLEN

logger = logging.getLogger(__name__)


def torch_kernel() -> Callable[..., torch.Tensor] | None:
    """This torch's varlen_attn, or None where it has none (before 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    # Typed as returning (output, aux) too: that is with return_aux, which varlen_attention_forward never passes.
    return cast(Callable[..., torch.Tensor], varlen_attn)


TORCH_KERNEL = torch_kernel()
# The kernel torch_varlen calls: torch's, or in the tests a CPU stand-in of it (torch's runs on CUDA only).
KERNEL = TORCH_KERNEL

# What a layer may ask of attention that the kernel does not do: such a layer runs sdpa with its mask instead.
SDPA_ONLY_KWARGS = ("sliding_window", "softcap", "position_bias", "s_aux")


class KernelOptions(NamedTuple):
    """How a varlen_attn signature takes what differs between torch releases."""

    window_size: bool  # causal as window_size=(-1, 0) (torch 2.13); else is_causal=True (torch 2.10, 2.11)
    enable_gqa: bool  # fewer key/value heads taken as they are; else repeated to the query heads first
    scale: bool  # the softmax scale taken; else folded into the query (the kernel's own is 1/sqrt(head_dim))


@functools.cache
def kernel_options(kernel: Callable[..., torch.Tensor]) -> KernelOptions:
    """The kernel's KernelOptions, from its signature, once per kernel."""
    parameters = inspect.signature(kernel).parameters
    return KernelOptions(*(name in parameters for name in KernelOptions._fields))


def use_torch_varlen(on_gpu: bool, float32_only: bool = False) -> None:
    """Register torch_varlen with transformers (the attention function and sdpa's mask function), so that
    from_pretrained takes the name; or refuse it where this torch cannot run it (on_gpu: whether the run computes on
    a CUDA device; float32_only: float32 weights and no --bf16/--fp16, which the flash kernel does not take). Called
    before any weight is loaded or data is written (models.loader.check_load_plan)."""
    if KERNEL is None:
        raise InputError(f"--attn_implementation {TORCH_VARLEN}: this torch ({torch.__version__}) has no "
                         "torch.nn.attention.varlen (torch 2.10 or later has it); use sdpa or a flash attention")
    if KERNEL is TORCH_KERNEL and not on_gpu:
        raise InputError(f"--attn_implementation {TORCH_VARLEN} runs on a CUDA GPU only (torch's varlen_attn is a "
                         "flash attention kernel); use sdpa on this machine")
    if KERNEL is TORCH_KERNEL and float32_only:
        raise InputError(f"--attn_implementation {TORCH_VARLEN} computes in bfloat16 or float16 only (a flash "
                         "attention kernel): add --bf16 (or --torch_dtype bfloat16), or use sdpa in float32")
    AttentionInterface.register(TORCH_VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(TORCH_VARLEN, sdpa_mask)


class AttentionOutput(NamedTuple):
    """What a transformers attention function returns (unpacked by the attention layer)."""

    output: torch.Tensor  # [batch, width, heads, head_dim]
    weights: None  # attention weights: computed by eager attention only


@functools.cache
def note_sdpa_layer(reason: str) -> None:
    """Once per reason: a packed batch's layer that runs sdpa (correct, but with a full mask and slower)."""
    logger.warning("%s: a layer with %s runs sdpa with its mask instead of varlen_attn", TORCH_VARLEN, reason)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs: Any) -> AttentionOutput:
    """transformers' attention contract, as sdpa_attention_forward's: query [batch, heads, width, head_dim],
    key/value [batch, kv_heads, kv_width, head_dim] -> the output [batch, width, heads, head_dim], and no weights.
    With the batch's sample bounds in kwargs, varlen_attn over the batch flattened to [batch * width, heads,
    head_dim]; without them, sdpa with attention_mask (see the module's docstring)."""
    packed = kwargs.get("cu_seq_lens_q") is not None
    sdpa_only = sdpa_only_reason(dropout, kwargs)
    if not packed or sdpa_only:
        if packed:
            note_sdpa_layer(sdpa_only)
        return AttentionOutput(*sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                                       scaling=scaling, is_causal=is_causal, **kwargs))
    kernel = KERNEL
    assert kernel is not None  # use_torch_varlen registers this function only where there is a kernel
    batch, heads, width, head_dim = query.shape
    if key.shape[2] != width:
        raise ValueError(f"{TORCH_VARLEN}: sample bounds with {key.shape[2]} keys for {width} queries (a cache); "
                         "bounds are for training rows, which have none")
    options = kernel_options(kernel)
    keywords = kernel_keywords(options, is_causal if is_causal is not None else getattr(module, "is_causal", True),
                               grouped=key.shape[1] != heads, scaling=scaling)
    if not options.enable_gqa:
        groups = heads // key.shape[1]
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if not options.scale and scaling is not None and not math.isclose(scaling * math.sqrt(head_dim), 1.0):
        query = query * (scaling * math.sqrt(head_dim))
    output = kernel(flattened(query), flattened(key), flattened(value), kwargs["cu_seq_lens_q"],
                    kwargs["cu_seq_lens_k"], kwargs["max_length_q"], kwargs["max_length_k"], **keywords)
    return AttentionOutput(output.view(batch, width, heads, output.shape[-1]), None)


def sdpa_only_reason(dropout: float, kwargs: dict[str, Any]) -> str | None:
    """What a layer asks of attention that varlen_attn does not do (it has no dropout), if anything."""
    if dropout:
        return "attention dropout"
    return next((name for name in SDPA_ONLY_KWARGS if kwargs.get(name) is not None), None)


def kernel_keywords(options: KernelOptions, causal: bool, grouped: bool, scaling: float | None) -> dict[str, Any]:
    """The keyword arguments of this torch's varlen_attn for a causal (or not) layer, with fewer key/value heads
    than query heads (grouped) or not."""
    keywords: dict[str, Any] = {}
    if options.window_size:
        # A tuple: the kernel compares window_size with (-1, 0) to tell causal attention.
        keywords["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        keywords["is_causal"] = causal
    if options.enable_gqa and grouped:
        keywords["enable_gqa"] = True
    if options.scale:
        keywords["scale"] = scaling
    return keywords


def flattened(states: torch.Tensor) -> torch.Tensor:
    """[batch, heads, width, head_dim] -> [batch * width, heads, head_dim]: the batch as one sequence, in which the
    bounds count."""
    return states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[3])
