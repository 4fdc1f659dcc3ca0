"""The flags every RL stage shares (PPO, GRPO and the group-relative methods): how rollouts are sampled and by which
engine (rl.rollout), the sampler-vs-trainer correction, ZeRO-3's gathering for generation, the actor's EMA and the
logged samples. Each stage's arguments add their own objective's flags."""

import math
from dataclasses import dataclass, field
from typing import ClassVar

from lorakit.core.cli import InputError
from lorakit.trainers.arguments import CausalLMTrainingArguments


@dataclass
class RolloutArguments(CausalLMTrainingArguments):
    """TrainingArguments plus the rollout's flags (see the module's docstring)."""

    accepts_kernel_flags: ClassVar[bool] = False  # not proven here: trainers.arguments.check_kernel_flags

    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (log-probs use the same)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling; 1.0 = off."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 = off."})
    enable_ema: bool = field(
        default=False, metadata={"help": "Keep an exponential moving average of the actor (actor_ema)."})
    ema_beta: float = field(default=0.992, metadata={"help": "EMA decay per optimizer step."})
    print_answers: bool = field(default=False, metadata={"help": "Log a sample prompt, answer and score."})
    print_answers_interval: int = field(default=1, metadata={"help": "... every this many iterations."})
    enable_hybrid_engine: bool = field(
        default=False,
        metadata={"help": "DeepSpeed-Chat's flag: the rollout engine decodes on the actor's adapter merged into the "
                          "base weights (restored bit for bit after each rollout; costs a copy of the targeted base "
                          "weights during it). ZeRO-3, a quantized base and DoRA decode unmerged."},
    )
    rollout_engine: str = field(
        default="auto",
        metadata={"help": "What samples the rollouts (rl.rollout): eager (the actor's generate()), or compiled (a "
                          "static KV cache and the decoding step compiled by torch.compile, once per prompt-length "
                          "bucket; ZeRO-3 and a quantized base decode eager); auto: compiled on CUDA (falling back "
                          "to eager, said once, if the compile fails), eager elsewhere.",
                  "choices": ["auto", "eager", "compiled"]},
    )
    sampler_correction: bool = field(
        default=False,
        metadata={"help": "Truncated importance sampling: weigh each answer token's policy loss by "
                          "min(pi_old / pi_sampler, --sampler_correction_cap), for when the sampler's numerics "
                          "drift from the training forward's (see sampler_gap/* in the logs)."},
    )
    sampler_correction_cap: float = field(
        default=2.0, metadata={"help": "The cap of --sampler_correction's per-token weight."})
    generation_gather: str = field(
        default="auto",
        metadata={"help": "ZeRO-3: gather the actor's weights once per generation batch (per_batch), or layer by "
                          "layer at every generated token (per_layer: slow, for an actor too big for one device); "
                          "auto: per_batch when the whole actor takes at most half the device's free memory.",
                  "choices": ["auto", "per_batch", "per_layer"]},
    )
    stop_on_alarm: bool = field(
        default=False,
        metadata={"help": "End the run at the first health alarm (rl.health: the KL, entropy, length, diversity, "
                          "... against the run's own first iterations), exit status 4; the published adapter is "
                          "then the last checkpoint's, saved with no alarm. Without it alarms are logged (and still "
                          "keep checkpoints from being saved while active). Changeable on resume."},
    )
    publish_on_alarm: bool = field(
        default=False,
        metadata={"help": "Train on through health alarms and keep what is trained: checkpoints are saved and the "
                          "end of training is published while an alarm is active (alarms are still logged and "
                          "recorded, and the alarm file says the adapter was trained through them). Without it a "
                          "run that ends with an alarm active publishes its last checkpoint saved with none. For "
                          "resuming a run --stop_on_alarm ended, when you judge the alarm false. Changeable on "
                          "resume."},
    )
    # What the rollout's code reads (rl.experience): prompts per sampling pass, sampling passes per iteration and rows
    # per micro-batch of the old policy's pass. Declared here so that shared code reads declared fields; not flags
    # (init=False): PPO redeclares them as its flags (DeepSpeed-Chat's names), GRPO derives them from its own.
    per_device_generation_batch_size: int | None = field(default=None, init=False)
    generation_batches: int = field(default=1, init=False)
    per_device_training_batch_size: int | None = field(default=None, init=False)
    sft_answers_file: str | None = field(
        default=None,
        metadata={"help": "SFT data (.json/.jsonl in any SFT record shape, or a directory of them) whose answers the "
                          "health monitors compare the rollouts with: sft_copy_share, the share of answers that "
                          "copy an SFT answer. Changeable on resume."},
    )

    def __post_init__(self) -> None:
        if self.stop_on_alarm and self.publish_on_alarm:
            raise InputError("--stop_on_alarm and --publish_on_alarm: give one (stop at the first alarm, or train on "
                             "through alarms and publish what is trained)")
        if self.sampler_correction_cap <= 0:
            raise InputError(f"--sampler_correction_cap {self.sampler_correction_cap}: give a positive cap")
        # Nothing to skip on resume: the experience stream restarts at the checkpoint's iteration.
        self.ignore_data_skip = True
        super().__post_init__()
        if self.enable_hybrid_engine:
            self.mapped_flags.insert(0, "--enable_hybrid_engine -> rollouts decode on the actor's adapter merged into "
                                        "the base weights")


def check_save_steps(training_args: RolloutArguments, steps_per_iteration: int, iteration: str) -> None:
    """Checkpoints only at iteration boundaries: --save_steps (a ratio of --max_steps resolved as the Trainer
    resolves it) a multiple of the optimizer steps of one iteration, else refused: a checkpoint inside an iteration
    could not restore its experience. iteration: what the stage calls one ("PPO iteration", "rollout")."""
    if training_args.save_strategy != "steps" or training_args.save_steps <= 0:
        return
    save_steps = training_args.save_steps
    if save_steps < 1:
        save_steps = math.ceil(training_args.max_steps * save_steps)
    if int(save_steps) % steps_per_iteration:
        given = (f"{training_args.save_steps} (of --max_steps {training_args.max_steps}: every {int(save_steps)})"
                 if training_args.save_steps < 1 else f"{int(save_steps)}")
        raise InputError(f"--save_steps {given} must be a multiple of the {steps_per_iteration} optimizer steps of "
                         f"one {iteration}: a checkpoint inside a {iteration} could not restore its experience")
