"""PPO's four roles placed and loaded: on one shared base (the actor's, critic's, reference's and reward model's
adapters side by side) or as separate models (SeparatePolicy), each role's model arguments, and the check that the
frozen roles fit beside the trained ones."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch

from lorakit.core.cli import InputError
from lorakit.models.adapters import log_trainable
from lorakit.models.arguments import DTYPES, ModelArguments
from lorakit.models.loader import (
    checkpoint_dtype,
    empty_model,
    frozen_precision,
    keep_trainable_float32,
    load_model,
    outside_zero3_init,
)
from lorakit.models.zero3 import free_memory_bytes, on_every_rank
from lorakit.rl.role_policy import (
    RolePolicy,
    SharedBasePolicy,
    add_reward_adapter,
    base_model,
    frozen_dtype,
    new_score_head,
    peft_model_of,
    reward_adapter_parts,
    role_model_args,
)

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from lorakit.rl.ppo_config import PPOArguments, PPOModelArguments

# Separate placement under ZeRO-3 refuses frozen reference + reward models that, whole, take more than this share of
# a process's free device memory or of its share of the CPU memory (check_frozen_roles_fit).
FROZEN_ROLES_SHARE = 0.5


class SeparatePolicy(RolePolicy):
    """Each role its own model, as in DeepSpeed-Chat: the actor (peft causal LM) and critic
    (peft sequence classifier whose score head is the value head) are trained; the reference and
    reward models are frozen and kept outside the module, so DeepSpeed neither partitions nor
    checkpoints them."""

    frozen: dict[str, "PreTrainedModel"]  # the reference and reward models, by role

    def __init__(self, actor: "PeftModel", critic: "PeftModel", reference: "PreTrainedModel",
                 reward: "PreTrainedModel", offload: bool) -> None:
        super().__init__()
        self.actor = actor
        self.critic = critic
        # Plain attributes, not submodules: the Trainer's optimizer, DeepSpeed and checkpoints skip them.
        self.__dict__["frozen"] = {"reference": reference, "reward": reward}
        self.offload = offload

    def role_model(self, role: str) -> "PreTrainedModel":
        if role == "actor":
            return base_model(self.actor)
        if role == "critic":
            return base_model(self.critic)
        return self.frozen[role]

    @contextmanager
    def placed(self, role: str, device: torch.device) -> Iterator[None]:
        """With --offload_reference_model a frozen model visits the device for its pass only."""
        # As an nn.Module: transformers wraps PreTrainedModel.to in functools.wraps, whose typing does not bind self.
        model: torch.nn.Module | None = self.frozen.get(role)
        if model is None or not self.offload:
            yield
            return
        model.to(device)
        try:
            yield
        finally:
            model.to("cpu")

    def hidden(self, role: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor, cache: "DynamicCache | None" = None) -> torch.Tensor:
        with self.placed(role, input_ids.device):
            return self.backbone_pass(role, self.role_model(role), input_ids, attention_mask, position_ids, cache)

    def head(self, role: str) -> torch.nn.Module:
        model = self.role_model(role)
        if role in ("actor", "reference"):
            return model.get_output_embeddings()
        # nn.Module types any attribute it holds as Tensor | Module; a sequence classifier's score is its Linear head.
        return cast(torch.nn.Module, model.score)

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with self.placed("reward", input_ids.device):
            return super().scores(input_ids, attention_mask)

    def answer_logprobs(self, role: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        prompt_length: int) -> torch.Tensor:
        with self.placed(role, input_ids.device):
            return super().answer_logprobs(role, input_ids, attention_mask, prompt_length)

    def generator(self) -> "PreTrainedModel":
        return base_model(self.actor)

    def actor_config(self) -> "PreTrainedConfig":
        return base_model(self.actor).config

    def trained_models(self) -> list["PreTrainedModel"]:
        return [base_model(self.actor), base_model(self.critic)]

    def actor_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name[len("actor."):], p) for name, p in self.named_parameters()
                if p.requires_grad and name.startswith("actor.")]

    def is_critic_parameter(self, name: str) -> bool:
        return name.startswith("critic.")

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        self.actor.save_pretrained(path)

    def save_critic(self, path: str) -> None:
        self.critic.save_pretrained(path)


def actor_model_args(model_args: "PPOModelArguments") -> ModelArguments:
    return role_model_args(model_args, model_args.actor_model_name_or_path, model_args.actor_lora_model)


def critic_model_args(model_args: "PPOModelArguments") -> ModelArguments:
    """The critic starts as the reward model: the reward adapter and score head trained on (the
    same parameterisation as --shared_base), or a full critic model with a new LoRA."""
    if model_args.critic_model_name_or_path:
        return role_model_args(model_args, model_args.critic_model_name_or_path, None)
    return role_model_args(model_args, model_args.reward_model_name_or_path, model_args.reward_lora_model)


def load_shared_policy(model_args: "PPOModelArguments", training_args: "PPOArguments",
                       tokenizer: "PreTrainedTokenizerBase",
                       configs: dict[str, "PreTrainedConfig"]) -> SharedBasePolicy:
    """The actor via the shared loader (SFT adapter continued, or a new LoRA; on a quantized base
    with --load_in_kbits), then the other roles as adapters on the same base. configs: {role:
    model config} as rl.ppo.check_models read them."""
    from peft import LoraConfig, TaskType

    reward_dir = model_args.reward_lora_model
    assert reward_dir is not None  # shared placement needs the reward model as an adapter (ppo_checks.shared_placement)
    policy = peft_model_of(load_model(actor_model_args(model_args), training_args, tokenizer, config=configs["actor"],
                                      adapter_flag="--actor_lora_model"))
    reference = None
    if model_args.actor_lora_model:
        policy.load_adapter(model_args.actor_lora_model, adapter_name="reference", is_trainable=False)
        reference = "reference"
    lora_weights, score_weights = reward_adapter_parts(reward_dir)
    reward_config = LoraConfig.from_pretrained(reward_dir)
    # The score head is ours (below); the adapter keeps only its LoRA layers on the causal LM.
    reward_config.task_type, reward_config.modules_to_save = TaskType.CAUSAL_LM, None
    for name in ("reward", "critic"):
        add_reward_adapter(policy, name, reward_config, lora_weights, reward_dir)
    # peft's add/load_adapter re-freeze whatever is not the active adapter: set the roles' flags once, here.
    for name, param in policy.named_parameters():
        param.requires_grad = ".default." in name or ".critic." in name
    config, dtype = base_model(policy).config, frozen_dtype(base_model(policy))
    base_model(policy).config.use_cache = False
    model = SharedBasePolicy(
        policy,
        score_head=new_score_head(config.hidden_size, score_weights, dtype, trainable=False),
        value_head=new_score_head(config.hidden_size, score_weights, dtype, trainable=True),
        reference_adapter=reference,
        reward_adapter_dir=reward_dir,
    )
    keep_trainable_float32(model, training_args)  # the value head, made in the base's dtype
    log_trainable(model)
    return model


def load_frozen(model_dir: str, adapter_dir: str | None, task: str, model_args: ModelArguments,
                training_args: "PPOArguments | None" = None, tokenizer: "PreTrainedTokenizerBase | None" = None,
                config: "PreTrainedConfig | None" = None) -> "PreTrainedModel":
    """A frozen role (the reference, the reward model): the shared loader's frozen model, its
    adapter folded in (one plain forward per pass)."""
    import peft

    flag = "--actor_lora_model" if task == "causal_lm" else "--reward_lora_model"
    model = load_model(role_model_args(model_args, model_dir, adapter_dir), training_args, tokenizer, task,
                       config=config, trainable=False, adapter_flag=flag)
    assert not isinstance(model, peft.PeftModel)  # trainable=False: the adapter folded in (models.adapters.frozen)
    return model


def frozen_role_bytes(model_args: ModelArguments, training_args: "PPOArguments", model_dir: str,
                      config: "PreTrainedConfig", task: str, tokenizer: "PreTrainedTokenizerBase") -> int:
    """Bytes of a frozen role loaded whole: its parameters (counted on the empty skeleton, embeddings grown to the
    tokenizer; a folded adapter adds none) in the dtype load_frozen loads it in."""
    role_args = frozen_precision(role_model_args(model_args, model_dir, None), training_args)
    named = DTYPES[role_args.torch_dtype]  # a torch.dtype, or "auto": the checkpoint's
    dtype = named if isinstance(named, torch.dtype) else checkpoint_dtype(model_dir)
    skeleton = empty_model(role_args, config, task, tokenizer)
    return sum(p.numel() for p in skeleton.parameters()) * dtype.itemsize


def check_frozen_roles_fit(model_args: "PPOModelArguments", training_args: "PPOArguments",
                           tokenizer: "PreTrainedTokenizerBase", configs: dict[str, "PreTrainedConfig"]) -> None:
    """Separate placement under ZeRO-3: the frozen reference and reward models never enter the engine, so every
    process loads them whole into its CPU memory and keeps them whole on its device. Refused (before any write)
    where they take more than FROZEN_ROLES_SHARE of either, pointing to --shared_base, where they are adapters on
    the actor's partitioned base. All ranks agree, so all refuse together."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    size = (frozen_role_bytes(model_args, training_args, model_args.actor_model_name_or_path, configs["actor"],
                              "causal_lm", tokenizer)
            + frozen_role_bytes(model_args, training_args, model_args.reward_model_name_or_path, configs["reward"],
                                "reward", tokenizer))
    for device in dict.fromkeys([torch.device("cpu"), training_args.device]):
        free = free_memory_bytes(device)
        if not on_every_rank(size <= FROZEN_ROLES_SHARE * free, training_args.device):
            memory = "share of the available CPU memory" if device.type == "cpu" else f"free {device.type} memory"
            raise InputError(f"--shared_base false under ZeRO-3: the frozen reference and reward models take "
                             f"{size / 1e9:.3g} GB whole on every process, more than half its {memory} "
                             f"({free / 1e9:.3g} GB; they are not partitioned); use --shared_base true (the roles "
                             "as adapters on the actor's partitioned base; the reward model as --reward_lora_model "
                             "on the actor's base)")


