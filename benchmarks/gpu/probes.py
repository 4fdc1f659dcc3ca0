"""Inside a child: the probe every Trainer built there gets (ours or TRL's), and nothing else of the run changes.

Every figure of ours comes from the toolkit's own code: scripts/training/run_sft_with_peft.py, run_ppo.py and
run_grpo.py run unmodified as __main__ (runpy) in the child, so model loading is lorakit.models.loader's load_model,
packing is build_dataset's pack_samples and collator, the loss is CausalLMTrainer's (chunked_loss.py with
--chunked_loss true), PPO and GRPO are their trainers. The probe adds: a step clock that synchronises the GPU before
reading the time, memory readings (the peak is reset once the Trainer is built, the model loaded), the collator wrapped
to count tokens (SFT), and the RL trainers' phase timers made to synchronise the GPU (RL). All runs: bf16 weights and
--bf16, LoRA r 8, alpha 32, dropout 0.05 on all linear layers (the toolkit's defaults, given explicitly), AdamW lr 1e-4,
seed 42, no activation checkpointing in the throughput runs (both sides).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from measure import TrainingClock, after_trainer_init

from .packing_check import check_rows, packing_check, sample_spans

# The Trainer settings recorded with every run, so the JSON shows both sides trained alike.
PARITY_ARGS = ("learning_rate", "lr_scheduler_type", "optim", "weight_decay", "warmup_steps",
               "per_device_train_batch_size", "max_steps", "seed", "bf16", "activation_checkpointing",
               "gradient_checkpointing", "torch_compile", "use_liger_kernel")


def device_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_memory_mb() -> dict:
    """GPU memory now and at its peak since the last reset (torch's allocator); on the CPU, the process's
    resident set now and its peak so far (Linux /proc/self/status)."""
    import torch

    if torch.cuda.is_available():
        return {"now_mb": torch.cuda.memory_allocated() / 2**20, "peak_mb": torch.cuda.max_memory_allocated() / 2**20,
                "reserved_peak_mb": torch.cuda.max_memory_reserved() / 2**20}
    fields = {}
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return {"now_mb": fields["VmRSS"], "peak_mb": fields["VmHWM"], "reserved_peak_mb": None}


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def json_value(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


class RunProbe(TrainingClock):
    """One run's figures: a step clock that synchronises the GPU before reading the time, the memory
    when the Trainer was built (the model loaded; the peak is reset there) and at the end, the logs."""

    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.spec, self.step_s, self.figures, self.done = spec, [], {}, False

    def trainer_built(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        class Synchronise(TrainerCallback):  # added before the clock's callback, so it runs first
            def on_train_begin(self, args, state, control, **kwargs):
                device_sync()

            def on_step_end(self, args, state, control, **kwargs):
                device_sync()

        trainer.add_callback(Synchronise())
        trainer.add_callback(self.callback)
        model = trainer.model
        self.figures["lora_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.figures["memory_at_trainer_mb"] = device_memory_mb()["now_mb"]
        reset_peak_memory()

    def step_done(self, wall_s: float, cpu_s: float) -> None:
        self.step_s.append(wall_s)

    def finish(self, args: Any) -> None:
        memory = device_memory_mb()
        self.figures.update({"peak_memory_mb": memory["peak_mb"], "reserved_peak_mb": memory["reserved_peak_mb"],
                             "growth_mb": memory["peak_mb"] - self.figures["memory_at_trainer_mb"],
                             "step_s": self.step_s, "bf16": bool(args.bf16),
                             "trainer_args": {name: json_value(getattr(args, name, None)) for name in PARITY_ARGS}})
        self.done = True


class SFTProbe(RunProbe):
    """Also counts each batch's non-padding tokens and its samples' lengths (the collator is wrapped;
    a FIFO, since the dataloader may collate a batch ahead), and checks packed = alone before training."""

    def __init__(self, spec: dict) -> None:
        super().__init__(spec)
        self.pending, self.batches = deque(), []

    def trainer_built(self, trainer: Any) -> None:
        collator = trainer.data_collator
        trainer.data_collator = self.counting(collator)
        super().trainer_built(trainer)
        if self.spec.get("check_packing"):
            self.figures["packing_check"] = packing_check(trainer, collator, check_rows(trainer.train_dataset))
            reset_peak_memory()

    def counting(self, collator: Callable) -> Callable:
        def collate(features: list) -> Any:
            lengths = []
            for feature in features:
                if "position_ids" in feature:  # ours, packed
                    lengths += [end - start for start, end in sample_spans(feature["position_ids"])]
                elif "seq_lengths" in feature:  # TRL's packed rows
                    lengths += list(feature["seq_lengths"])
                else:
                    lengths.append(len(feature["input_ids"]))
            batch = collator(features)
            self.pending.append({"lengths": lengths, "fed": int(batch["input_ids"].numel())})
            return batch
        return collate

    def step_done(self, wall_s: float, cpu_s: float) -> None:
        super().step_done(wall_s, cpu_s)
        self.batches.append(self.pending.popleft())

    def finish(self, args: Any) -> None:
        super().finish(args)
        self.figures["batches"] = self.batches
        self.figures["losses"] = [log["loss"] for log in self.logs if "loss" in log]


class RLProbe(RunProbe):
    """PPO's or GRPO's logs that carry the phase timers or the sampler gap (report.summarise_rl reads them)."""

    def finish(self, args: Any) -> None:
        super().finish(args)
        self.figures["logs"] = [log for log in self.logs
                                if "time_generation" in log or any(key.startswith("sampler_gap/") for key in log)]


@contextmanager
def synchronised_rl_timers() -> Iterator[None]:
    """The RL trainers' phase timers (PhaseTimes, RLStepCallback) read the clock right after queued GPU work
    finishes; unsynchronised, a phase's kernels still running are billed to the next phase."""
    from lorakit.rl import experience as rl_experience
    from lorakit.rl import rl_trainer

    saved_timing = rl_experience.PhaseTimes.timing
    callback = rl_trainer.RLStepCallback
    saved_steps = callback.on_step_begin, callback.on_step_end

    @contextmanager
    def timing(self: Any, name: str) -> Iterator[None]:
        device_sync()
        with saved_timing(self, name):
            yield
            device_sync()

    def synchronised(method: Callable) -> Callable:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            device_sync()
            return method(self, *args, **kwargs)
        return call

    rl_experience.PhaseTimes.timing = timing
    callback.on_step_begin, callback.on_step_end = (synchronised(step) for step in saved_steps)
    try:
        yield
    finally:
        rl_experience.PhaseTimes.timing = saved_timing
        callback.on_step_begin, callback.on_step_end = saved_steps


# The probe of the run in progress: Trainer.__init__ is wrapped once per process (after_trainer_init).
ACTIVE_PROBE = []


def attach_probe(probe: RunProbe) -> RunProbe:
    """probe gets every Trainer built from now on (ours or TRL's) until the next one is attached."""
    if not ACTIVE_PROBE:
        after_trainer_init(lambda trainer: ACTIVE_PROBE[-1].trainer_built(trainer))
    ACTIVE_PROBE[:] = [probe]
    return probe


def probe_figures(probe: RunProbe) -> dict:
    if not probe.done:
        raise RuntimeError("training did not run to its end")
    return probe.figures
