"""--trainable all-linear (the default): the LoRA targets found in each architecture by module
type, on tiny models built from configs in-process."""

import logging

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lorakit.models.adapters import attach_lora, lora_target_modules
from lorakit.models.arguments import DEFAULT_LORA_TARGETS, ModelArguments
from lorakit.rl.ppo_config import PPOModelArguments

# The default before all-linear: Llama's names, which every other architecture lacked.
LLAMA_NAMES = {"q_proj", "v_proj", "k_proj", "o_proj", "gate_proj", "down_proj", "up_proj"}
TINY = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def tiny_llama():
    return LlamaForCausalLM(LlamaConfig(**TINY))


def tiny_phi3():
    return Phi3ForCausalLM(Phi3Config(**TINY, pad_token_id=0))


def tiny_qwen2():
    return Qwen2ForCausalLM(Qwen2Config(**TINY))


def tiny_gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64))


def tiny_llama_classifier():
    return LlamaForSequenceClassification(LlamaConfig(**TINY, num_labels=1, pad_token_id=0))


@pytest.mark.parametrize("build, expected", [
    (tiny_llama, LLAMA_NAMES),
    (tiny_qwen2, LLAMA_NAMES),
    (tiny_phi3, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}),
    (tiny_gpt2, {"c_attn", "c_proj", "c_fc"}),  # transformers' Conv1D, not nn.Linear
    (tiny_llama_classifier, LLAMA_NAMES),  # the score head is not a target
], ids=["llama", "qwen2", "phi3", "gpt2", "llama_classifier"])
def test_all_linear_finds_each_architectures_own_layers(build, expected):
    targets = lora_target_modules(build(), "all-linear", [])
    assert len(targets) == len(set(targets))
    assert set(targets) == expected


def test_all_linear_is_the_default_of_every_stage():
    assert DEFAULT_LORA_TARGETS == "all-linear"
    assert ModelArguments(model_name_or_path="m").trainable == DEFAULT_LORA_TARGETS
    ppo_args = PPOModelArguments(actor_model_name_or_path="a", reward_model_name_or_path="r")
    assert ppo_args.trainable == DEFAULT_LORA_TARGETS


def test_an_explicit_list_is_taken_as_given():
    assert lora_target_modules(tiny_gpt2(), " q_proj, v_proj ", []) == ["q_proj", "v_proj"]


def test_modules_to_save_are_not_targets():
    assert set(lora_target_modules(tiny_llama(), "all-linear", ["o_proj"])) == LLAMA_NAMES - {"o_proj"}


@pytest.mark.parametrize("build, task, head", [
    (tiny_gpt2, "causal_lm", "lm_head"),
    (tiny_phi3, "causal_lm", "lm_head"),
    (tiny_llama_classifier, "reward", "score"),
], ids=["gpt2", "phi3", "llama_classifier"])
def test_attach_lora_adapts_every_decoder_layer_and_no_head(build, task, head, caplog):
    """The resolved names are what peft gets and saves (not the 'all-linear' shorthand), every
    linear layer of the decoder gets an adapter, the head none, and the list is logged."""
    with caplog.at_level(logging.INFO, logger="lorakit.models"):
        model = attach_lora(build(), ModelArguments(model_name_or_path="unused"), task)
    targets = model.peft_config["default"].target_modules
    assert isinstance(targets, set) and "all-linear" not in targets
    logged = [record.getMessage() for record in caplog.records if "LoRA targets" in record.getMessage()]
    assert len(logged) == 1 and logged[0].startswith("LoRA targets (all-linear): ")
    assert set(logged[0].split(": ", 1)[1].split(",")) == targets
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == targets
    assert not any(name.endswith(head) and hasattr(module, "lora_A") for name, module in model.named_modules())


def test_gpt2_conv1d_targets_train_through_peft():
    model = attach_lora(tiny_gpt2(), ModelArguments(model_name_or_path="unused"))
    ids = torch.arange(8).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    lora = [param for name, param in model.named_parameters() if "lora_" in name]
    assert lora and all(param.requires_grad and param.grad is not None for param in lora)


def test_quantized_layers_are_found_like_linear_ones():
    """QLoRA bases hold bitsandbytes layers where the Linear ones were."""
    from bitsandbytes.nn import Linear4bit, Linear8bitLt

    model = tiny_llama()
    mlp = model.model.layers[0].mlp
    mlp.up_proj, mlp.down_proj = Linear4bit(32, 64, bias=False), Linear8bitLt(64, 32, bias=False)
    model.model.layers[1].mlp = torch.nn.Identity()  # layer 0 alone now carries up_proj and down_proj
    assert set(lora_target_modules(model, "all-linear", [])) == LLAMA_NAMES
