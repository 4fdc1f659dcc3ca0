"""The models the GPU benchmark builds: the shapes of published configs (random seeded weights, nothing downloaded),
the tiny ones the CPU smoke run stands them in with, and the settings both sides of every run share.

  llama-1b   Llama-3.2-1B's shape     (hidden 2048, 16 layers, GQA 32/8 heads, vocab 128,256, tied head)
  llama-7b   Llama-2-7B's shape       (hidden 4096, 32 layers, 32 heads, vocab 32,000)
  qwen-1b    Qwen2.5-1.5B's shape     (hidden 1536, 28 layers, GQA 12/2 heads, vocab 151,936, tied head)
  qwen-7b    Qwen2.5-7B's shape       (hidden 3584, 28 layers, GQA 28/4 heads, vocab 152,064)
  qwen3-moe  Qwen3-30B-A3B's layers   (hidden 2048, 128 experts of 768, 8 routed per token, GQA 32/4 heads of 128,
                                       vocab 151,936), 12 of its 48 layers
The 7B shapes are the headline models (the baseline, TRL, QLoRA); the 1B shapes are where our variants are explored,
each 1B shape's best re-run at the 7B shape of its family. Qwen3-30B-A3B in full is 61 GB of bf16 weights, more than
the lent machine's disk holds beside a 7B shape and more than its GPU holds for LoRA training: 12 of its layers
(about 8B weights, 16 GB) keep each layer's shape, which is what a step's speed per layer depends on.
"""

from __future__ import annotations

SEED = 42
LEARNING_RATE = 1e-4
LORA = {"r": 8, "alpha": 32, "dropout": 0.05, "targets": "all-linear"}  # the toolkit's defaults, on both sides

# (family, config fields, rows per SFT batch at --seq_len): the published configs' shapes.
SHAPES = {
    "llama-1b": ("llama", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                           "tie_word_embeddings": True, "rope_theta": 500000.0}, 4),
    "llama-7b": ("llama", {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                           "tie_word_embeddings": False}, 2),
    "qwen-1b": ("qwen2", {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                          "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                          "tie_word_embeddings": True, "rope_theta": 1000000.0}, 4),
    "qwen-7b": ("qwen2", {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                          "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                          "tie_word_embeddings": False, "rope_theta": 1000000.0}, 2),
    "qwen3-moe": ("qwen3_moe", {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                                "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 12,
                                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                                "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                                "router_aux_loss_coef": 0.001}, 2),
}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 2048}
SMOKE_SHAPES = {"llama-tiny": ("llama", {**TINY, "tie_word_embeddings": False}, 4),
                "qwen-tiny": ("qwen2", {**TINY, "tie_word_embeddings": True}, 4),
                "qwen3-moe-tiny": ("qwen3_moe", {**TINY, "moe_intermediate_size": 16, "num_experts": 4,
                                                 "num_experts_per_tok": 2, "head_dim": 16,
                                                 "tie_word_embeddings": False, "router_aux_loss_coef": 0.001}, 4)}
# The shape each role of a plan names, on a GPU and in the smoke run. In the smoke run the tiny Llama plays the 1B
# role and the tiny Qwen the 7B one, so that every step of a plan runs there.
ROLE_MODELS = {"7b": "llama-7b", "1b": "llama-1b", "moe": "qwen3-moe"}
SMOKE_ROLE_MODELS = {"7b": "qwen-tiny", "1b": "llama-tiny", "moe": "qwen3-moe-tiny"}
# Where each explored (1B) shape's best variant is re-run: its family's 7B shape.
EXPLORED_FOR = {"llama-1b": "llama-7b", "qwen-1b": "qwen-7b"}
SMOKE_EXPLORED_FOR = {"llama-tiny": "qwen-tiny"}
# The shapes whose runs need the large models' start-up time (the 7B shapes and the MoE one, ~14-16 GB to load).
LARGE = {"llama-7b", "qwen-7b", "qwen3-moe"}


def is_moe(shape: dict) -> bool:
    """A mixture-of-experts config (Qwen's num_experts, Mixtral's num_local_experts)."""
    return bool(shape.get("num_experts") or shape.get("num_local_experts"))


def model_config(family: str, shape: dict, max_positions: int) -> dict:
    return {"model_type": family, **shape, "max_position_embeddings": max_positions}
