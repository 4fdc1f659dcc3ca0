"""The merge tools (scripts/merge) driven from tests, and what their tests build and compare: tiny Llama bases,
seeded LoRA adapters whose every trainable tensor is visibly non-zero, logits in float32."""

import json
import os

import torch

# The largest absolute logit difference allowed between our merge and peft's merge_and_unload, in float32.
TOLERANCE = 1e-4


def tiny_llama(vocab_size: int, tied: bool = False, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).eval()


def randomize(peft_model, seed: int) -> None:
    """Give every trainable tensor (LoRA A and B, saved modules) a visible, seeded change."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if parameter.requires_grad:
                noise = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
                if "lora_" in name:
                    parameter.copy_(noise * 0.1)
                else:
                    parameter.add_(noise * 0.05)


def lora(model, seed: int, **config):
    from peft import LoraConfig, get_peft_model

    options = {"r": 4, "lora_alpha": 8, "init_lora_weights": False, "target_modules": "all-linear", **config}
    peft_model = get_peft_model(model, LoraConfig(**options))
    randomize(peft_model, seed)
    return peft_model.eval()


def merge(base_dir, adapters, output_dir, *extra) -> None:
    """merge_llama_with_lora.py's main() with these arguments."""
    from lorakit.commands import merge as merge_llama_with_lora

    merge_llama_with_lora.main(["--base_model", str(base_dir), "--lora_model", ",".join(map(str, adapters)),
                                "--output_dir", str(output_dir), *map(str, extra)])


def extend(base_dir, output_dir, *extra) -> dict:
    """merge_tokenizers.py's main() with these arguments; returns the report it writes."""
    from lorakit.commands import merge_tokenizers
    from lorakit.merge.tokenizers import REPORT_FILE

    merge_tokenizers.main(["--base_tokenizer", base_dir, "--output_dir", str(output_dir), *map(str, extra)])
    with open(os.path.join(output_dir, REPORT_FILE), encoding="utf-8") as handle:
        return json.load(handle)


def logits_of(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def load_merged(path, sequence_classification=False):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if sequence_classification else AutoModelForCausalLM
    return auto.from_pretrained(str(path), dtype=torch.float32).eval()
