"""The one way to reach ZeRO-3 partitioned weights. Under ZeRO-3 each rank holds a shard of every
parameter (its shape reads 0); code that reads or writes a whole weight gathers it first. Outside
ZeRO-3 (no parameter carries a DeepSpeed id) this is a no-op, so callers never branch on it."""

import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # deepspeed is imported only where ZeRO-3 is in use
    from deepspeed import DeepSpeedEngine


def weight_of(module: torch.nn.Module) -> torch.nn.Parameter:
    """module.weight as the Parameter it is (a partitioned one under ZeRO-3; peft's wrappers of a layer hand on their
    base layer's): nn.Module's __getattr__ types any attribute as a Tensor or a Module."""
    return cast(torch.nn.Parameter, module.weight)


def is_zero3_partitioned(params: Iterable[torch.nn.Parameter]) -> bool:
    return any(hasattr(p, "ds_id") for p in params)


@contextmanager
def gathered(params: Iterable[torch.nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """Full copies of ZeRO-3 partitioned parameters inside the block. modifier_rank=None: read
    only, on every rank; modifier_rank=0: rank 0's in-place changes are scattered back on exit.
    Collective: every rank must enter with the same parameters."""
    params = list(params)
    context: AbstractContextManager
    if is_zero3_partitioned(params):
        import deepspeed

        context = deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)
    else:
        context = nullcontext()
    with context:
        yield


def full_size_bytes(params: Iterable[torch.nn.Parameter]) -> int:
    """Bytes of the parameters at their whole shape (a ZeRO-3 partitioned one by its ds_numel), in their dtype."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)


def free_memory_bytes(device: torch.device) -> int:
    """What one process may still fill on device: the GPU's free memory, or on the CPU the available
    RAM shared among this node's processes (torchrun's LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def on_every_rank(flag: bool, device: torch.device) -> bool:
    """flag where every rank holds it: a choice of which collectives run must be the same on all ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


@contextmanager
def gathered_for_generation(engine: "DeepSpeedEngine", module: torch.nn.Module) -> Iterator[None]:
    """module's ZeRO-3 parameters gathered once for the whole block, with the engine's per-module hooks off
    meanwhile: left on, they re-partition each layer after its forward and gather it again for the next
    token. On exit the hooks are registered again (DeepSpeed invalidates its recorded fetch order then)
    before the parameters are re-partitioned. TRL's unwrap_model_for_generation does the same. Collective:
    every rank enters with the same engine and module."""
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    with gathered(module.parameters()):
        for param in offload.module.parameters():
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)
