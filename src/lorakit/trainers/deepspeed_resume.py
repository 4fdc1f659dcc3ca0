"""A DeepSpeed resume that loads tensors, not code. DeepSpeed 0.19 reads its checkpoint files with
torch.load(weights_only=False), which unpickles them: a checkpoint someone sends you runs whatever its pickles name.
Here torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD overrides that for the duration of the load, with the few DeepSpeed
classes its files hold allowed (ALLOWED_DEEPSPEED_GLOBALS), and every file of the checkpoint is read that way first,
on every rank, so that a file naming anything else is refused in one line (exit 2) naming the file and the global,
the same on every rank, before DeepSpeed reads any of them."""

import glob
import importlib
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lorakit.core.cli import InputError
from lorakit.data.run_record import START_AFRESH

FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # torch refuses both set: a user's is set aside meanwhile

# Every global beyond tensors and plain containers that DeepSpeed 0.19.8 pickles into the checkpoints of the shipped
# configs (ZeRO-2, ZeRO-3, ZeRO-3 offload): found by loading each file with weights_only=True and allowing what it
# refused, one at a time, on the Trainer's checkpoints in fp32 and bf16 (two processes on a CPU) and on a tiny
# engine's in fp16 (DeepSpeed refuses fp16 on a CPU; its check bypassed for the probe). The tests keep it true:
# test_pretraining.py::test_deepspeed_two_processes reads each config's files, test_deepspeed_resume.py fp16's loss
# scaler. None defines __setstate__: unpickling one sets its attributes and runs none of its code.
ALLOWED_DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # the optimizer's loss scale in fp32 and bf16 (static, 1)
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",  # and in fp16 (its scale, window, hysteresis)
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # the ZeRO stage the optimizer states were written by
    "deepspeed.utils.tensor_fragment.fragment_address",  # ZeRO-1/2's param_slice_mappings (numel, start)
)


def allowed_deepspeed_globals() -> list[Any]:
    """The allowed classes, imported. One this DeepSpeed no longer has is left out: a file naming it is then
    refused in one line naming it, as any other."""
    found = []
    for name in ALLOWED_DEEPSPEED_GLOBALS:
        module, _, attribute = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError):
            continue
    return found


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every torch.load in the block is weights_only, whatever its caller passes, with ALLOWED_DEEPSPEED_GLOBALS
    allowed; the environment as it was afterwards."""
    saved = {name: os.environ.get(name) for name in (FORCE_WEIGHTS_ONLY, FORCE_NO_WEIGHTS_ONLY)}
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    os.environ.pop(FORCE_NO_WEIGHTS_ONLY, None)
    try:
        with torch.serialization.safe_globals(allowed_deepspeed_globals()):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def refused_global(error: Exception) -> str:
    """What torch's weights-only unpickler refused, from its message: the global it names, else its own line."""
    message = str(error)
    found = re.search(r"GLOBAL (\S+)", message)
    if found:
        return f"the global {found.group(1)}"
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "WeightsUnpickler error" in line or "Unsupported" in line),
                lines[-1] if lines else type(error).__name__)


def refusal(path: str, error: Exception) -> InputError:
    return InputError(f"{path}: this DeepSpeed checkpoint file pickles {refused_global(error)}, which DeepSpeed's "
                      "own files do not hold: loading it could run code (a checkpoint from elsewhere, or edited?); "
                      f"resume only a checkpoint whose origin you trust, or {START_AFRESH}")


def check_deepspeed_files(checkpoint: str) -> None:
    """Read every file of the checkpoint's DeepSpeed tags (global_step*/) as the load will, weights only. The
    tensors of torch's zip format (what DeepSpeed writes) are mapped, not read (mmap), so this costs the files'
    pickled structure; a file in another format (a bare pickle) is read whole. Every rank reads every rank's files,
    so that a planted file refuses the resume on all ranks alike instead of leaving the others waiting."""
    for path in sorted(glob.glob(os.path.join(checkpoint, "global_step*", "**", "*.pt"), recursive=True)):
        try:
            with weights_only_loads():
                torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
        except pickle.UnpicklingError as err:
            raise refusal(path, err) from None
        except Exception as err:  # noqa: BLE001 - any other failure here means the file is unusable
            first = (str(err).strip().splitlines() or [""])[0]
            raise InputError(f"{path}: cannot be read as a DeepSpeed checkpoint file ({type(err).__name__}: "
                             f"{first})") from None


def load_deepspeed_checkpoint(engine: Any, checkpoint: str, load_module_strict: bool) -> None:
    """transformers' deepspeed_load_checkpoint (the Trainer's DeepSpeed resume: weights, optimizer and scheduler
    states), its files checked first and its torch.loads forced to weights only."""
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint

    check_deepspeed_files(checkpoint)
    with weights_only_loads():
        try:
            deepspeed_load_checkpoint(engine, checkpoint, load_module_strict=load_module_strict)
        except pickle.UnpicklingError as err:  # a file outside global_step*/ that DeepSpeed read
            raise refusal(checkpoint, err) from None
