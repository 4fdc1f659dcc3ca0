"""The PPO stage's arguments (`lorakit ppo`, lorakit.commands.ppo), with DeepSpeed-Chat's step-3 names: each role's
model and adapter, the prompts and the pretraining mix, and the iteration's flags beside the rollout's shared ones
(rl.rollout_arguments); the other names they accept as mapped aliases. The pipeline reads their flag names."""

from dataclasses import dataclass, field

from lorakit.core.cli import InputError
from lorakit.data.build_dataset import ConversationDataArguments
from lorakit.models.arguments import FlagTable, MappedFlag, ModelArguments, map_flags
from lorakit.rl.rollout_arguments import RolloutArguments


@dataclass
class PPOModelArguments(ModelArguments):
    """The shared model arguments (dtype, --load_in_kbits for QLoRA, LoRA shape, --modules_to_save,
    --new_embeddings_init, ...) plus the four roles' models, named as in DeepSpeed-Chat's step 3.
    --model_name_or_path and --peft_path, the other stages' names for what PPO trains, are the
    actor's: given, they are mapped to --actor_model_name_or_path / --actor_lora_model (logged), as
    are DeepSpeed-Chat's --actor_lora_dim / --critic_lora_dim to --lora_rank (PPO_MODEL_FLAGS)."""

    # An alias of --actor_model_name_or_path, None once __post_init__ has mapped it, where ModelArguments has a
    # model directory: each role's own ModelArguments come from rl.role_policy.role_model_args.
    model_name_or_path: str | None = field(  # type: ignore[assignment]
        default=None, metadata={"help": "Same as --actor_model_name_or_path."})
    peft_path: str | None = field(default=None, metadata={"help": "Same as --actor_lora_model."})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer directory (default: the SFT adapter's, else the actor base's)."}
    )
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on the LoRA input. 0 (DeepSpeed-Chat's choice): experience is scored without "
                          "dropout, so any dropout in the update adds noise to PPO's probability ratio."},
    )
    # Required: typed as every constructed instance holds them (__post_init__ refuses None). The None default only
    # marks "not given", so that --model_name_or_path can map to the actor's and a missing one gets its own message.
    actor_model_name_or_path: str = field(  # type: ignore[assignment]
        default=None, metadata={"help": "Actor base model (or a merged SFT model). Required."}
    )
    reward_model_name_or_path: str = field(  # type: ignore[assignment]
        default=None, metadata={"help": "Reward base model (with --reward_lora_model), or a merged reward model "
                                        "(rm_merged_model). Required."}
    )
    actor_lora_model: str | None = field(
        default=None,
        metadata={"help": "The SFT adapter on the actor base: the policy PPO starts from and the reference."},
    )
    reward_lora_model: str | None = field(
        default=None, metadata={"help": "The reward adapter (rm_lora_model of run_reward.py: LoRA + score head)."}
    )
    critic_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A full reward/value model to start the critic from (default: the reward model)."},
    )
    shared_base: bool | None = field(
        default=None,
        metadata={"help": "One frozen base with actor/critic/reward(/reference) adapters. Default: true when the "
                          "actor and reward share a base and the reward comes as an adapter."},
    )
    offload_reference_model: bool = field(
        default=False,
        metadata={"help": "Separate placement: keep the reference and reward models on the CPU between their passes."},
    )
    actor_lora_dim: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat: mapped to --lora_rank."})
    critic_lora_dim: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat: mapped to --lora_rank."})

    def __post_init__(self) -> None:
        # Logging is not configured yet; main() hands these to setup_logging with the Trainer's own.
        super().__post_init__()
        map_flags(self, PPO_MODEL_FLAGS, self.mapped_flags)
        for flag in ("actor_model_name_or_path", "reward_model_name_or_path"):
            if getattr(self, flag) is None:
                raise InputError(f"--{flag} is required")
        if self.full_finetuning:
            raise InputError("--full_finetuning: PPO trains LoRA adapters (actor, critic) on frozen bases")


def role_lora_dim_flag(dim: int) -> MappedFlag:
    """DeepSpeed-Chat's --actor_lora_dim / --critic_lora_dim: the rank of PPO's new LoRA adapters."""
    if dim < 1:
        raise InputError(f"--actor_lora_dim / --critic_lora_dim {dim}: PPO trains LoRA adapters (actor, critic); "
                         "give a rank of at least 1")
    return MappedFlag("lora_rank", dim, "one --lora_rank shapes every new PPO adapter; the actor and critic continue "
                                        "the SFT and reward adapters at their own ranks")


# Other names of PPO's model flags -> what each means here, applied by models.arguments.map_flags: the other
# stages' names of the actor's model and adapter, and DeepSpeed-Chat's per-role LoRA ranks.
PPO_MODEL_FLAGS: FlagTable = {
    "model_name_or_path": lambda path: MappedFlag("actor_model_name_or_path", path),
    "peft_path": lambda path: MappedFlag("actor_lora_model", path),
    "actor_lora_dim": role_lora_dim_flag,
    "critic_lora_dim": role_lora_dim_flag,
}


