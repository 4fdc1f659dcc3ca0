"""The RL stages' model side: the roles (actor, reference, reward, and PPO's critic) behind the RolePolicy interface
the trainers use, on one shared base with peft adapters (SharedBasePolicy, which GRPO uses too), and the reward
adapter's parts; PPO's separate-model placement and its loaders are in rl.ppo_policy."""

import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import fields
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from lorakit.core.cli import InputError
from lorakit.models.arguments import ModelArguments
from lorakit.models.chunked_loss import token_logprobs
from lorakit.models.positions import last_position, positions_from_mask
from lorakit.models.router import aux_loss_from_router_logits
from lorakit.rl.rl_math import length_chunks, logprobs_from_logits

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel


SCORE_KEY_SUFFIX = "score.weight"


class RouterAuxPart(NamedTuple):
    """One actor pass's router load-balancing loss and the real tokens it is over."""

    aux_loss: torch.Tensor
    tokens: torch.Tensor


# A pass over rows of a rollout: (ids, mask, prompt_length) -> {name: [rows, answer] or [rows] tensor}.
RowPasses = Callable[[torch.Tensor, torch.Tensor, int], dict[str, torch.Tensor]]


def backbone_of(causal_or_classifier: "PreTrainedModel") -> torch.nn.Module:
    """The decoder stack (LlamaModel for Llama) under a task head."""
    return getattr(causal_or_classifier, causal_or_classifier.base_model_prefix)


