"""The one way to reach ZeRO-3 partitioned weights. Under ZeRO-3 each rank holds a shard of every
parameter (its shape reads 0); code that reads or writes a whole weight gathers it first. Outside
ZeRO-3 (no parameter carries a DeepSpeed id) this is a no-op, so callers never branch on it."""

from contextlib import contextmanager, nullcontext


def is_zero3_partitioned(params) -> bool:
    return any(hasattr(p, "ds_id") for p in params)


@contextmanager
def gathered(params, modifier_rank=None):
    """Full copies of ZeRO-3 partitioned parameters inside the block. modifier_rank=None: read
    only, on every rank; modifier_rank=0: rank 0's in-place changes are scattered back on exit.
    Collective: every rank must enter with the same parameters."""
    params = list(params)
    if is_zero3_partitioned(params):
        import deepspeed

        context = deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)
    else:
        context = nullcontext()
    with context:
        yield