@dataclass
class PPODataArguments(ConversationDataArguments):
    data_phase: int = field(default=3, metadata={"help": "Which part of --data_split this stage takes (3 = PPO)."})
    max_prompt_seq_len: int = field(default=256, metadata={"help": "Prompt tokens; longer prompts lose their start."})
    max_answer_seq_len: int = field(default=256, metadata={"help": "Most tokens generated per answer."})
    unsupervised_dataset_dir: str | None = field(
        default=None,
        metadata={"help": "Pretraining text (*.txt / *.jsonl 'text') for the ptx loss mixed into the actor's."},
    )
    unsup_coef: float = field(
        default=27.8, metadata={"help": "Weight of the ptx language-model loss (InstructGPT's gamma)."})


@dataclass
class PPOArguments(RolloutArguments):
    """TrainingArguments plus DeepSpeed-Chat's step-3 options. --per_device_training_batch_size
    and --actor_learning_rate set the Trainer's own batch size and learning rate; the Trainer's
    names for them are accepted too (mapped, logged), giving both with different values is refused."""

    # The Trainer's own, typed as TrainingArguments types them: __post_init__ sets both before the Trainer reads them.
    # The None default only marks "not given" (map_flags maps a given one to PPO's name).
    per_device_train_batch_size: int = field(  # type: ignore[assignment]
        default=None, metadata={"help": "The Trainer's name of --per_device_training_batch_size."})
    learning_rate: float = field(  # type: ignore[assignment]
        default=None, metadata={"help": "The Trainer's name of --actor_learning_rate."})
    per_device_generation_batch_size: int = field(
        default=8, metadata={"help": "Prompts per generation batch per process."})
    per_device_training_batch_size: int | None = field(
        default=None, metadata={"help": "Sequences per PPO micro-batch per process (default 8)."})
    generation_batches: int = field(default=1, metadata={"help": "Generation batches of experience per PPO iteration."})
    ppo_epochs: int = field(default=1, metadata={"help": "Passes over each iteration's experience."})
    actor_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the actor's adapter (default 1e-4)."})
    critic_learning_rate: float = field(
        default=5e-5, metadata={"help": "Learning rate of the critic's adapter and value head."})
    kl_ctl: float = field(default=0.1, metadata={"help": "KL penalty coefficient (initial value when adaptive)."})
    target_kl: float | None = field(
        default=None, metadata={"help": "Adaptive KL control towards this KL per answer."})
    kl_horizon: int = field(default=10000, metadata={"help": "Adaptive KL controller horizon, in answers."})
    clip_reward_value: float = field(default=5.0, metadata={"help": "Reward scores are clamped to +-this."})
    cliprange: float = field(default=0.2, metadata={"help": "PPO policy ratio clip range."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range around the experience's values."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of an answer that hit --max_answer_seq_len without EOS."},
    )
    actor_zero_stage: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat: mapped to --zero_stage."})
    critic_zero_stage: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat: mapped to --zero_stage."})
    def __post_init__(self) -> None:
        # The Trainer's names for what PPO calls --per_device_training_batch_size and --actor_learning_rate, and
        # DeepSpeed-Chat's per-role ZeRO stages, are mapped before TrainingArguments fills DeepSpeed's "auto"
        # batch size and learning rate from them and --zero_stage picks the config.
        notes: list[str] = []
        map_flags(self, PPO_TRAINER_FLAGS, notes)
        for trainer_flag, ppo_flag, default in (("per_device_train_batch_size", "per_device_training_batch_size", 8),
                                                ("learning_rate", "actor_learning_rate", 1e-4)):
            value = default if getattr(self, ppo_flag) is None else getattr(self, ppo_flag)
            setattr(self, trainer_flag, value)
            setattr(self, ppo_flag, value)
        super().__post_init__()
        self.mapped_flags[:0] = notes


ONE_ENGINE = "one DeepSpeed engine trains the actor's and the critic's adapters together"
# Other names of PPO's trainer flags -> what each means here, applied by models.arguments.map_flags.
PPO_TRAINER_FLAGS: FlagTable = {
    "per_device_train_batch_size": lambda size: MappedFlag("per_device_training_batch_size", size),
    "learning_rate": lambda rate: MappedFlag("actor_learning_rate", rate),
    "actor_zero_stage": lambda stage: MappedFlag("zero_stage", stage, ONE_ENGINE),
    "critic_zero_stage": lambda stage: MappedFlag("zero_stage", stage, ONE_ENGINE),
}


# main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (PPOModelArguments, PPODataArguments, PPOArguments)