class RolePolicy(torch.nn.Module):
    """Everything the Trainer (and DeepSpeed) wraps: the trained actor and critic, and the frozen
    reference and reward roles the experience passes need. A role's hidden states come from
    hidden(); the heads turn them into log-probs, values and scores. forward() is the training
    pass: actor log-probs of the answer tokens and critic values, plus the ptx loss."""

    temperature: float = 1.0
    # --chunked_loss (the trainer sets it): log-probs and the ptx loss from the hidden states over chunks
    # of positions (models.chunked_loss.token_logprobs), never the [rows, positions, vocabulary] logits at once.
    chunked_loss: bool = True
    # Passes over a rollout run on groups of rows of similar length (see over_length_groups). The
    # trainer turns it off under multi-process ZeRO-3, where every forward is a collective and all
    # ranks must run the same number of them.
    group_by_length: bool = True
    # Rows that repeat a prompt (the group-relative methods' answers to one prompt) run it once (prompt_shared_hidden).
    # The group-relative trainer turns it on, except under gradient checkpointing: checkpointed layers keep no cache.
    share_prompts: bool = False
    # A mixture of experts' router load-balancing weight (models.router.router_aux_coef of the actor; the trainer sets
    # it): forward() then also returns router_aux_loss, the aux loss of the actor's passes in it, which
    # router_aux_parts collects while it runs.
    router_aux_coef: float = 0.0
    router_aux_parts: "list[RouterAuxPart] | None" = None

    def hidden(self, role: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor, cache: "DynamicCache | None" = None) -> torch.Tensor:
        """The role's last hidden states [rows, columns, hidden]; with cache, the pass reads the keys and values
        already in it (attention_mask then covers them too) and appends its own."""
        raise NotImplementedError

    def head(self, role: str) -> torch.nn.Module:
        raise NotImplementedError

    def backbone_pass(self, role: str, model: "PreTrainedModel", input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, cache: "DynamicCache | None") -> torch.Tensor:
        """hidden() through model's decoder stack (model: the role's causal LM or classifier). In the actor's passes
        of a training forward (router_aux_parts collecting, grad on) also its routers' load-balancing loss over the
        pass's real tokens (its mask's last columns: a pass over a cache runs the newest ones)."""
        parts = self.router_aux_parts if role == "actor" and torch.is_grad_enabled() else None
        outputs = backbone_of(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                     past_key_values=cache, use_cache=cache is not None,
                                     **({"output_router_logits": True} if parts is not None else {}))
        if parts is not None:
            tokens = attention_mask[:, attention_mask.shape[1] - input_ids.shape[1]:]
            aux_loss = aux_loss_from_router_logits(model, outputs.router_logits, tokens)
            parts.append(RouterAuxPart(aux_loss, tokens.sum()))
        return outputs.last_hidden_state

    def generator(self) -> "PreTrainedModel":
        """The actor as a causal LM, with generate()."""
        raise NotImplementedError

    @property
    def config(self) -> "PreTrainedConfig":
        """The actor's config: the Trainer and DeepSpeed size their buffers from it."""
        return self.actor_config()

    def actor_config(self) -> "PreTrainedConfig":
        raise NotImplementedError

    def trained_models(self) -> list["PreTrainedModel"]:
        """The models whose layers train (--gradient_checkpointing turns on their checkpointing)."""
        raise NotImplementedError

    def answer_logprobs(self, role: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        prompt_length: int) -> torch.Tensor:
        """log p of each answer token under the role (actor or reference), from the logits at the position
        before it, temperature applied: the distribution the answer was sampled from. The head runs on
        answer positions only."""
        hidden = self.answer_hidden(role, input_ids, attention_mask, prompt_length)
        return self.head_logprobs(role, hidden, input_ids[:, prompt_length:], self.temperature)

    def answer_hidden(self, role: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_length: int) -> torch.Tensor:
        """The hidden states that predict each answer token [rows, answer, hidden]: the last prompt position's and
        every answer position's but the last."""
        if self.share_prompts:
            return self.prompt_shared_hidden(role, input_ids, attention_mask, prompt_length)
        hidden = self.hidden(role, input_ids, attention_mask, positions_from_mask(attention_mask))
        return hidden[:, prompt_length - 1 : -1]

    def prompt_shared_hidden(self, role: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             prompt_length: int) -> torch.Tensor:
        """answer_hidden with each distinct prompt run once: its keys and values are repeated to every row that
        repeats it and the answers run on from there, so G answers to one prompt pay for its tokens once. The
        numbers of one pass over every row (to float rounding; the gradients of a prompt's rows meet in its one
        pass; LoRA dropout, where set, draws one mask per prompt, not per row). Always two passes, even where no
        prompt repeats: under ZeRO-3 every rank must run as many."""
        from transformers import DynamicCache

        prompt_columns = torch.cat([input_ids[:, :prompt_length], attention_mask[:, :prompt_length]], dim=1)
        distinct, owner = torch.unique(prompt_columns, dim=0, return_inverse=True)
        ids, mask = distinct[:, :prompt_length], distinct[:, prompt_length:]
        cache = DynamicCache(config=self.config)
        prompt_hidden = self.hidden(role, ids, mask, positions_from_mask(mask), cache)
        cache.batch_select_indices(owner)
        answer_hidden = self.hidden(role, input_ids[:, prompt_length:], attention_mask,
                                    positions_from_mask(attention_mask)[:, prompt_length:], cache)
        return torch.cat([prompt_hidden[owner, -1:], answer_hidden[:, :-1]], dim=1)

    def head_logprobs(self, role: str, hidden: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
        """log softmax(head(hidden) / temperature) at labels [rows, positions]: over chunks of positions
        with chunked_loss (the head checkpointed, recomputed under this role), else from the whole
        logits (half precision kept so: rl_math reduces them row by row in float32)."""
        head = self.head(role)
        if self.chunked_loss:
            return token_logprobs(hidden, head, labels, temperature, self.checkpointing_options({}).get("context_fn"))
        logits = head(hidden)
        return logprobs_from_logits(logits if temperature == 1.0 else logits.float() / temperature, labels)

    def answer_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> torch.Tensor:
        hidden = self.hidden("critic", input_ids, attention_mask, positions_from_mask(attention_mask))
        return self.head("critic")(hidden[:, prompt_length - 1 : -1]).squeeze(-1).float()

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The reward model's score of each row, read at its last attended token."""
        hidden = self.hidden("reward", input_ids, attention_mask, positions_from_mask(attention_mask))
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_position(attention_mask)]
        return self.head("reward")(pooled).squeeze(-1).float()

    def ptx_loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The actor's next-token loss on a pretraining block (DeepSpeed-Chat's unsupervised term)."""
        ones = torch.ones_like(input_ids)
        hidden = self.hidden("actor", input_ids, ones, positions_from_mask(ones))[:, :-1]
        if self.chunked_loss:
            return -self.head_logprobs("actor", hidden, input_ids[:, 1:], 1.0).mean()
        logits = self.head("actor")(hidden).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))

    def over_length_groups(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                           passes: RowPasses) -> dict[str, torch.Tensor]:
        """passes(ids, mask, prompt_length) -> {name: [rows, answer] or [rows] tensor}, run on
        groups of rows of similar length, each cut to its own longest prompt and answer, the results
        put back in row order (per-token ones zero-padded to the batch's answer width). In a PPO
        batch, left-padded prompts of mixed lengths and answers that stop at different lengths
        make a sixth or more of the positions padding; cut away, they cost nothing. The real
        tokens see exactly what they saw in the full batch (same positions, same mask)."""
        if not self.group_by_length:
            return passes(input_ids, attention_mask, prompt_length)
        answer_width = input_ids.shape[1] - prompt_length
        prompt_lengths = attention_mask[:, :prompt_length].sum(-1).tolist()
        answer_lengths = attention_mask[:, prompt_length:].sum(-1).clamp(min=1).tolist()
        min_rows = max(4, math.ceil(len(prompt_lengths) / 4))
        parts: dict[str, list[torch.Tensor]] = {}
        order: list[torch.Tensor] = []
        for rows, prompt_width, group_answer_width in length_chunks(prompt_lengths, answer_lengths, min_rows):
            index = torch.tensor(rows, device=input_ids.device)
            columns = slice(prompt_length - prompt_width, prompt_length + group_answer_width)
            results = passes(input_ids[index, columns], attention_mask[index, columns], prompt_width)
            for name, value in results.items():
                if value.dim() == 2:
                    value = F.pad(value, (0, answer_width - value.shape[1]))
                parts.setdefault(name, []).append(value)
            order.append(index)
        inverse = torch.argsort(torch.cat(order))
        return {name: torch.cat(values)[inverse] for name, values in parts.items()}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                ptx_input_ids: torch.Tensor | None = None, values: bool = True) -> dict[str, torch.Tensor]:
        """The training pass: the actor's log-probs of the answer tokens and (values=True) the critic's values.
        values=False is the experience's no-grad pass for the old policy's log-probs: the same computation."""

        def passes(ids: torch.Tensor, mask: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
            result = {"logprobs": self.answer_logprobs("actor", ids, mask, width)}
            if values:
                result["values"] = self.answer_values(ids, mask, width)
            return result

        self.router_aux_parts = [] if self.router_aux_coef > 0 else None
        try:
            outputs = self.over_length_groups(input_ids, attention_mask, prompt_length, passes)
            if ptx_input_ids is not None:
                outputs["ptx_loss"] = self.ptx_loss(ptx_input_ids)
        finally:
            parts, self.router_aux_parts = self.router_aux_parts, None
        if parts:  # the passes' aux losses weighted by their tokens: groups of rows, a prompt pass, the ptx block
            tokens = torch.stack([part.tokens for part in parts]).float()
            aux = torch.stack([part.aux_loss.float() for part in parts])
            outputs["router_aux_loss"] = (aux * tokens).sum() / tokens.sum().clamp(min=1)
        return outputs

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict[str, Any] | None = None,
                                        **kwargs: Any) -> None:
        """--gradient_checkpointing: on every trained model's layers (the Trainer calls this)."""
        options = self.checkpointing_options(dict(activation_checkpointing_kwargs or {}))
        for model in self.trained_models():
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=options or None, **kwargs)

    def checkpointing_options(self, options: dict[str, Any]) -> dict[str, Any]:
        return options

    # What is saved: subclasses name the actor's and critic's parameters and peft models.
    def actor_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        raise NotImplementedError

    def is_critic_parameter(self, name: str) -> bool:
        raise NotImplementedError

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """The actor adapter alone (SavePeftModelCallback writes ppo_lora_model through this)."""
        raise NotImplementedError

    def save_critic(self, path: str) -> None:
        raise NotImplementedError


