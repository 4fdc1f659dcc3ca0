"""The task heads beyond the causal LM: the reward model's sequence classifier pooled at each row's last attended
token (a chosen/rejected pair packed in one row scored with a block mask), and DPO's model that returns its answer
tokens' log-probabilities, its LM head run on answer positions only."""

import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)
from transformers.modeling_outputs import SequenceClassifierOutputWithPast
from transformers.utils import ModelOutput

from lorakit.core.cli import InputError
from lorakit.core.pair_segments import PAIR_CHOSEN, PAIR_PADDING, PAIR_REJECTED
from lorakit.models.chunked_loss import agreed_across_ranks, head_gives_logits, label_logprobs, token_logprobs
from lorakit.models.dpo_losses import PairScores
from lorakit.models.positions import last_position, positions_from_mask
from lorakit.models.router import aux_loss_from_router_logits, causal_model
from lorakit.models.zero3 import weight_of

if TYPE_CHECKING:  # the classes are built from the checkpoint's own; modeling_utils loads with them
    from transformers import PreTrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)


# Attention implementations that take an arbitrary 4D mask (flash attention does not).
MASKABLE_ATTENTION = ("sdpa", "eager")


def pair_attention_mask(pair_segments: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4D mask of shared-prefix pair rows: causal, except that the rejected answer does not
    see the chosen one, so it sees exactly the prefix and itself, as in a row of its own. Padding
    is at the end, where causality already hides it from real tokens. sdpa takes it as bool
    (True: attend), eager as an additive float mask."""
    width = pair_segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=pair_segments.device).tril()
    hidden_chosen = (pair_segments[:, :, None] == PAIR_REJECTED) & (pair_segments[:, None, :] == PAIR_CHOSEN)
    allowed = (causal[None] & ~hidden_chosen)[:, None]
    if attn_implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def mask_pooled_forward(self: "PreTrainedModel", input_ids: torch.Tensor | None = None,
                        attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                        inputs_embeds: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                        pair_segments: torch.Tensor | None = None, **kwargs: Any) -> SequenceClassifierOutputWithPast:
    """One score per row, read at the row's last attended token: right for left and right padding
    and mixed lengths. transformers' own pooling takes the last id that is not the pad id, which
    is wrong when the pad token is EOS, as it often is. Positions come from the mask, so left
    padding does not shift them; the head runs on the pooled rows only.

    With pair_segments (rows of prefix + chosen answer + rejected answer, their position_ids
    given), one row scores a pair: the chosen scores of all rows, then the rejected ones."""
    if pair_segments is not None:
        mask = pair_attention_mask(pair_segments, self.config._attn_implementation,
                                   weight_of(self.get_input_embeddings()).dtype)
        hidden = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        pooled = torch.cat([hidden[rows, last_position(pair_segments == PAIR_CHOSEN)],
                            hidden[rows, last_position(pair_segments == PAIR_REJECTED)]])
        return SequenceClassifierOutputWithPast(logits=self.get_submodule("score")(pooled))
    if attention_mask is None:
        if input_ids is None:
            raise ValueError("the reward model pools at the last attended token: give input_ids or an attention_mask")
        attention_mask = torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)
    if position_ids is None:
        position_ids = positions_from_mask(attention_mask)
    hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state
    pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_position(attention_mask)]
    # get_submodule, not self.score: nn.Module's __getattr__ types an attribute as a Tensor or a Module.
    return SequenceClassifierOutputWithPast(logits=self.get_submodule("score")(pooled))


def mapped_model_class(mapping: Mapping[Any, Any], config: "PreTrainedConfig") -> "type[PreTrainedModel]":
    """The model class an auto class's mapping holds for config's class: transformers types the mapping's values
    as a (slow, fast) pair of classes, which is true of the tokenizers' mapping only."""
    return cast("type[PreTrainedModel]", mapping[type(config)])


def reward_model_class(config: "PreTrainedConfig") -> "type[PreTrainedModel]":
    """The checkpoint's own sequence-classification class with mask_pooled_forward."""
    mapping = AutoModelForSequenceClassification._model_mapping
    if type(config) not in mapping:
        # A --trust_remote_code config class: its own code may have no classifier, nor the
        # .model/.score layout mask_pooled_forward reads.
        raise InputError(f"{getattr(config, '_name_or_path', '')}: the reward model needs an architecture "
                         f"transformers has a sequence classifier for; {type(config).__name__} has none here")
    base = mapped_model_class(mapping, config)
    # Named as its base: save_pretrained writes the class name into config.json's architectures,
    # and a saved (merged) reward model must name a class transformers has.
    return type(base.__name__, (base,), {"forward": mask_pooled_forward, "__doc__": mask_pooled_forward.__doc__})


def score_sequences(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scores of a batch from a model loaded with task="reward" (one float per row)."""
    return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()


def score_pairs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> PairScores:
    """(chosen, rejected) scores of a DataCollatorForPreferencePairs batch, either layout."""
    inputs = {name: value for name, value in batch.items() if name != "margin"}
    return PairScores(*model(**inputs).logits.squeeze(-1).float().chunk(2))


@dataclass
class AnswerLogps(ModelOutput):
    """answer_logps_forward's output: the log-probability of each answer token, float32 [len(answer_index)], and,
    asked with output_router_logits, the routers' load-balancing loss (a scalar, not yet weighted)."""

    token_logps: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def head_alone_gives_logits(model: "PreTrainedModel", input_ids: torch.Tensor) -> bool:
    """Whether the output embeddings applied to the last hidden states give the model's own logits (no
    soft-capping or scaling after the head), checked on one row in eval mode (dropout, of a LoRA on the head
    say, would make the two differ). The model's own forward is called as a function, not through the module,
    so it can run inside answer_logps_forward (under ZeRO-3 only the submodules' gathering hooks run, as in
    any forward)."""
    forward = super(type(model), model).forward
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(forward).parameters else {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = forward(input_ids=input_ids[:1], use_cache=False, output_hidden_states=True, **keep)
            return head_gives_logits(model.get_output_embeddings(), outputs)
    finally:
        model.train(was_training)


def answer_head_exact(model: "PreTrainedModel", input_ids: torch.Tensor) -> bool:
    """Whether the head alone gives the model's logits (head_alone_gives_logits), agreed by every rank: decided on
    the first call with answers."""
    exact = agreed_across_ranks(head_alone_gives_logits(model, input_ids), model.get_output_embeddings(),
                                input_ids.device)
    if not exact:
        logger.info("answer log-probs from the model's full logits: its forward changes the logits after "
                    "the output embeddings")
    return exact


class AnswerAttention(NamedTuple):
    """The attention mask the forward takes, and the real tokens (what the router's aux loss is over)."""

    mask: torch.Tensor | None
    tokens: torch.Tensor | None


def answer_attention(model: "PreTrainedModel", attention_mask: torch.Tensor | None,
                     pair_segments: torch.Tensor | None) -> AnswerAttention:
    """Shared-prefix pair rows get the reward model's pair mask; other rows keep their own."""
    if pair_segments is None:
        return AnswerAttention(attention_mask, attention_mask)
    mask = pair_attention_mask(pair_segments, model.config._attn_implementation,
                               weight_of(model.get_input_embeddings()).dtype)
    return AnswerAttention(mask, pair_segments != PAIR_PADDING)


def answer_logps_forward(self: "PreTrainedModel", input_ids: torch.Tensor | None = None,
                         attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                         pair_segments: torch.Tensor | None = None, answer_index: torch.Tensor | None = None,
                         answer_targets: torch.Tensor | None = None, output_router_logits: bool = False,
                         **kwargs: Any) -> ModelOutput:
    """With answer_index (flat indices into the batch's [rows * width] positions) and answer_targets (the
    token each of those positions predicts): AnswerLogps, each answer token's log-probability. The LM head
    runs on those positions only, in chunks of positions recomputed in backward (self.chunked_loss,
    models.chunked_loss.token_logprobs): no vocabulary-wide work on prompt or padding positions, no float32
    [answer tokens, vocabulary] tensor kept. A model that changes its logits after the head (Gemma-2's
    soft-capping; found on the first call) gets its own full forward instead. pair_segments: shared-prefix
    pair rows with their position ids, masked as the reward model masks them. output_router_logits (a mixture of
    experts): AnswerLogps.aux_loss too, the routers' load-balancing loss over the batch's real tokens (a pair row's
    shared prompt once). Without answer_index, the model's own forward."""
    own_forward = super(type(self), self).forward
    routed = {"output_router_logits": True} if output_router_logits else {}
    if answer_index is None:
        return own_forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **routed,
                           **kwargs)
    if input_ids is None or answer_targets is None:
        raise ValueError("answer_index needs input_ids and answer_targets (DataCollatorForAnswerLogps gives them)")
    if self.answer_head_exact is None:
        self.answer_head_exact = answer_head_exact(self, input_ids)
    attention_mask, tokens = answer_attention(self, attention_mask, pair_segments)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": False, **routed}
    if not self.answer_head_exact:
        # Its own aux_loss, if any, read a pair row's 4D mask as padding: recomputed from the logits below.
        outputs = own_forward(**inputs)
        token_logps = label_logprobs(outputs.logits.flatten(0, 1)[answer_index], answer_targets)
    else:
        outputs = self.base_model(**inputs)
        hidden = outputs.last_hidden_state.flatten(0, 1)[answer_index]
        head = self.get_output_embeddings()
        token_logps = (token_logprobs(hidden, head, answer_targets) if self.chunked_loss
                       else label_logprobs(head(hidden), answer_targets))
    aux_loss = aux_loss_from_router_logits(self, outputs.router_logits, tokens) if output_router_logits else None
    return AnswerLogps(token_logps, aux_loss)


def answer_logps_model_class(config: "PreTrainedConfig") -> "type[PreTrainedModel]":
    """The checkpoint's own causal-LM class with answer_logps_forward, named as its base so a saved config
    names a class transformers has. chunked_loss: set from --chunked_loss by the stage; answer_head_exact:
    decided on the first call with answers."""
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        raise InputError(f"{getattr(config, '_name_or_path', '')}: DPO needs an architecture transformers has a "
                         f"causal LM for; {type(config).__name__} has none here")
    base = mapped_model_class(mapping, config)
    return type(base.__name__, (base,), {"forward": answer_logps_forward, "__doc__": answer_logps_forward.__doc__,
                                         "chunked_loss": True, "answer_head_exact": None})


class AnswerLogpsSettings(Protocol):
    """The attributes answer_logps_model_class gives its class (nn.Module's typing takes any attribute set on a
    module to be a Tensor or a Module)."""

    chunked_loss: bool
    answer_head_exact: bool | None


def use_chunked_loss(model: torch.nn.Module, chunked: bool) -> None:
    """--chunked_loss for answer_logps_forward, set on the answer_logps_model_class model (under peft's wrapper)."""
    cast(AnswerLogpsSettings, causal_model(model)).chunked_loss = chunked
