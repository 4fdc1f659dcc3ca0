"""The training flags every stage shares: the Trainer's TrainingArguments with the names Chinese-LLaMA-Alpaca-2's and
DeepSpeed-Chat's shell scripts pass (--zero_stage, --dtype, --num_warmup_steps, ...) mapped onto it, the shipped
DeepSpeed configs a ZeRO stage picks, and the data flags of DeepSpeed-Chat's conversation stages."""

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from transformers import TrainingArguments

from lorakit.core.cli import InputError
from lorakit.core.package_data import DS_CONFIGS
from lorakit.data.build_dataset import ConversationDataArguments
from lorakit.models.arguments import FlagTable, MappedFlag, ModelArguments, map_flags, note_accepted_flags
from lorakit.models.kernels import check_liger_importable

# Where DeepSpeed-Chat's --zero_stage (with --offload) points: the configs shipped in ds_configs/.
SHIPPED_ZERO_CONFIGS = {(2, False): "ds_zero2_no_offload.json", (3, False): "ds_zero3_no_offload.json",
                        (3, True): "ds_zero3_offload.json"}


# DeepSpeed-Chat's --dtype -> the mixed-precision flag it turns on (fp32: none).
DTYPE_FLAGS = {"fp16": "fp16", "bf16": "bf16", "fp32": None}


def warmup_ratio_flag(ratio: float) -> MappedFlag:
    if not 0 <= ratio < 1:
        raise InputError(f"--warmup_ratio must be in [0, 1), got {ratio}")
    return MappedFlag("warmup_steps", ratio, "a warmup_steps below 1 is a share of the training steps")


# Trainer flags by another name -> what each means in transformers 5: transformers 4's names that
# Chinese-LLaMA-Alpaca-2's run_pt.sh/run_sft.sh pass, and DeepSpeed-Chat's. models.arguments.map_flags applies them.
RENAMED_TRAINER_FLAGS: FlagTable = {
    "evaluation_strategy": lambda strategy: MappedFlag("eval_strategy", strategy),
    "warmup_ratio": warmup_ratio_flag,
    "num_warmup_steps": lambda steps: MappedFlag("warmup_steps", steps),
    "gradient_checkpointing": lambda on: MappedFlag("activation_checkpointing", on),
    "group_by_length": lambda on: MappedFlag("train_sampling_strategy", "group_by_length"),
}


# Flags of those scripts that need nothing here, and why (noted when given).
ACCEPTED_TRAINER_FLAGS = {
    "save_safetensors": "weights are always written as safetensors",
    "only_optimize_lora": "LoRA trains only the adapter (and --modules_to_save)",
    "num_padding_at_beginning": "a sequence's score is read at its last attended token, found from the attention "
                                "mask, so no count of leading pad tokens is needed",
}