def load_separate_policy(model_args: "PPOModelArguments", training_args: "PPOArguments",
                         tokenizer: "PreTrainedTokenizerBase",
                         configs: dict[str, "PreTrainedConfig"]) -> SeparatePolicy:
    """Each role its own model through the shared loader. configs: {role: model config} as
    rl.ppo.check_models read them."""
    actor = peft_model_of(load_model(actor_model_args(model_args), training_args, tokenizer, config=configs["actor"],
                                     adapter_flag="--actor_lora_model"))
    base_model(actor).config.use_cache = False
    reference = load_frozen(model_args.actor_model_name_or_path, model_args.actor_lora_model, "causal_lm", model_args,
                            training_args, tokenizer, configs["actor"])
    reward = load_frozen(model_args.reward_model_name_or_path, model_args.reward_lora_model, "reward", model_args,
                         training_args, tokenizer, configs["reward"])
    with outside_zero3_init():
        critic = peft_model_of(load_model(critic_model_args(model_args), training_args, tokenizer, task="reward",
                                          config=configs.get("critic", configs["reward"]),
                                          adapter_flag="--reward_lora_model"))
    device = training_args.device
    # As nn.Modules: transformers wraps PreTrainedModel.to in functools.wraps, whose typing does not bind self.
    frozen_models: tuple[torch.nn.Module, ...] = (reference, reward)
    for frozen_model in frozen_models:
        frozen_model.to("cpu" if model_args.offload_reference_model else device)
    model = SeparatePolicy(actor, critic, reference, reward, offload=model_args.offload_reference_model)
    log_trainable(model)
    return model
