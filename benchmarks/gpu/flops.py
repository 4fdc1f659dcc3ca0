"""Model FLOPs utilisation (pure functions).

MFU = model FLOPs of the measured steps / (their seconds x the GPU's peak dense bf16 FLOP/s). Model FLOPs of one
LoRA training pass over a sample of t tokens (training_flops):
    (4 N + 6 N_lora) t + 12 L d t^2
N: the weights every token multiplies (decoder linear layers and the LM head; not the input embedding, a lookup):
2N forward and 2N for the gradients of the activations; the frozen weights get no weight gradients, which full
training's 6N (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B) adds. At a mixture of experts N counts the
router and the experts a token is routed to (num_experts_per_tok of them), not the others. N_lora: the trained LoRA
weights, 6 per token as in full training (at a mixture of experts every expert's, though a token reaches a few: an
overcount of at most that term). 12 L d t: PaLM's attention term per token (d = heads x head dim, L layers, t the
sample's length; full, not causally halved), times t tokens. Only non-padding tokens count, packed samples by their
own length. Peak bf16 dense FLOP/s by device name (PEAK_BF16_TFLOPS; H100 SXM and H200: 989 TFLOP/s); for another
GPU the MFU is not reported.
"""

from __future__ import annotations

from collections.abc import Iterable

# Peak dense (not sparse) bf16 tensor FLOP/s, in TFLOP/s, from the vendor's data sheets; the first name
# contained in torch.cuda.get_device_name() wins, so the PCIe/NVL variants come before the SXM part.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("A100", 312.0), ("L40S", 362.0))


def mlp_parameters(config: dict) -> int:
    """Weights of one layer's MLP that a token multiplies: a dense MLP's gate/up/down projections; a mixture of
    experts' router and the gate/up/down projections of the experts the token is routed to."""
    hidden = config["hidden_size"]
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        return 3 * hidden * config["intermediate_size"]
    width = config.get("moe_intermediate_size") or config["intermediate_size"]
    return hidden * experts + config["num_experts_per_tok"] * 3 * hidden * width


def matmul_parameters(config: dict) -> int:
    """Weights every token multiplies: the decoder layers' q/k/v/o projections and MLP (mlp_parameters) and the LM
    head (tied or not, it is a matmul); not the input embedding (a lookup), norms or biases."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    return layers * (attention + mlp_parameters(config)) + hidden * config["vocab_size"]


def attention_width(config: dict) -> int:
    """d of the attention term: query heads x head dim."""
    heads = config["num_attention_heads"]
    return heads * (config.get("head_dim") or config["hidden_size"] // heads)


def training_flops(lengths: Iterable[int], matmul_params: int, lora_params: int, layers: int, width: int) -> float:
    """Model FLOPs of one LoRA training pass (forward + backward) over samples of these token lengths:
    (4 N + 6 N_lora) t + 12 L d t^2 per sample (the module docstring derives it)."""
    return float(sum((4 * matmul_params + 6 * lora_params) * t + 12 * layers * width * t * t for t in lengths))


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of the named GPU, or None for one not in PEAK_BF16_TFLOPS."""
    return next((tflops * 1e12 for name, tflops in PEAK_BF16_TFLOPS if name in device_name), None)
