"""A DeepSpeed resume loads tensors, not code (trainers.deepspeed_resume): a checkpoint file that pickles anything
beyond DeepSpeed's own few classes is refused in one line naming the file and the global, and what it names never
runs; the files DeepSpeed writes in fp32, bf16 and fp16 load weights-only; the environment is as it was after. The
Trainer's own checkpoints of every shipped DeepSpeed config, and a planted one refused on every rank through a real
resume, are checked by tests/trainers/test_pretraining.py::test_deepspeed_two_processes (slow)."""

import os

import pytest
import torch

from lorakit.core.cli import InputError
from lorakit.trainers.deepspeed_resume import (
    FORCE_NO_WEIGHTS_ONLY,
    FORCE_WEIGHTS_ONLY,
    check_deepspeed_files,
    load_deepspeed_checkpoint,
    weights_only_loads,
)


class RunsCode:
    """What a checkpoint from elsewhere can pickle: unpickling it calls os.makedirs(path)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path,)


class OtherClass:
    """Any class but DeepSpeed's: unpickling it would build it and set its state."""

    def __init__(self) -> None:
        self.value = 1


def zero_optimizer_states(precision: str) -> dict:
    """What DeepSpeed 0.19.8's ZeRO optimizer pickles besides tensors (stage_1_and_2.state_dict, stage3.state_dict):
    its loss scaler, made by its own factory from the shipped configs' fp16 section, the stage, ZeRO-2's slice
    mappings. fp16 cannot be written by a CPU engine (DeepSpeed: "Type fp16 is not supported on your device")."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    dynamic = {"init_scale": 2**16, "scale_window": 100, "min_scale": 1, "delayed_shift": 2,
               "consecutive_hysteresis": False, "raise_error_at_min_scale": True}
    scaler = CreateLossScaler(dtype=dtype, static_loss_scale=0, dynamic_scaling=precision == "fp16",
                              dynamic_loss_args=dynamic)
    return {"optimizer_state_dict": {"loss_scaler": scaler, "dynamic_loss_scale": precision == "fp16",
                                     "zero_stage": ZeroStageEnum.gradients, "partition_count": [1],
                                     "param_slice_mappings": [{"lora_A": fragment_address(numel=8, start=0)}],
                                     "single_partition_of_fp32_groups": [torch.ones(8)]},
            "ds_config": {"zero_optimization": {"stage": 2}}, "ds_version": "0.19.8"}


def checkpoint_with(root, optimizer_states: dict):
    """checkpoint-4 holding DeepSpeed's layout: global_step4/ with the model states and rank 1's optimizer states."""
    tag = root / "checkpoint-4" / "global_step4"
    tag.mkdir(parents=True)
    (tag.parent / "latest").write_text("global_step4")
    torch.save({"module": {"lora_A": torch.ones(2, 4)}, "global_steps": 4}, tag / "mp_rank_00_model_states.pt")
    torch.save(optimizer_states, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    return tag.parent


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_what_deepspeed_writes_loads_weights_only_with_deepspeeds_own_loader(precision, tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    checkpoint = checkpoint_with(tmp_path, zero_optimizer_states(precision))
    check_deepspeed_files(str(checkpoint))
    with weights_only_loads():  # DeepSpeed's own call: torch.load(path, weights_only=False)
        states = TorchCheckpointEngine().load(str(checkpoint / "global_step4" /
                                                  "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    scaler = states["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler).__name__ == ("DynamicLossScaler" if precision == "fp16" else "LossScaler")
    assert scaler.cur_scale == (2**16 if precision == "fp16" else 1)


@pytest.mark.parametrize("planted", ["code", "class"])
def test_a_planted_global_is_refused_in_one_line_naming_the_file_and_never_runs(planted, tmp_path, monkeypatch):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    ran = tmp_path / "the planted code ran"
    states = zero_optimizer_states("bf16")
    states["optimizer_state_dict"]["extra"] = RunsCode(str(ran)) if planted == "code" else OtherClass()
    checkpoint = checkpoint_with(tmp_path, states)
    planted_file = checkpoint / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    monkeypatch.delenv(FORCE_WEIGHTS_ONLY, raising=False)
    monkeypatch.setenv(FORCE_NO_WEIGHTS_ONLY, "1")  # a user's setting: set aside during the load, then restored
    allowed_before = set(map(str, torch.serialization.get_safe_globals()))

    with pytest.raises(InputError) as refused:
        load_deepspeed_checkpoint(object(), str(checkpoint), load_module_strict=False)  # refused before the engine
    message = str(refused.value)
    name = "os.makedirs" if planted == "code" else f"{__name__}.OtherClass"
    assert message.startswith(f"{planted_file}: this DeepSpeed checkpoint file pickles the global {name}, ")
    assert "\n" not in message and refused.value.exit_status == 2
    # DeepSpeed's own load, were the check skipped, is weights-only too.
    with weights_only_loads(), pytest.raises(Exception, match="Weights only load failed"):
        TorchCheckpointEngine().load(str(planted_file))
    assert not ran.exists()
    assert FORCE_WEIGHTS_ONLY not in os.environ and os.environ[FORCE_NO_WEIGHTS_ONLY] == "1"
    assert set(map(str, torch.serialization.get_safe_globals())) == allowed_before