class SharedBasePolicy(RolePolicy):
    """One frozen base, adapters switched per role: "default" (the actor, trained), "critic"
    (trained, started from the reward adapter) with a value head, "reward" (frozen) with the
    reward score head, and the reference: the "reference" adapter (a frozen copy of the SFT
    adapter) or, without one, the base with no adapter active.

    Roles are switched by setting each peft layer's active adapter directly: peft's own
    set_adapter / disable_adapter also flip requires_grad, which would freeze the actor while
    the critic runs in the same training step (and confuse DeepSpeed, which registers its
    gradient hooks once)."""

    ADAPTERS = {"actor": "default", "critic": "critic", "reward": "reward"}

    def __init__(self, peft_model: "PeftModel", score_head: torch.nn.Linear | None, value_head: torch.nn.Linear | None,
                 reference_adapter: str | None, reward_adapter_dir: str | None) -> None:
        """score_head and reward_adapter_dir: the reward model's (None without one: GRPO's rule-based rewards);
        value_head: the critic's (None without a critic: GRPO)."""
        super().__init__()
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        self.policy = peft_model
        self.score_head = score_head
        self.value_head = value_head
        self.reference_adapter = reference_adapter
        self.reward_adapter_dir = reward_adapter_dir
        self._tuner_layers = [m for m in peft_model.modules()
                              if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]

    @property
    def causal_lm(self) -> "PreTrainedModel":
        # A property, not an attribute: a second registration would put the base in state_dict twice.
        return base_model(self.policy)

    def use(self, role: str) -> None:
        name = self.reference_adapter if role == "reference" else self.ADAPTERS[role]
        active = [name] if name else []
        for layer in self._tuner_layers:
            layer._active_adapter = active
        self.active_role = role

    @contextmanager
    def role_active(self, role: str) -> Iterator[None]:
        previous = getattr(self, "active_role", "actor")
        self.use(role)
        try:
            yield
        finally:
            self.use(previous)

    def checkpointing_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """A checkpointed layer is recomputed during backward, after later roles switched the
        adapters: recompute it under the role that ran it (torch's context_fn, which needs the
        non-reentrant checkpoint)."""

        def contexts() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
            return nullcontext(), self.role_active(self.active_role)

        return {**options, "use_reentrant": False, "context_fn": contexts}

    def hidden(self, role: str, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               position_ids: torch.Tensor, cache: "DynamicCache | None" = None) -> torch.Tensor:
        self.use(role)
        return self.backbone_pass(role, self.causal_lm, input_ids, attention_mask, position_ids, cache)

    def head(self, role: str) -> torch.nn.Module:
        if role in ("actor", "reference"):
            return self.causal_lm.get_output_embeddings()
        head = self.value_head if role == "critic" else self.score_head
        assert head is not None, f"no {role} head: the stage runs without that role"
        return head

    def generator(self) -> "PreTrainedModel":
        self.use("actor")
        return self.causal_lm

    def actor_config(self) -> "PreTrainedConfig":
        return self.causal_lm.config

    def trained_models(self) -> list["PreTrainedModel"]:
        return [self.causal_lm]

    def actor_named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name[len("policy."):], p) for name, p in self.named_parameters()
                if p.requires_grad and name.startswith("policy.") and ".default." in name]

    def is_critic_parameter(self, name: str) -> bool:
        return name.startswith("value_head.") or ".critic." in name

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        self.policy.save_pretrained(path, selected_adapters=["default"])

    def save_critic(self, path: str) -> None:
        """rm_lora_model's layout (LoRA + score head on the same base), so the critic loads like a
        reward adapter: PeftModel.from_pretrained(reward_model_class(config)(base), path)."""
        from peft import LoraConfig, get_peft_model_state_dict

        assert self.value_head is not None and self.reward_adapter_dir is not None, "a critic only where PPO made one"
        weights = get_peft_model_state_dict(self.policy, adapter_name="critic")
        weights["base_model.model.score.weight"] = self.value_head.weight
        os.makedirs(path, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                  os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        LoraConfig.from_pretrained(self.reward_adapter_dir).save_pretrained(path)


def base_model(peft_model: "PeftModel") -> "PreTrainedModel":
    """The transformers model under a role's adapters."""
    # peft annotates get_base_model() as any nn.Module; every peft model here wraps a transformers model.
    return cast("PreTrainedModel", peft_model.get_base_model())


def frozen_dtype(causal_lm: "PreTrainedModel") -> torch.dtype:
    """The dtype of the base's frozen weights, read off its output embedding (a --modules_to_save lm_head's trained
    copy is kept in float32: the frozen original's)."""
    output_embedding = causal_lm.get_output_embeddings()
    return getattr(output_embedding, "original_module", output_embedding).weight.dtype


def peft_model_of(model: "PreTrainedModel | PeftModel") -> "PeftModel":
    """models.loader.load_model's trainable model in an RL stage: a peft model (the stages refuse --full_finetuning,
    the one way load_model returns the base itself)."""
    import peft

    assert isinstance(model, peft.PeftModel), "an RL stage trains LoRA adapters (--full_finetuning refused)"
    return model


def role_model_args(model_args: ModelArguments, model_dir: str, adapter_dir: str | None) -> ModelArguments:
    """The shared loader's arguments for one role: PPO's own (dtype, quantization, LoRA shape, new
    embedding rows, ...; PPOModelArguments extends ModelArguments) with that role's model and adapter."""
    shared = {item.name: getattr(model_args, item.name) for item in fields(ModelArguments)}
    return ModelArguments(**{**shared, "model_name_or_path": model_dir, "peft_path": adapter_dir})


class RewardAdapterParts(NamedTuple):
    """A reward adapter's weights by name, split into its LoRA layers and its score head."""

    lora: dict[str, torch.Tensor]
    score: dict[str, torch.Tensor]


def reward_adapter_parts(adapter_dir: str) -> RewardAdapterParts:
    """(LoRA weights, score head weights) of a reward adapter saved by run_reward.py."""
    weights = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    score = {k: v for k, v in weights.items() if ".score." in f".{k}"}
    lora = {k: v for k, v in weights.items() if k not in score}
    return RewardAdapterParts(lora, score)


def add_reward_adapter(policy: "PeftModel", name: str, config: "LoraConfig", lora_weights: dict[str, torch.Tensor],
                       adapter_dir: str) -> None:
    """The reward adapter's LoRA layers (lora_weights, config: its LoraConfig for the causal LM) added to policy's
    base as adapter `name`; refused where its weights do not fit that base."""
    from peft import set_peft_model_state_dict

    policy.add_adapter(name, config)
    unexpected = getattr(set_peft_model_state_dict(policy, lora_weights, adapter_name=name), "unexpected_keys", None)
    if unexpected:
        raise InputError(f"{adapter_dir}: adapter does not fit the actor's base (unexpected {unexpected[:3]})")


def new_score_head(hidden_size: int, score_weights: dict[str, torch.Tensor], dtype: torch.dtype,
                   trainable: bool) -> torch.nn.Linear:
    weight = next(v for k, v in score_weights.items() if k.endswith(SCORE_KEY_SUFFIX))
    bias = next((v for k, v in score_weights.items() if k.endswith("score.bias")), None)
    head = torch.nn.Linear(hidden_size, weight.shape[0], bias=bias is not None, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias)
    head.requires_grad_(trainable)
    return head
