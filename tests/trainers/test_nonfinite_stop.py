"""A run whose loss or gradient norm stays NaN or infinite stops with one line and exit status 3, saves nothing
after the last finite step, and leaves the last good checkpoint resumable."""

import math
from types import SimpleNamespace

import pytest

from helpers.commands import PT_SCRIPT, run_in_process
from helpers.run_outputs import adapter_weights
from helpers.tiny_runs import tiny_pt_args


def test_a_diverged_run_stops_before_saving_nonfinite_weights(tmp_path, tiny_model_dir, pretrain_dir):
    out = tmp_path / "out"
    # Adam moves each weight by about the learning rate: after step 1 the LoRA weights are ~1e30 (finite, saved
    # in checkpoint-1), and every later forward overflows.
    args = tiny_pt_args(tiny_model_dir, pretrain_dir, out, tmp_path / "cache", learning_rate=1e30, save_steps=1,
                        max_steps=8, lora_dropout=0.0, max_nonfinite_steps=3)
    result = run_in_process(PT_SCRIPT, args)
    assert result.returncode == 3, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "at 3 logged step(s) in a row (steps 2, 3, 4;" in errors[0]
    assert f"the last checkpoint {out / 'checkpoint-1'} holds finite weights and resumes" in errors[0]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]
    assert not (out / "pt_lora_model").exists()
    weights = adapter_weights(out / "checkpoint-1" / "pt_lora_model")
    assert all(bool(tensor.isfinite().all()) for tensor in weights.values())
    # The non-finite steps show in the log as they were, not replaced by the average of the finite ones.
    assert result.stdout.count("'loss': 'nan'") == 3, result.stdout[-3000:]


def test_only_consecutive_nonfinite_steps_stop_and_none_of_them_saves(tmp_path):
    from transformers import TrainerControl

    from lorakit.trainers.causal_lm import StopOnNonFinite, TrainingDiverged

    stop = StopOnNonFinite(max_nonfinite_steps=3)
    args = SimpleNamespace(output_dir=str(tmp_path))
    saved = []
    # An fp16 overflow skipped now and then (steps 2, 4-5) is not a divergence; its steps are not saved.
    for step, loss in enumerate([1.0, math.nan, 0.9, math.inf, math.nan, 0.8, math.nan, math.nan], start=1):
        control = TrainerControl(should_save=True)
        control = stop.on_step_end(args, SimpleNamespace(global_step=step), control)
        assert control.should_log  # a save step is always a checked step
        control = stop.on_log(args, SimpleNamespace(global_step=step, max_steps=20), control,
                              logs={"loss": loss, "grad_norm": 1.0})
        saved += [step] if control.should_save else []
    assert saved == [1, 3, 6]
    diverged = r"loss nan at 3 logged step\(s\) in a row \(steps 7, 8, 9;.*no checkpoint"
    with pytest.raises(TrainingDiverged, match=diverged):
        stop.on_log(args, SimpleNamespace(global_step=9, max_steps=20), TrainerControl(), logs={"loss": math.nan})
    assert TrainingDiverged.exit_status == 3
    # A run that would end on a non-finite step stops there too, before the final adapter is written.
    ending = StopOnNonFinite(max_nonfinite_steps=3)
    with pytest.raises(TrainingDiverged, match=r"grad_norm inf at 1 logged step\(s\) in a row \(steps 20;"):
        ending.on_log(args, SimpleNamespace(global_step=20, max_steps=20), TrainerControl(),
                      logs={"loss": 0.5, "grad_norm": math.inf})
