"""Faster kernels through TrainingArguments' own flags: --torch_compile compiles each decoder layer in place (regional
compilation: one compile serves every layer, as the layers share code and shapes) instead of the Trainer's whole-model
torch.compile; --use_liger_kernel is the Trainer's own Liger patching, where liger_kernel imports."""

import importlib.util
import logging

from torch import nn

from lorakit.core.cli import InputError
from lorakit.models.router import causal_model

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: its decoder's `layers` where transformers names them so, else its largest
    ModuleList whose members are all of one class (a model of its own code; its experts' list could be longer than
    its layers, so the decoder's own name comes first)."""
    # getattr: transformers' get_decoder is no attribute nn.Module's typing knows of.
    get_decoder = getattr(causal_model(model), "get_decoder", None)
    layers = getattr(get_decoder(), "layers", None) if get_decoder is not None else None
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return layers
    candidates = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module) > 0
                  and len({type(member) for member in module}) == 1]
    if not candidates:
        raise InputError(f"--torch_compile: {type(model).__name__} has no repeated layers to compile")
    return max(candidates, key=len)


def compile_decoder_layers(model: nn.Module, backend: str | None, mode: str | None) -> int:
    """Compile each decoder layer in place (nn.Module.compile): the module tree, its parameter names and its PEFT
    and DeepSpeed hooks stay what they were, so checkpoints, the chunked loss's head and LoRA's adapters see the
    same model. dynamic=None lets torch recompile once for varying lengths, then treat them as dynamic. The number
    of layers compiled."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend or "inductor", mode=mode, dynamic=None)
    logger.info("--torch_compile: %d %s layers compiled (backend %s%s)", len(layers), type(layers[0]).__name__,
                backend or "inductor", f", mode {mode}" if mode else "")
    return len(layers)


def check_liger_importable() -> None:
    """--use_liger_kernel where liger_kernel does not import (it needs triton and a CUDA GPU): one line, not the
    Trainer's ImportError at the start of training."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise InputError("--use_liger_kernel: liger_kernel is not installed (pip install liger-kernel; its kernels "
                         "run on a CUDA GPU); drop the flag")
