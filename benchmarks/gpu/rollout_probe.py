"""Inside a child: the rollout engines (lorakit.rl.rollout) on one actor, built once in one process.

The model with a LoRA adapter (r 8, all linear layers, B not zero) sampling --ppo_prompts prompts of random ids,
--ppo_prompt_len tokens each, up to --ppo_answer_len new ones, with PPO's sampling settings: milliseconds per new token
(median of 3 timed calls after one warm-up call) eager with the adapter unmerged (what PPO's actor paid), eager merged
(--enable_hybrid_engine), and compiled merged (static KV cache, torch.compile with CUDA graphs; its warm-up call pays
the compile, reported with the graphs it built).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .probes import device_memory_mb, device_sync
from .shapes import SEED
from .specs import ROLLOUT_ENGINES


def rollout_actor(spec: dict) -> tuple[SimpleNamespace, Any]:
    """(the actor as the rollout engines take it, its device): the spec's model, bf16 on a GPU, with a seeded
    LoRA adapter on every linear layer whose B is not zero (so a merge changes the weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    on_gpu = torch.cuda.is_available() and not spec["smoke"]
    device = torch.device("cuda" if on_gpu else "cpu")
    network = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16 if on_gpu else torch.float32,
                                                   attn_implementation="sdpa").to(device)
    torch.manual_seed(SEED)
    lora = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    actor = get_peft_model(network, lora).eval().get_base_model()  # LoRA layers in the model, as PPO's actor
    return SimpleNamespace(generator=lambda: actor), device


def time_engine(engine: Any, prompt_ids: Any, prompt_mask: Any, calls: int) -> dict:
    """One warm-up call (timed: the compiled engine compiles there), then calls timed ones from the same seed:
    milliseconds per new token (the batch's answer width), their median."""
    import torch

    def one_call() -> tuple:
        torch.manual_seed(SEED)
        device_sync()
        started = time.perf_counter()
        with torch.no_grad():
            sampled = engine.sample(prompt_ids, prompt_mask)
        device_sync()
        return time.perf_counter() - started, sampled.tokens.shape[1]

    first_s, _ = one_call()
    timed = [one_call() for _ in range(calls)]
    return {"first_call_s": first_s, "answer_len": timed[-1][1],
            "ms_per_token": statistics.median(1000 * seconds / width for seconds, width in timed)}


def measure_rollout(spec: dict, run_dir: Path) -> dict:
    """Each of ROLLOUT_ENGINES on one actor built once (rollout_actor), PPO's sampling settings, prompts of random
    ids: time_engine's figures, and the graphs the compiled engine built."""
    import torch

    from lorakit.rl.rollout import compiled_graphs, rollout_engine

    policy, device = rollout_actor(spec)
    config = policy.generator().config
    generator = torch.Generator().manual_seed(SEED)
    prompt_ids = torch.randint(3, config.vocab_size, (spec["rows"], spec["prompt_len"]), generator=generator)
    prompt_ids, prompt_mask = prompt_ids.to(device), torch.ones_like(prompt_ids).to(device)
    figures = {"engines": {}, "device_memory_mb": None}
    for label, name, merge in ROLLOUT_ENGINES:
        args = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, world_size=1, chunked_loss=True, device=device,
                               generation_gather="auto", enable_hybrid_engine=merge, rollout_engine=name)
        engine = rollout_engine(policy, args, 0, config.eos_token_id, spec["answer_len"], lambda: None)
        graphs = compiled_graphs()
        figures["engines"][label] = {**time_engine(engine, prompt_ids, prompt_mask, spec["timed_calls"]),
                                     "graphs": compiled_graphs() - graphs}
    figures["device_memory_mb"] = device_memory_mb()
    return figures