@dataclass
class ToolkitTrainingArguments(TrainingArguments):
    """TrainingArguments plus the flags users' existing shell scripts pass that transformers 5 does
    not know: Chinese-LLaMA-Alpaca-2's run_pt.sh/run_sft.sh (transformers 4 names) and DeepSpeed-Chat's
    step scripts. Each is mapped to what it means here, or accepted with the reason it needs nothing,
    and reported as a 'flag mapped' log line."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that is not empty, ignoring its checkpoints."},
    )
    evaluation_strategy: str | None = field(
        default=None, metadata={"help": "Old name of --eval_strategy (transformers 4)."}
    )
    warmup_ratio: float | None = field(
        default=None, metadata={"help": "Old form of a fractional --warmup_steps (transformers 4)."}
    )
    save_safetensors: bool | None = field(
        default=None, metadata={"help": "Accepted for old scripts; weights are always safetensors."}
    )
    group_by_length: bool = field(
        default=False,
        metadata={"help": "Old form of --train_sampling_strategy group_by_length (transformers 4)."},
    )
    zero_stage: int | None = field(
        default=None,
        metadata={"help": "DeepSpeed-Chat: ZeRO stage 0, 2 or 3 (with --offload: 3), mapped to the --deepspeed "
                          "config of ds_configs/ (0: no DeepSpeed)."},
    )
    offload: bool = field(
        default=False, metadata={"help": "DeepSpeed-Chat: with --zero_stage 3, ZeRO-3 with CPU offload."}
    )
    dtype: str | None = field(
        default=None,
        metadata={"help": "DeepSpeed-Chat: fp16 or bf16 mixed precision (--fp16 / --bf16), or fp32.",
                  "choices": list(DTYPE_FLAGS)},
    )
    num_warmup_steps: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat's --warmup_steps."})
    only_optimize_lora: bool = field(default=False, metadata={"help": "DeepSpeed-Chat: accepted, LoRA trains only "
                                                                      "the adapter."})
    num_padding_at_beginning: int | None = field(
        default=None, metadata={"help": "DeepSpeed-Chat: accepted, scores are read from the attention mask."}
    )
    max_nonfinite_steps: int = field(
        default=3,
        metadata={"help": "Stop the run (exit status 3) when the logged loss or gradient norm is NaN or infinite "
                          "this many logged steps in a row; no checkpoint is saved while they are (0: never stop)."},
    )
    # A NaN or infinite step must show in the log: the Trainer's default filter replaces its loss with the average.
    logging_nan_inf_filter: bool = field(
        default=False, metadata={"help": "Replace a non-finite step's logged loss by the average (hides it)."}
    )
    # Our datasets hold only what the collators read (model inputs, 'length' for the length-grouped
    # sampler, a pair's margin): nothing is for the Trainer to drop by the model's signature.
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: every column of our datasets is read by a collator."}
    )
    # Whether --use_liger_kernel and --torch_compile are proven with this stage's loss (check_kernel_flags).
    accepts_kernel_flags: ClassVar[bool] = False

    def __post_init__(self) -> None:
        # Logging is not configured yet; setup_logging() reports these notes on rank 0. All of them
        # act before TrainingArguments fills the DeepSpeed config's "auto" precision from --fp16/--bf16.
        self.mapped_flags: list[str] = []
        map_flags(self, RENAMED_TRAINER_FLAGS, self.mapped_flags)
        map_dtype_flag(self)
        map_zero_stage(self)
        map_fp16_on_cpu(self)
        note_accepted_flags(self, ACCEPTED_TRAINER_FLAGS, self.mapped_flags)
        super().__post_init__()
        check_kernel_flags(self)


def check_kernel_flags(args: ToolkitTrainingArguments) -> None:
    """--use_liger_kernel and --torch_compile (TrainingArguments' own flags) only where they are proven with the
    stage's loss (accepts_kernel_flags): Liger replaces the model classes' forward, which DPO's answer log-probs,
    the reward head and PPO's shared base call in their own ways; refused there in one line, never silently passed
    on."""
    for flag, given in (("use_liger_kernel", args.use_liger_kernel), ("torch_compile", args.torch_compile)):
        if given and not args.accepts_kernel_flags:
            raise InputError(f"--{flag}: not proven for this stage, only for pretraining and SFT "
                             "(run_clm_pt_with_peft.py, run_sft_with_peft.py); drop the flag")
    if args.use_liger_kernel:
        check_liger_importable()
    if args.torch_compile:
        from transformers.integrations import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            # ZeRO-3 gathers each layer's weights in hooks around its forward, which a compiled layer would trace
            # into its graph: not proven, so not run.
            raise InputError("--torch_compile with a ZeRO-3 DeepSpeed config: not proven (ZeRO-3's weight-gathering "
                             "hooks would sit inside the compiled layers); use ZeRO-2, or drop --torch_compile")


def map_dtype_flag(args: ToolkitTrainingArguments) -> None:
    """DeepSpeed-Chat's --dtype as the Trainer's mixed-precision flag."""
    if args.dtype is None:
        return
    wanted = DTYPE_FLAGS[args.dtype]
    for flag in ("fp16", "bf16"):
        if getattr(args, flag) and flag != wanted:
            raise InputError(f"--dtype {args.dtype} and --{flag} both given: give only one")
    if wanted:
        setattr(args, wanted, True)
    args.mapped_flags.append(f"--dtype {args.dtype} -> " + (f"--{wanted}" if wanted else "no --fp16/--bf16 (float32)"))
    args.dtype = None


def map_zero_stage(args: ToolkitTrainingArguments) -> None:
    """DeepSpeed-Chat's --zero_stage (and --offload) as the --deepspeed config shipped for it."""
    if args.deepspeed == "":  # DeepSpeed-Chat's bare switch (core.cli.bare_switch_as_empty)
        args.deepspeed = None
        args.mapped_flags.append("--deepspeed (DeepSpeed-Chat's switch) accepted: --zero_stage picks the config, "
                                 "none or 0 meaning no DeepSpeed")
    if args.zero_stage is None:
        if args.offload:
            raise InputError("--offload goes with --zero_stage 3 (ds_configs/ds_zero3_offload.json); with --deepspeed, "
                             "the config file's offload_optimizer/offload_param decide")
        return
    given = f"--zero_stage {args.zero_stage}" + (" --offload" if args.offload else "")
    if args.zero_stage == 0 and not args.offload:
        if args.deepspeed:
            raise InputError(f"{given} and --deepspeed {args.deepspeed} both given: ZeRO stage 0 means no DeepSpeed")
        args.mapped_flags.append(f"{given} -> no --deepspeed (plain data parallelism)")
    else:
        name = SHIPPED_ZERO_CONFIGS.get((args.zero_stage, args.offload))
        if name is None:
            raise InputError(f"{given}: ds_configs/ ships no DeepSpeed config for it (ZeRO-2 without offload, ZeRO-3 "
                             "with or without); write one and pass it with --deepspeed")
        config = os.path.join(DS_CONFIGS, name)
        # A dict (a config given in code, not a file) is not the shipped file either.
        if args.deepspeed and (not isinstance(args.deepspeed, str)
                               or os.path.realpath(args.deepspeed) != os.path.realpath(config)):
            raise InputError(f"{given} and --deepspeed {args.deepspeed} both given: {given} means --deepspeed "
                             f"{config}; give only one")
        args.deepspeed = config
        args.mapped_flags.append(f"{given} -> --deepspeed {config}")
    args.zero_stage, args.offload = None, False


def map_fp16_on_cpu(args: ToolkitTrainingArguments) -> None:
    """--fp16 where there is no GPU: neither torch's autocast (accelerate skips it on a CPU) nor
    DeepSpeed ("Type fp16 is not supported") computes in float16 there, so the run computes in
    float32, as it would have on a CPU anyway. On a GPU --fp16 stays what it is."""
    if args.fp16 and (args.use_cpu or not torch.accelerator.is_available()):
        args.fp16 = False
        args.mapped_flags.append("--fp16 -> float32 compute (no GPU here: float16 mixed precision needs one; "
                                 "--bf16 runs on a CPU)")


def map_half_weights_on_cpu(model_args: ModelArguments, training_args: ToolkitTrainingArguments) -> None:
    """--torch_dtype float16 for a run on a CPU: its trainable copies (--modules_to_save) would train
    in float16 without loss scaling, and DeepSpeed mixes them with float32 there; load float32."""
    if model_args.torch_dtype == "float16" and training_args.device.type == "cpu":
        model_args.torch_dtype = "float32"
        training_args.mapped_flags.append("--torch_dtype float16 -> --torch_dtype float32 (training on a CPU, "
                                          "where float16 has no mixed precision)")


@dataclass
class CausalLMTrainingArguments(ToolkitTrainingArguments):
    """The toolkit's training arguments plus the option of the stages that train a language-model head
    (pretraining, SFT, PPO's actor, DPO's policy)."""

    # On by default: where it is used (the first batch checks the head alone reproduces the model's logits) its
    # loss and gradients equal transformers' to float32 rounding, and lie at least as close to a float64 loss.
    accepts_kernel_flags: ClassVar[bool] = True  # pretraining and SFT; DPO and the RL stages set it back

    chunked_loss: bool = field(
        default=True,
        metadata={"help": "Compute the loss and log-probabilities from the hidden states over chunks of positions, "
                          "never holding float32 logits of the whole batch and vocabulary (PPO: also each sampled "
                          "token's log-prob and entropy as it is generated; DPO: the answers' log-probabilities). "
                          "Used where it equals the model's own loss (checked on the first batch); off: the full "
                          "logits, as transformers computes them."},
    )


@dataclass
class DeepSpeedChatDataArguments(ConversationDataArguments):
    """The conversation data arguments plus DeepSpeed-Chat's name of --max_seq_length (steps 1 and 2)."""

    max_seq_len: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat's --max_seq_length."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mapped_flags: list[str] = []
        map_flags(self, {"max_seq_len": lambda length: MappedFlag("max_seq_length", length)}, self.mapped_flags)


@dataclass
class PreferenceDataArguments(DeepSpeedChatDataArguments):
    """The data flags of the stages that read preference pairs (reward, DPO): the reward model's phase of
    --data_split by default, as DeepSpeed-Chat's step 2 takes it."""

    data_phase: int = field(default=2, metadata={"help": "Which part of --data_split this stage takes (2 = reward)."})
