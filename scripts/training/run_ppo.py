#!/usr/bin/env python
"""PPO against a reward model with LoRA (DeepSpeed-Chat's step 3, InstructGPT's RL stage).

Four roles: the actor (the SFT policy with a LoRA adapter, trained), the reference (the actor's
frozen starting point), the reward model (frozen, from run_reward.py) and the critic (a value
model initialised from the reward model, trained). With --shared_base (the default when all of
them sit on one base model) ONE frozen base carries several peft adapters: four roles for the
memory of one base. Otherwise each role is its own model, as in DeepSpeed-Chat.

    torchrun --nproc_per_node 8 scripts/training/run_ppo.py \
        --actor_model_name_or_path BASE --actor_lora_model SFT_OUT/sft_lora_model \
        --reward_model_name_or_path BASE --reward_lora_model RM_OUT/rm_lora_model \
        --dataset_dir PROMPTS --max_prompt_seq_len 256 --max_answer_seq_len 256 \
        --output_dir OUT --max_steps 1000 --deepspeed ds_configs/ds_zero2_no_offload.json ...

The Trainer's "dataset" is the experience itself: each PPO iteration takes
--generation_batches batches of --per_device_generation_batch_size prompts per process,
generates answers with the current actor, scores them (actor and reference log-probs, critic
values, reward score), computes KL-penalised rewards and GAE advantages, and hands the Trainer
--ppo_epochs passes over the experience in micro-batches of --per_device_training_batch_size.
--max_steps counts optimizer steps, as everywhere: one iteration is
ppo_epochs * generation_batches * per_device_generation_batch_size
/ (per_device_training_batch_size * gradient_accumulation_steps) of them (logged at start).

Writes OUT/ppo_lora_model (actor adapter + tokenizer; it continues --actor_lora_model when one
was given, so base + ppo_lora_model is the PPO policy), OUT/actor_ema (with --enable_ema),
OUT/critic (critic adapter + value head, in rm_lora_model's layout) and resumable
OUT/checkpoint-N (at iteration boundaries, with the iteration counter, KL controller and EMA).
"""

import json
import logging
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, GenerationConfig, TrainerCallback, set_seed  # noqa: E402
from transformers.integrations import is_deepspeed_zero3_enabled  # noqa: E402

from build_dataset import (  # noqa: E402
    MESSAGE_ROLES,
    SHAREGPT_ROLES,
    ConversationDataArguments,
    ConversationTokenizer,
    SavePeftModelCallback,
    alpaca_messages,
    build_pretraining_blocks,
    data_cache_dir,
    find_sft_files,
    phase_indices,
    read_records,
    string_field,
    tokenizer_fingerprint,
    turn_list,
    validate_conversation,
)
from chat_templates import use_template  # noqa: E402
from model_utils import (  # noqa: E402
    DTYPES,
    ModelArguments,
    gathered_trainable,
    load_model,
    load_model_config,
    load_tokenizer,
    log_trainable,
    read_adapter_config,
    reward_model_class,
)
from ppo_utils import (  # noqa: E402
    ema_update,
    entropy_from_logits,
    gae_advantages_and_returns,
    kl_penalty_rewards,
    length_chunks,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from training_utils import (  # noqa: E402
    InputError,
    ResumableTrainer,
    ToolkitTrainingArguments,
    parse_args,
    resolve_resume_checkpoint,
    run_cli,
    setup_logging,
    train_and_finish,
)

logger = logging.getLogger(__name__)

PPO_STATE_NAME = "ppo_state.json"
TRAINABLE_WEIGHTS_NAME = "ppo_trainable.safetensors"
SCORE_KEY_SUFFIX = "score.weight"


# ----------------------------------------------------------------------------- arguments


@dataclass
class PPOModelArguments:
    """The four roles' models. Names follow DeepSpeed-Chat's step 3 and our other stages."""

    actor_model_name_or_path: str = field(metadata={"help": "Actor base model (or a merged SFT model)."})
    reward_model_name_or_path: str = field(
        metadata={"help": "Reward base model (with --reward_lora_model), or a merged reward model (rm_merged_model)."}
    )
    actor_lora_model: Optional[str] = field(
        default=None, metadata={"help": "The SFT adapter on the actor base: the policy PPO starts from and the reference."}
    )
    reward_lora_model: Optional[str] = field(
        default=None, metadata={"help": "The reward adapter (rm_lora_model of run_reward.py: LoRA + score head)."}
    )
    critic_model_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "A full reward/value model to start the critic from (default: the reward model)."},
    )
    shared_base: Optional[bool] = field(
        default=None,
        metadata={"help": "One frozen base with actor/critic/reward(/reference) adapters. Default: true when the "
                          "actor and reward share a base and the reward comes as an adapter."},
    )
    offload_reference_model: bool = field(
        default=False,
        metadata={"help": "Separate placement: keep the reference and reward models on the CPU between their passes."},
    )
    tokenizer_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer directory (default: the SFT adapter's, else the actor base's)."}
    )
    torch_dtype: str = field(default="auto", metadata={"help": "dtype of the loaded weights.", "choices": list(DTYPES)})
    attn_implementation: Optional[str] = field(default=None, metadata={"help": "eager, sdpa, flash_attention_2, ..."})
    trainable: str = field(default="q_proj,v_proj,k_proj,o_proj,gate_proj,down_proj,up_proj",
                           metadata={"help": "LoRA target modules of a new actor (or critic) adapter."})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r of a new adapter."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA alpha of a new adapter."})
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on the LoRA input. 0 (DeepSpeed-Chat's choice): experience is scored without "
                          "dropout, so any dropout in the update adds noise to PPO's probability ratio."},
    )


@dataclass
class PPODataArguments(ConversationDataArguments):
    data_phase: int = field(default=3, metadata={"help": "Which part of --data_split this stage takes (3 = PPO)."})
    max_prompt_seq_len: int = field(default=256, metadata={"help": "Prompt tokens; longer prompts lose their start."})
    max_answer_seq_len: int = field(default=256, metadata={"help": "Most tokens generated per answer."})
    unsupervised_dataset_dir: Optional[str] = field(
        default=None, metadata={"help": "Pretraining text (*.txt / *.jsonl 'text') for the ptx loss mixed into the actor's."}
    )
    unsup_coef: float = field(default=27.8, metadata={"help": "Weight of the ptx language-model loss (InstructGPT's gamma)."})


@dataclass
class PPOArguments(ToolkitTrainingArguments):
    """TrainingArguments plus DeepSpeed-Chat's step-3 options. --per_device_training_batch_size
    and --actor_learning_rate set the Trainer's own batch size and learning rate."""

    per_device_generation_batch_size: int = field(default=8, metadata={"help": "Prompts per generation batch per process."})
    per_device_training_batch_size: int = field(default=8, metadata={"help": "Sequences per PPO micro-batch per process."})
    generation_batches: int = field(default=1, metadata={"help": "Generation batches of experience per PPO iteration."})
    ppo_epochs: int = field(default=1, metadata={"help": "Passes over each iteration's experience."})
    actor_learning_rate: float = field(default=1e-4, metadata={"help": "Learning rate of the actor's adapter."})
    critic_learning_rate: float = field(default=5e-5, metadata={"help": "Learning rate of the critic's adapter and value head."})
    kl_ctl: float = field(default=0.1, metadata={"help": "KL penalty coefficient (initial value when adaptive)."})
    target_kl: Optional[float] = field(default=None, metadata={"help": "Adaptive KL control towards this KL per answer."})
    kl_horizon: int = field(default=10000, metadata={"help": "Adaptive KL controller horizon, in answers."})
    clip_reward_value: float = field(default=5.0, metadata={"help": "Reward scores are clamped to +-this."})
    cliprange: float = field(default=0.2, metadata={"help": "PPO policy ratio clip range."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range around the experience's values."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (log-probs use the same)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling; 1.0 = off."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling; 0 = off."})
    missing_eos_penalty: Optional[float] = field(
        default=None, metadata={"help": "Subtracted from the score of an answer that hit --max_answer_seq_len without EOS."}
    )
    enable_ema: bool = field(default=False, metadata={"help": "Keep an exponential moving average of the actor (actor_ema)."})
    ema_beta: float = field(default=0.992, metadata={"help": "EMA decay per optimizer step."})
    print_answers: bool = field(default=False, metadata={"help": "Log a sample prompt, answer and score."})
    print_answers_interval: int = field(default=1, metadata={"help": "... every this many iterations."})

    def __post_init__(self):
        # Before TrainingArguments fills DeepSpeed's "auto" batch size and learning rate from them.
        self.per_device_train_batch_size = self.per_device_training_batch_size
        self.learning_rate = self.actor_learning_rate
        # Nothing to skip on resume: the experience stream restarts at the checkpoint's iteration.
        self.ignore_data_skip = True
        super().__post_init__()


# ----------------------------------------------------------------------------- prompts


def prompt_messages(where: str, record) -> list:
    """The conversation of a record up to its last user turn: alpaca, sharegpt or messages
    records (their final answer, if any, is dropped; none is needed) or a reward pair's
    {"prompt", "system"?, "history"?}."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: a record must be a JSON object")
    if "conversations" in record or "messages" in record:
        name, role_key, content_key, roles = (("conversations", "from", "value", SHAREGPT_ROLES) if "conversations" in record
                                              else ("messages", "role", "content", MESSAGE_ROLES))
        turns = turn_list(where, record, name, role_key, content_key, roles)
        if turns[-1]["role"] == "assistant":
            turns = turns[:-1]
        # Validated as a conversation with a stand-in answer: alternation, system first, a user turn.
        return validate_conversation(where, turns + [{"role": "assistant", "content": "-"}], name)[:-1]
    if "instruction" in record or "prompt" in record:
        name = "instruction" if "instruction" in record else "prompt"
        alpaca = {"instruction": string_field(where, record, name), "input": record.get("input"),
                  "system": record.get("system"), "history": record.get("history"),
                  "output": string_field(where, record, "output", required=False)}
        return alpaca_messages(where, alpaca)[:-1]
    raise InputError(f"{where}: no 'instruction', 'prompt', 'conversations' or 'messages' field")


def read_prompts(files: list, data_split: Optional[str], data_phase: int, seed: int) -> list:
    """[(where, messages)] of every file (its --data_phase part with --data_split)."""
    prompts = []
    for path in files:
        records = list(read_records(path))
        if not records:
            raise InputError(f"{path}: file holds no records (empty)")
        indices = phase_indices(len(records), data_split, data_phase, seed) if data_split else range(len(records))
        for index in indices:
            line, record = records[index]
            where = f"{path}:{line}"
            prompts.append((where, prompt_messages(where, record)))
    if not prompts:
        raise InputError(f"no prompt in {', '.join(files)} for --data_phase {data_phase} of --data_split {data_split}")
    return prompts


def tokenize_prompts(prompts: list, tokenizer, template: str, max_prompt_len: int, desc: str) -> list:
    """Token ids of each prompt rendered with the generation prompt; a prompt longer than
    max_prompt_len keeps its end (the question nearest the answer), as DeepSpeed-Chat does."""
    renderer = ConversationTokenizer(tokenizer, template, max_prompt_len)
    rows, truncated = [], 0
    for _, messages in prompts:
        ids = tokenizer(renderer.render(messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_len:
            truncated += 1
            ids = ids[-max_prompt_len:]
        rows.append(ids)
    logger.info("%s: %d prompts, %d truncated from the left to --max_prompt_seq_len %d", desc, len(rows), truncated,
                max_prompt_len)
    return rows


def build_prompt_sets(data_args: PPODataArguments, tokenizer, template: str, seed: int) -> tuple:
    files = find_sft_files(data_args.dataset_dir, data_args.data_path)
    if not files:
        raise InputError("no prompts: give --dataset_dir or --data_path")
    prompts = read_prompts(files, data_args.data_split, data_args.data_phase, seed)
    eval_prompts = None
    if data_args.validation_file:
        eval_prompts = read_prompts(find_sft_files(None, [data_args.validation_file]), None, data_args.data_phase, seed)
    elif data_args.validation_split_percentage > 0:
        share = data_args.validation_split_percentage
        share = share / 100 if share >= 1 else share
        order = np.random.default_rng(seed).permutation(len(prompts))
        held_out = max(1, int(round(len(prompts) * share)))
        if held_out >= len(prompts):
            raise InputError(f"--validation_split_percentage {data_args.validation_split_percentage} of "
                             f"{len(prompts)} prompts leaves none to train on")
        eval_prompts = [prompts[i] for i in sorted(order[:held_out])]
        prompts = [prompts[i] for i in sorted(order[held_out:])]
    if data_args.max_train_samples is not None:
        prompts = prompts[: data_args.max_train_samples]
    if eval_prompts is not None and data_args.max_eval_samples is not None:
        eval_prompts = eval_prompts[: data_args.max_eval_samples]
    train = tokenize_prompts(prompts, tokenizer, template, data_args.max_prompt_seq_len, "train prompts")
    held = None if eval_prompts is None else tokenize_prompts(eval_prompts, tokenizer, template,
                                                               data_args.max_prompt_seq_len, "eval prompts")
    return train, held


def stream_indices(num_items: int, seed: int, start: int, count: int) -> list:
    """Positions start..start+count of an endless stream of seeded permutations of num_items:
    epoch e is permutation(seed, e). A pure function of the position, so a resumed run draws
    exactly the prompts the uninterrupted run would have."""
    picked, permutations = [], {}
    for position in range(start, start + count):
        epoch, offset = divmod(position, num_items)
        if epoch not in permutations:
            permutations[epoch] = np.random.default_rng([seed, epoch]).permutation(num_items)
        picked.append(int(permutations[epoch][offset]))
    return picked


def derived_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


# ----------------------------------------------------------------------------- model checks


def has_tokenizer(path: Optional[str]) -> bool:
    return bool(path) and any(os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer.model"))


def tokenizer_of(model_dir: str, adapter_dir: Optional[str]):
    """The tokenizer saved with an adapter (it carries the stage's chat template), else the model's."""
    return load_tokenizer(ModelArguments(model_name_or_path=adapter_dir if has_tokenizer(adapter_dir) else model_dir))


def check_same_tokenizer(actor_tokenizer, other, role: str, where: str) -> None:
    if tokenizer_fingerprint(actor_tokenizer) != tokenizer_fingerprint(other):
        detail = (f"{len(other)} tokens vs the actor's {len(actor_tokenizer)}" if len(other) != len(actor_tokenizer)
                  else "same size, different tokens or ids")
        raise InputError(f"{where}: the {role} model's tokenizer differs from the actor's ({detail}); "
                         "PPO scores the actor's token ids, so every role needs the actor's tokenizer")


def checkpoint_keys(model_dir: str) -> list:
    """Weight names of a model directory (single file or sharded), read from headers only."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            return list(json.load(handle).get("weight_map", {}))
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as handle:
            return list(handle.keys())
    return []


def check_reward_source(model_dir: str, adapter_dir: Optional[str], flag: str) -> None:
    """A reward/critic source must carry a trained score head: a base model alone would get a
    random one, and PPO would optimise noise."""
    if adapter_dir:
        adapter_config = read_adapter_config(adapter_dir)
        weights = os.path.join(adapter_dir, "adapter_model.safetensors")
        keys = []
        if os.path.isfile(weights):
            with safe_open(weights, framework="pt") as handle:
                keys = list(handle.keys())
        if adapter_config.get("task_type") != "SEQ_CLS" or not any(k.endswith(SCORE_KEY_SUFFIX) for k in keys):
            raise InputError(f"{adapter_dir}: not a reward adapter (no score head in adapter_model.safetensors); "
                             "give rm_lora_model of run_reward.py")
        return
    if not any(k.endswith(SCORE_KEY_SUFFIX) for k in checkpoint_keys(model_dir)):
        raise InputError(f"{model_dir}: {flag} is not a reward model (no score head in its weights); give the reward "
                         "adapter with --reward_lora_model, or run_reward.py's rm_merged_model")


def same_directory(first: Optional[str], second: Optional[str]) -> bool:
    return bool(first) and bool(second) and os.path.realpath(first) == os.path.realpath(second)


def check_models(model_args: PPOModelArguments, data_args: PPODataArguments):
    """Refuse, before any weight is loaded, role combinations that would train silently wrong.
    Returns (actor tokenizer, actor config, shared_base)."""
    actor_config = load_model_config(ModelArguments(model_name_or_path=model_args.actor_model_name_or_path))
    if model_args.actor_lora_model:
        read_adapter_config(model_args.actor_lora_model)
    reward_config = load_model_config(ModelArguments(model_name_or_path=model_args.reward_model_name_or_path))
    if model_args.tokenizer_name_or_path:
        tokenizer = load_tokenizer(ModelArguments(model_name_or_path=model_args.actor_model_name_or_path,
                                                  tokenizer_name_or_path=model_args.tokenizer_name_or_path))
    else:
        tokenizer = tokenizer_of(model_args.actor_model_name_or_path, model_args.actor_lora_model)
    reward_dir = model_args.reward_lora_model if has_tokenizer(model_args.reward_lora_model) else model_args.reward_model_name_or_path
    check_same_tokenizer(tokenizer, tokenizer_of(model_args.reward_model_name_or_path, model_args.reward_lora_model),
                         "reward", reward_dir)
    check_reward_source(model_args.reward_model_name_or_path, model_args.reward_lora_model, "--reward_model_name_or_path")
    configs = [("actor", actor_config), ("reward", reward_config)]
    if model_args.critic_model_name_or_path:
        configs.append(("critic", load_model_config(ModelArguments(model_name_or_path=model_args.critic_model_name_or_path))))
        check_same_tokenizer(tokenizer, tokenizer_of(model_args.critic_model_name_or_path, None), "critic",
                             model_args.critic_model_name_or_path)
        check_reward_source(model_args.critic_model_name_or_path, None, "--critic_model_name_or_path")
    total = data_args.max_prompt_seq_len + data_args.max_answer_seq_len
    for flag, value in (("--max_prompt_seq_len", data_args.max_prompt_seq_len),
                        ("--max_answer_seq_len", data_args.max_answer_seq_len)):
        if value < 1:
            raise InputError(f"{flag} must be at least 1, got {value}")
    for role, config in configs:
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and total > positions:
            raise InputError(f"--max_prompt_seq_len {data_args.max_prompt_seq_len} + --max_answer_seq_len "
                             f"{data_args.max_answer_seq_len} = {total} exceeds the {role} model's "
                             f"max_position_embeddings {positions} (config.json)")

    shareable = (same_directory(model_args.actor_model_name_or_path, model_args.reward_model_name_or_path)
                 and model_args.reward_lora_model is not None
                 and (model_args.critic_model_name_or_path is None
                      or same_directory(model_args.critic_model_name_or_path, model_args.reward_model_name_or_path)))
    shared = shareable if model_args.shared_base is None else model_args.shared_base
    if shared and not shareable:
        raise InputError("--shared_base true needs the reward model as an adapter (--reward_lora_model) on the actor's "
                         "base (--reward_model_name_or_path = --actor_model_name_or_path) and no other critic model")
    return tokenizer, actor_config, shared


def check_schedule(training_args: PPOArguments, num_prompts: int) -> int:
    """Optimizer steps per PPO iteration; refuses batch sizes that do not tile the experience and
    checkpoints that would fall inside an iteration (its experience could not be restored)."""
    experience = training_args.generation_batches * training_args.per_device_generation_batch_size
    micro = training_args.per_device_training_batch_size
    for flag in ("generation_batches", "per_device_generation_batch_size", "per_device_training_batch_size", "ppo_epochs"):
        if getattr(training_args, flag) < 1:
            raise InputError(f"--{flag} must be at least 1")
    if experience % micro:
        raise InputError(f"--generation_batches {training_args.generation_batches} x --per_device_generation_batch_size "
                         f"{training_args.per_device_generation_batch_size} = {experience} sequences per iteration is not "
                         f"a multiple of --per_device_training_batch_size {micro}")
    micro_batches = training_args.ppo_epochs * experience // micro
    accumulation = training_args.gradient_accumulation_steps
    if micro_batches % accumulation:
        raise InputError(f"{micro_batches} micro-batches per PPO iteration is not a multiple of "
                         f"--gradient_accumulation_steps {accumulation}")
    steps_per_iteration = micro_batches // accumulation
    if training_args.max_steps <= 0:
        # DeepSpeed-Chat's epochs: passes over the prompts.
        prompts_per_iteration = experience * training_args.world_size
        iterations = math.ceil(training_args.num_train_epochs * num_prompts / prompts_per_iteration)
        training_args.max_steps = max(1, iterations) * steps_per_iteration
    if training_args.save_strategy == "steps" and training_args.save_steps >= 1:
        if int(training_args.save_steps) % steps_per_iteration:
            raise InputError(f"--save_steps {int(training_args.save_steps)} must be a multiple of the {steps_per_iteration} "
                             "optimizer steps of one PPO iteration: a checkpoint inside an iteration could not restore "
                             "its experience")
    return steps_per_iteration


# ----------------------------------------------------------------------------- models


def positions_from_mask(attention_mask):
    """Position ids counted over attended tokens: left padding does not shift them (as generate does)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def backbone_of(causal_or_classifier):
    """The decoder stack (LlamaModel for Llama) under a task head."""
    return getattr(causal_or_classifier, causal_or_classifier.base_model_prefix)


class PPOPolicy(torch.nn.Module):
    """Everything the Trainer (and DeepSpeed) wraps: the trained actor and critic, and the frozen
    reference and reward roles the experience passes need. A role's hidden states come from
    hidden(); the heads turn them into log-probs, values and scores. forward() is the training
    pass: actor log-probs of the answer tokens and critic values, plus the ptx loss."""

    temperature: float = 1.0
    # Passes over a rollout run on groups of rows of similar length (see over_length_groups). The
    # trainer turns it off under multi-process ZeRO-3, where every forward is a collective and all
    # ranks must run the same number of them.
    group_by_length: bool = True

    def hidden(self, role: str, input_ids, attention_mask, position_ids):
        raise NotImplementedError

    def head(self, role: str):
        raise NotImplementedError

    def generator(self):
        """The actor as a causal LM, with generate()."""
        raise NotImplementedError

    @property
    def config(self):
        """The actor's config: the Trainer and DeepSpeed size their buffers from it."""
        return self.actor_config()

    def answer_logits(self, role, input_ids, attention_mask, prompt_length):
        """Logits predicting each answer token (from the position before it), temperature applied:
        the distribution the answer was sampled from. The head runs on answer positions only;
        half-precision logits stay so (ppo_utils reduces them row by row in float32)."""
        hidden = self.hidden(role, input_ids, attention_mask, positions_from_mask(attention_mask))
        logits = self.head(role)(hidden[:, prompt_length - 1 : -1])
        return logits if self.temperature == 1.0 else logits.float() / self.temperature

    def answer_logprobs(self, role, input_ids, attention_mask, prompt_length):
        """log p of each answer token under the role (actor or reference)."""
        logits = self.answer_logits(role, input_ids, attention_mask, prompt_length)
        return logprobs_from_logits(logits, input_ids[:, prompt_length:])

    def answer_values(self, input_ids, attention_mask, prompt_length):
        hidden = self.hidden("critic", input_ids, attention_mask, positions_from_mask(attention_mask))
        return self.head("critic")(hidden[:, prompt_length - 1 : -1]).squeeze(-1).float()

    def scores(self, input_ids, attention_mask):
        """The reward model's score of each row, read at its last attended token."""
        hidden = self.hidden("reward", input_ids, attention_mask, positions_from_mask(attention_mask))
        positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
        last = (attention_mask * positions).argmax(dim=-1)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        return self.head("reward")(pooled).squeeze(-1).float()

    def ptx_loss(self, input_ids):
        """The actor's next-token loss on a pretraining block (DeepSpeed-Chat's unsupervised term)."""
        ones = torch.ones_like(input_ids)
        hidden = self.hidden("actor", input_ids, ones, positions_from_mask(ones))
        logits = self.head("actor")(hidden[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))

    def over_length_groups(self, input_ids, attention_mask, prompt_length: int, passes) -> dict:
        """passes(ids, mask, prompt_length) -> {name: [rows, answer] or [rows] tensor}, run on
        groups of rows of similar length, each cut to its own longest prompt and answer, the results
        put back in row order (per-token ones zero-padded to the batch's answer width). In a PPO
        batch, left-padded prompts of mixed lengths and answers that stop at different lengths
        make a sixth or more of the positions padding; cut away, they cost nothing. The real
        tokens see exactly what they saw in the full batch (same positions, same mask)."""
        answer_width = input_ids.shape[1] - prompt_length
        if not self.group_by_length:
            return passes(input_ids, attention_mask, prompt_length)
        prompt_lengths = attention_mask[:, :prompt_length].sum(-1).tolist()
        answer_lengths = attention_mask[:, prompt_length:].sum(-1).clamp(min=1).tolist()
        min_rows = max(4, math.ceil(len(prompt_lengths) / 4))
        parts, order = {}, []
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

    def forward(self, input_ids, attention_mask, prompt_length, ptx_input_ids=None):
        """The training pass: the actor's log-probs of the answer tokens and the critic's values."""
        outputs = self.over_length_groups(input_ids, attention_mask, prompt_length, lambda ids, mask, width: {
            "logprobs": self.answer_logprobs("actor", ids, mask, width),
            "values": self.answer_values(ids, mask, width)})
        if ptx_input_ids is not None:
            outputs["ptx_loss"] = self.ptx_loss(ptx_input_ids)
        return outputs

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, **kwargs):
        """--gradient_checkpointing: on every trained model's layers (the Trainer calls this)."""
        options = self.checkpointing_options(dict(activation_checkpointing_kwargs or {}))
        for model in self.trained_models():
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=options or None, **kwargs)

    def checkpointing_options(self, options: dict) -> dict:
        return options

    # What is saved: subclasses name the actor's and critic's parameters and peft models.
    def actor_named_parameters(self) -> list:
        raise NotImplementedError

    def is_critic_parameter(self, name: str) -> bool:
        raise NotImplementedError

    def save_pretrained(self, path: str, **kwargs) -> None:
        """The actor adapter alone (SavePeftModelCallback writes ppo_lora_model through this)."""
        raise NotImplementedError

    def save_critic(self, path: str) -> None:
        raise NotImplementedError


class SharedBasePolicy(PPOPolicy):
    """One frozen base, adapters switched per role: "default" (the actor, trained), "critic"
    (trained, started from the reward adapter) with a value head, "reward" (frozen) with the
    reward score head, and the reference: the "reference" adapter (a frozen copy of the SFT
    adapter) or, without one, the base with no adapter active.

    Roles are switched by setting each peft layer's active adapter directly: peft's own
    set_adapter / disable_adapter also flip requires_grad, which would freeze the actor while
    the critic runs in the same training step (and confuse DeepSpeed, which registers its
    gradient hooks once)."""

    ADAPTERS = {"actor": "default", "critic": "critic", "reward": "reward"}

    def __init__(self, peft_model, score_head, value_head, reference_adapter: Optional[str], reward_adapter_dir: str):
        super().__init__()
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        self.policy = peft_model
        self.score_head = score_head
        self.value_head = value_head
        self.reference_adapter = reference_adapter
        self.reward_adapter_dir = reward_adapter_dir
        self._tuner_layers = [m for m in peft_model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]

    @property
    def causal_lm(self):
        # A property, not an attribute: a second registration would put the base in state_dict twice.
        return self.policy.get_base_model()

    def use(self, role: str) -> None:
        name = self.reference_adapter if role == "reference" else self.ADAPTERS[role]
        active = [name] if name else []
        for layer in self._tuner_layers:
            layer._active_adapter = active
        self.active_role = role

    @contextmanager
    def role_active(self, role: str):
        previous = getattr(self, "active_role", "actor")
        self.use(role)
        try:
            yield
        finally:
            self.use(previous)

    def checkpointing_options(self, options: dict) -> dict:
        """A checkpointed layer is recomputed during backward, after later roles switched the
        adapters: recompute it under the role that ran it (torch's context_fn, which needs the
        non-reentrant checkpoint)."""

        def contexts():
            return nullcontext(), self.role_active(self.active_role)

        return {**options, "use_reentrant": False, "context_fn": contexts}

    def hidden(self, role, input_ids, attention_mask, position_ids):
        self.use(role)
        return backbone_of(self.causal_lm)(input_ids=input_ids, attention_mask=attention_mask,
                                           position_ids=position_ids, use_cache=False).last_hidden_state

    def head(self, role):
        if role in ("actor", "reference"):
            return self.causal_lm.get_output_embeddings()
        return self.value_head if role == "critic" else self.score_head

    def generator(self):
        self.use("actor")
        return self.causal_lm

    def actor_config(self):
        return self.causal_lm.config

    def trained_models(self):
        return [self.causal_lm]

    def actor_named_parameters(self):
        return [(name[len("policy."):], p) for name, p in self.named_parameters()
                if p.requires_grad and name.startswith("policy.") and ".default." in name]

    def is_critic_parameter(self, name):
        return name.startswith("value_head.") or ".critic." in name

    def save_pretrained(self, path, **kwargs):
        self.policy.save_pretrained(path, selected_adapters=["default"])

    def save_critic(self, path):
        """rm_lora_model's layout (LoRA + score head on the same base), so the critic loads like a
        reward adapter: PeftModel.from_pretrained(reward_model_class(config)(base), path)."""
        from peft import LoraConfig, get_peft_model_state_dict

        weights = get_peft_model_state_dict(self.policy, adapter_name="critic")
        weights["base_model.model.score.weight"] = self.value_head.weight
        os.makedirs(path, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                  os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        LoraConfig.from_pretrained(self.reward_adapter_dir).save_pretrained(path)


class SeparatePolicy(PPOPolicy):
    """Each role its own model, as in DeepSpeed-Chat: the actor (peft causal LM) and critic
    (peft sequence classifier whose score head is the value head) are trained; the reference and
    reward models are frozen and kept outside the module, so DeepSpeed neither partitions nor
    checkpoints them."""

    def __init__(self, actor, critic, reference, reward, offload: bool):
        super().__init__()
        self.actor = actor
        self.critic = critic
        # Plain attributes, not submodules: the Trainer's optimizer, DeepSpeed and checkpoints skip them.
        self.__dict__["frozen"] = {"reference": reference, "reward": reward}
        self.offload = offload

    def role_model(self, role):
        if role == "actor":
            return self.actor.get_base_model()
        if role == "critic":
            return self.critic.get_base_model()
        return self.frozen[role]

    @contextmanager
    def placed(self, role, device):
        """With --offload_reference_model a frozen model visits the device for its pass only."""
        model = self.frozen.get(role)
        if model is None or not self.offload:
            yield
            return
        model.to(device)
        try:
            yield
        finally:
            model.to("cpu")

    def hidden(self, role, input_ids, attention_mask, position_ids):
        with self.placed(role, input_ids.device):
            return backbone_of(self.role_model(role))(input_ids=input_ids, attention_mask=attention_mask,
                                                      position_ids=position_ids, use_cache=False).last_hidden_state

    def head(self, role):
        model = self.role_model(role)
        if role in ("actor", "reference"):
            return model.get_output_embeddings()
        return model.score

    def scores(self, input_ids, attention_mask):
        with self.placed("reward", input_ids.device):
            return super().scores(input_ids, attention_mask)

    def answer_logits(self, role, input_ids, attention_mask, prompt_length):
        with self.placed(role, input_ids.device):
            return super().answer_logits(role, input_ids, attention_mask, prompt_length)

    def generator(self):
        return self.actor.get_base_model()

    def actor_config(self):
        return self.actor.get_base_model().config

    def trained_models(self):
        return [self.actor.get_base_model(), self.critic.get_base_model()]

    def actor_named_parameters(self):
        return [(name[len("actor."):], p) for name, p in self.named_parameters()
                if p.requires_grad and name.startswith("actor.")]

    def is_critic_parameter(self, name):
        return name.startswith("critic.")

    def save_pretrained(self, path, **kwargs):
        self.actor.save_pretrained(path)

    def save_critic(self, path):
        self.critic.save_pretrained(path)


def actor_model_args(model_args: PPOModelArguments) -> ModelArguments:
    return ModelArguments(
        model_name_or_path=model_args.actor_model_name_or_path, tokenizer_name_or_path=model_args.tokenizer_name_or_path,
        torch_dtype=model_args.torch_dtype, attn_implementation=model_args.attn_implementation,
        trainable=model_args.trainable, lora_rank=model_args.lora_rank, lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout, peft_path=model_args.actor_lora_model,
    )


def reward_adapter_parts(adapter_dir: str) -> tuple:
    """(LoRA weights, score head weights) of a reward adapter saved by run_reward.py."""
    weights = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    score = {k: v for k, v in weights.items() if ".score." in f".{k}"}
    lora = {k: v for k, v in weights.items() if k not in score}
    return lora, score


def new_score_head(hidden_size: int, score_weights: dict, dtype, trainable: bool):
    weight = next(v for k, v in score_weights.items() if k.endswith(SCORE_KEY_SUFFIX))
    bias = next((v for k, v in score_weights.items() if k.endswith("score.bias")), None)
    head = torch.nn.Linear(hidden_size, weight.shape[0], bias=bias is not None, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias)
    head.requires_grad_(trainable)
    return head


def load_shared_policy(model_args: PPOModelArguments, training_args, tokenizer) -> SharedBasePolicy:
    """The actor via the shared loader (SFT adapter continued, or a new LoRA), then the other
    roles as adapters on the same base."""
    from peft import LoraConfig, TaskType, set_peft_model_state_dict

    policy = load_model(actor_model_args(model_args), training_args, tokenizer)
    reference = None
    if model_args.actor_lora_model:
        policy.load_adapter(model_args.actor_lora_model, adapter_name="reference", is_trainable=False)
        reference = "reference"
    lora_weights, score_weights = reward_adapter_parts(model_args.reward_lora_model)
    reward_config = LoraConfig.from_pretrained(model_args.reward_lora_model)
    # The score head is ours (below); the adapter keeps only its LoRA layers on the causal LM.
    reward_config.task_type, reward_config.modules_to_save = TaskType.CAUSAL_LM, None
    for name in ("reward", "critic"):
        policy.add_adapter(name, reward_config)
        result = set_peft_model_state_dict(policy, lora_weights, adapter_name=name)
        if getattr(result, "unexpected_keys", None):
            raise InputError(f"{model_args.reward_lora_model}: adapter does not fit the actor's base "
                             f"(unexpected {result.unexpected_keys[:3]})")
    # peft's add/load_adapter re-freeze whatever is not the active adapter: set the roles' flags once, here.
    for name, param in policy.named_parameters():
        param.requires_grad = ".default." in name or ".critic." in name
    config = policy.get_base_model().config
    dtype = policy.get_base_model().get_output_embeddings().weight.dtype
    policy.get_base_model().config.use_cache = False
    model = SharedBasePolicy(
        policy,
        score_head=new_score_head(config.hidden_size, score_weights, dtype, trainable=False),
        value_head=new_score_head(config.hidden_size, score_weights, dtype, trainable=True),
        reference_adapter=reference,
        reward_adapter_dir=model_args.reward_lora_model,
    )
    log_trainable(model)
    return model


@contextmanager
def outside_zero3_init():
    """Build a model whole on every rank, outside DeepSpeed's zero.Init: the frozen reference and
    reward models never enter the engine, so nothing would gather partitioned weights for them;
    a critic is merged first and partitioned by the engine afterwards."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def load_frozen(model_dir: str, adapter_dir: Optional[str], task: str, model_args: PPOModelArguments):
    """A frozen role: the model, with its adapter merged in (one plain forward per pass)."""
    from peft import PeftModel

    config = load_model_config(ModelArguments(model_name_or_path=model_dir))
    kwargs = {"config": config, "dtype": DTYPES[model_args.torch_dtype]}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    with outside_zero3_init():
        if task == "reward":
            config.num_labels = 1
            model = reward_model_class(config).from_pretrained(model_dir, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        if adapter_dir:
            model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    model.requires_grad_(False)
    return model.eval()


def load_separate_policy(model_args: PPOModelArguments, training_args, tokenizer) -> SeparatePolicy:
    actor = load_model(actor_model_args(model_args), training_args, tokenizer)
    actor.get_base_model().config.use_cache = False
    reference = load_frozen(model_args.actor_model_name_or_path, model_args.actor_lora_model, "causal_lm", model_args)
    reward = load_frozen(model_args.reward_model_name_or_path, model_args.reward_lora_model, "reward", model_args)
    # The critic starts as the reward model: the reward adapter and score head trained on (the
    # same parameterisation as --shared_base), or a full critic model with a new LoRA.
    critic_source = ModelArguments(
        model_name_or_path=model_args.critic_model_name_or_path or model_args.reward_model_name_or_path,
        torch_dtype=model_args.torch_dtype, attn_implementation=model_args.attn_implementation,
        trainable=model_args.trainable, lora_rank=model_args.lora_rank, lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        peft_path=None if model_args.critic_model_name_or_path else model_args.reward_lora_model,
    )
    with outside_zero3_init():
        critic = load_model(critic_source, training_args, tokenizer, task="reward")
    device = training_args.device
    for model in (reference, reward):
        model.to("cpu" if model_args.offload_reference_model else device)
    model = SeparatePolicy(actor, critic, reference, reward, offload=model_args.offload_reference_model)
    log_trainable(model)
    return model


# ----------------------------------------------------------------------------- experience


def left_pad(rows: list, width: int, pad_id: int) -> tuple:
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def answer_mask(answers, eos_token_id: int):
    """1 on answer tokens up to and including the first EOS (all of a row without one); the
    ids after it are generate's padding. Never compares ids with the pad id (it may be EOS)."""
    is_eos = answers == eos_token_id
    seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~seen_before).long(), is_eos.any(-1)


class SumStats:
    """Sums and counts of named statistics, reduced across processes on request."""

    def __init__(self):
        self.sums = {}

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        current = self.sums.setdefault(name, [0.0, 0.0])
        current[0] += float(total)
        current[1] += float(count)

    def reduced(self, device) -> dict:
        names = sorted(self.sums)
        values = torch.tensor([self.sums[n] for n in names], dtype=torch.float64).reshape(-1, 2)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            values = values.to(torch.float32).to(device)
            dist.all_reduce(values)
            values = values.double().cpu()
        return {name: (values[i, 0] / values[i, 1].clamp(min=1e-12)).item() for i, name in enumerate(names)}


class ExperienceStream:
    """The Trainer's train "dataloader": endless, one PPO iteration of micro-batches at a time,
    generated only when the Trainer asks for the iteration's first micro-batch. No __len__:
    the Trainer then runs by --max_steps and has no batches to skip on resume."""

    def __init__(self, trainer):
        self.trainer = trainer

    def __iter__(self):
        while True:
            iteration = self.trainer.iteration
            batches = self.trainer.make_experience(iteration)
            self.trainer.iteration = iteration + 1
            yield from batches


class PPOStepCallback(TrainerCallback):
    """Times the optimizer steps (generation happens before on_step_begin, while the Trainer
    fetches the step's micro-batches) and updates the EMA after each."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.started = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.times["time_training"] += time.perf_counter() - self.started
        self.trainer.update_ema()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.save_roles(args.output_dir)


@contextmanager
def gathered(params):
    """Full copies of ZeRO-3 partitioned parameters on every rank (read-only); no-op otherwise."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
    else:
        yield


class PPOTrainer(ResumableTrainer):
    """PPO on the Trainer: experience in, clipped policy + value (+ ptx) loss out; DeepSpeed,
    gradient accumulation/clipping, logging and checkpoints stay the Trainer's."""

    def __init__(self, *args, prompts, eval_prompts, ptx_blocks, data_args, tokenizer, steps_per_iteration, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts, self.eval_prompts, self.ptx_blocks = prompts, eval_prompts, ptx_blocks
        self.max_prompt_len, self.max_answer_len = data_args.max_prompt_seq_len, data_args.max_answer_seq_len
        self.unsup_coef = data_args.unsup_coef
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.steps_per_iteration = steps_per_iteration
        self.kl_ctl = make_kl_controller(self.args.kl_ctl, self.args.target_kl, self.args.kl_horizon)
        self.iteration = 0
        self.ema = None
        self.train_stats, self.times = SumStats(), {"time_generation": 0.0, "time_scoring": 0.0, "time_training": 0.0}
        self.experience_stats = {}
        self.model.temperature = self.args.temperature
        self.model.group_by_length = not (is_deepspeed_zero3_enabled() and self.args.world_size > 1)
        self.add_callback(PPOStepCallback(self))

    # -- data -----------------------------------------------------------------

    def get_train_dataloader(self):
        return ExperienceStream(self)

    def generation_config(self):
        args = self.args
        # Every sampling setting explicit: generate() fills unset ones from the checkpoint's
        # generation_config (a repetition penalty, top_k=50), which PPO's log-probs would not see.
        return GenerationConfig(
            do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, num_beams=1,
            repetition_penalty=1.0, max_new_tokens=self.max_answer_len, min_new_tokens=1,
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.pad_id, use_cache=True,
        )

    def generate(self, prompt_rows: list, seed: int) -> dict:
        """Answers sampled by the current actor (KV cache on, in batches of
        per_device_generation_batch_size, left-padded prompts): the sequences, their attention
        mask, the answer mask, has_eos, the prompt width, and the actor's log-probs and entropy of
        each answer token, taken from the logits that sampled it (what PPO calls the old policy;
        it spares one forward pass, as TRL does)."""
        model, device, temperature = self.model, self.args.device, self.args.temperature
        width = max(len(row) for row in prompt_rows)
        prompt_ids, prompt_mask = left_pad(prompt_rows, width, self.pad_id)
        batch = self.args.per_device_generation_batch_size
        synced = is_deepspeed_zero3_enabled() and self.args.world_size > 1
        answers, logprobs, entropy = [], [], []
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for start in range(0, len(prompt_rows), batch):
                ids = prompt_ids[start : start + batch].to(device)
                mask = prompt_mask[start : start + batch].to(device)
                # Under ZeRO-3 every rank keeps stepping until all are done: each step gathers weights.
                output = model.generator().generate(
                    input_ids=ids, attention_mask=mask, generation_config=self.generation_config(), synced_gpus=synced,
                    return_dict_in_generate=True, output_logits=True)
                tokens = output.sequences[:, width:]
                # Raw logits, before top-k/top-p: the distribution the log-probs are taken under.
                logits = torch.stack(output.logits, dim=1).float()
                if temperature != 1.0:
                    logits = logits / temperature
                answers.append(tokens.cpu())
                logprobs.append(logprobs_from_logits(logits, tokens).cpu())
                entropy.append(entropy_from_logits(logits).cpu())
                del output, logits
        longest = max(a.shape[1] for a in answers)

        def padded(parts, value):
            return torch.cat([F.pad(part, (0, longest - part.shape[1]), value=value) for part in parts])

        answers = padded(answers, self.pad_id)
        mask, has_eos = answer_mask(answers, self.tokenizer.eos_token_id)
        return {"input_ids": torch.cat([prompt_ids, answers], dim=1).to(device),
                "attention_mask": torch.cat([prompt_mask, mask], dim=1).to(device),
                "mask": mask.to(device), "has_eos": has_eos.to(device), "width": width,
                "logprobs": padded(logprobs, 0.0).to(device) * mask.to(device),
                "entropy": padded(entropy, 0.0).to(device) * mask.to(device)}

    @torch.no_grad()
    def score_experience(self, rollout: dict) -> dict:
        """The no-grad passes, one generation batch at a time: reference log-probs of the answer
        tokens, critic values, reward scores."""
        model, width = self.model, rollout["width"]

        def passes(ids, mask, prompt_length):
            return {"ref_logprobs": model.answer_logprobs("reference", ids, mask, prompt_length),
                    "values": model.answer_values(ids, mask, prompt_length), "scores": model.scores(ids, mask)}

        parts = {"ref_logprobs": [], "values": [], "scores": []}
        batch = self.args.per_device_generation_batch_size
        for start in range(0, rollout["input_ids"].shape[0], batch):
            ids, mask = rollout["input_ids"][start : start + batch], rollout["attention_mask"][start : start + batch]
            for name, value in model.over_length_groups(ids, mask, width, passes).items():
                parts[name].append(value)
        return {name: torch.cat(values) for name, values in parts.items()}

    def make_experience(self, iteration: int) -> list:
        args = self.args
        rank, world = args.process_index, args.world_size
        size = args.generation_batches * args.per_device_generation_batch_size
        indices = stream_indices(len(self.prompts), args.seed, (iteration * world + rank) * size, size)
        self.model.eval()
        started = time.perf_counter()
        with torch.no_grad():
            rollout = self.generate([self.prompts[i] for i in indices], derived_seed(args.seed, iteration, rank, 1))
        generated = time.perf_counter()
        scored = self.score_experience(rollout)
        mask, has_eos, width = rollout["mask"].float(), rollout["has_eos"], rollout["width"]
        scores = scored["scores"]
        if args.missing_eos_penalty is not None:
            scores = scores - args.missing_eos_penalty * (~has_eos).float()
        kl_coef = self.kl_ctl.value
        rewards, kl = kl_penalty_rewards(rollout["logprobs"], scored["ref_logprobs"], scores, mask, kl_coef,
                                         args.clip_reward_value)
        advantages, returns = gae_advantages_and_returns(scored["values"], rewards, mask, args.gamma, args.lam)
        if mask.sum() >= 2:
            advantages = masked_whiten(advantages, mask)

        stats = SumStats()
        sequence_rewards, sequence_kl = rewards.sum(-1), kl.sum(-1)
        for name, values in (("reward_mean", sequence_rewards), ("reward_sq", sequence_rewards ** 2),
                             ("score_mean", scores), ("kl", sequence_kl), ("response_length", mask.sum(-1)),
                             ("eos_fraction", has_eos.float()), ("value_mean", masked_mean(scored["values"], mask, dim=-1))):
            stats.add(name, values.sum().item(), values.numel())
        stats.add("entropy", (rollout["entropy"] * mask).sum().item(), mask.sum().item())
        reduced = stats.reduced(args.device)
        reduced["reward_std"] = math.sqrt(max(reduced.pop("reward_sq") - reduced["reward_mean"] ** 2, 0.0))
        reduced["kl_coef"] = kl_coef
        self.experience_stats = reduced
        self.kl_ctl.update(reduced["kl"], size * world)
        self.times["time_generation"] += generated - started
        self.times["time_scoring"] += time.perf_counter() - generated
        if args.print_answers and iteration % args.print_answers_interval == 0:
            self.print_answer(iteration, rollout["input_ids"][0], width, scores[0].item())

        experience = {"input_ids": rollout["input_ids"], "attention_mask": rollout["attention_mask"],
                      "response_mask": mask, "old_logprobs": rollout["logprobs"], "old_values": scored["values"],
                      "advantages": advantages, "returns": returns}
        return self.micro_batches(iteration, experience, width)

    def micro_batches(self, iteration: int, experience: dict, width: int) -> list:
        args = self.args
        batches, size = [], experience["input_ids"].shape[0]
        for epoch in range(args.ppo_epochs):
            order = torch.randperm(size, generator=torch.Generator().manual_seed(
                derived_seed(args.seed, iteration, args.process_index, 2, epoch)))
            for chunk in order.split(args.per_device_training_batch_size):
                batch = {name: value[chunk.to(value.device)] for name, value in experience.items()}
                batch["prompt_length"] = width
                batches.append(batch)
        if self.ptx_blocks is not None:
            rows = args.per_device_training_batch_size
            start = (iteration * args.world_size + args.process_index) * len(batches) * rows
            picked = stream_indices(len(self.ptx_blocks), args.seed + 1, start, len(batches) * rows)
            for number, batch in enumerate(batches):
                block_ids = picked[number * rows : (number + 1) * rows]
                batch["ptx_input_ids"] = torch.tensor([self.ptx_blocks[i]["input_ids"] for i in block_ids])
        return batches

    def print_answer(self, iteration, row, width, score):
        if self.args.should_log:
            prompt = self.tokenizer.decode(row[:width], skip_special_tokens=True)
            answer = self.tokenizer.decode(row[width:], skip_special_tokens=True)
            logger.info("iteration %d sample\n  prompt: %s\n  answer: %s\n  score: %.4f", iteration, prompt.strip(),
                        answer.strip(), score)

    # -- loss -----------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        prompt_length=inputs["prompt_length"], ptx_input_ids=inputs.get("ptx_input_ids"))
        mask = inputs["response_mask"]
        logprobs = outputs["logprobs"]
        actor_loss, clipfrac, approx_kl = policy_loss(logprobs, inputs["old_logprobs"], inputs["advantages"], mask,
                                                      self.args.cliprange)
        critic_loss, value_clipfrac = value_loss(outputs["values"], inputs["old_values"], inputs["returns"], mask,
                                                 self.args.cliprange_value)
        # Actor and critic parameters are disjoint: one backward of the sum trains each on its own loss.
        loss = actor_loss + critic_loss
        stats = {"policy_loss": actor_loss, "value_loss": critic_loss, "policy_clipfrac": clipfrac,
                 "value_clipfrac": value_clipfrac, "approx_kl": approx_kl}
        if "ptx_loss" in outputs:
            loss = loss + self.unsup_coef * outputs["ptx_loss"]
            stats["ptx_loss"] = outputs["ptx_loss"]
        for name, value in stats.items():
            self.train_stats.add(name, value.item())
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model=None):
        """The Trainer's optimizer with actor and critic in their own parameter groups: two learning
        rates (the scheduler scales both alike)."""
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            groups = []
            for is_critic, lr in ((False, self.args.actor_learning_rate), (True, self.args.critic_learning_rate)):
                for decays in (True, False):
                    params = [p for n, p in opt_model.named_parameters() if p.requires_grad
                              and opt_model.is_critic_parameter(n) == is_critic and (n in decay) == decays]
                    if params:
                        groups.append({"params": params, "lr": lr, "weight_decay": self.args.weight_decay if decays else 0.0})
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    # -- logging --------------------------------------------------------------

    def log(self, logs, *args, **kwargs):
        if "loss" in logs and self.train_stats.sums:
            logs.update(self.train_stats.reduced(self.args.device))
            logs.update(self.experience_stats)
            logs.update({name: round(value, 4) for name, value in self.times.items()})
            logs["iteration"] = self.iteration
            self.train_stats = SumStats()
            self.times = dict.fromkeys(self.times, 0.0)
        super().log(logs, *args, **kwargs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        """Answers to the held-out prompts, sampled with a fixed seed (so two evaluations differ by
        the policy only): mean reward score, KL to the reference, and their combination."""
        args = self.args
        prompts = self.eval_prompts
        rank, world = args.process_index, args.world_size
        batch = args.per_device_generation_batch_size
        # Equal batch counts on every rank: under ZeRO-3 each forward is a collective.
        per_rank = math.ceil(len(prompts) / world / batch) * batch
        mine = [i for i in range(rank, len(prompts), world)]
        weights = torch.tensor([1.0] * len(mine) + [0.0] * (per_rank - len(mine)), device=args.device)
        rows = [prompts[i] for i in mine] + [prompts[0]] * (per_rank - len(mine))
        self.model.eval()
        with torch.no_grad():
            rollout = self.generate(rows, derived_seed(args.seed, 3))
        scored = self.score_experience(rollout)
        mask = rollout["mask"]
        kl = ((rollout["logprobs"] - scored["ref_logprobs"]) * mask).sum(-1)
        stats = SumStats()
        for name, values in (("score_mean", scored["scores"]), ("kl", kl),
                             ("reward_mean", scored["scores"].clamp(-args.clip_reward_value, args.clip_reward_value)
                              - self.kl_ctl.value * kl),
                             ("response_length", mask.float().sum(-1))):
            stats.add(name, (values * weights).sum().item(), weights.sum().item())
        metrics = {f"{metric_key_prefix}_{name}": value for name, value in stats.reduced(args.device).items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(args, self.state, self.control, metrics)
        return metrics

    # -- EMA, saving and resuming ----------------------------------------------

    def init_ema(self) -> None:
        if self.args.enable_ema and self.ema is None:
            named = self.model.actor_named_parameters()
            with gathered([p for _, p in named]):
                self.ema = {name: p.detach().float().cpu().clone() for name, p in named}

    def update_ema(self) -> None:
        if self.ema is None:
            return
        named = self.model.actor_named_parameters()
        with gathered([p for _, p in named]):
            ema_update([self.ema[name] for name, _ in named], [p.detach().float().cpu() for _, p in named],
                       self.args.ema_beta)

    def save_ema(self, path: str) -> None:
        """actor_ema in ppo_lora_model's layout: the actor's adapter config, the averaged weights."""
        from peft import get_peft_model_state_dict

        actor = self.model.policy if isinstance(self.model, SharedBasePolicy) else self.model.actor
        weights = get_peft_model_state_dict(actor, state_dict=dict(self.ema), adapter_name="default")
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        actor.peft_config["default"].save_pretrained(path)
        self.tokenizer.save_pretrained(path)

    def save_roles(self, directory: str) -> None:
        """actor_ema and critic into directory (collective under ZeRO-3: every rank calls it)."""
        with gathered_trainable(self.model):
            if self.args.should_save:
                self.model.save_critic(os.path.join(directory, "critic"))
                self.tokenizer.save_pretrained(os.path.join(directory, "critic"))
                if self.ema is not None:
                    self.save_ema(os.path.join(directory, "actor_ema"))

    def save_model(self, output_dir=None, _internal_call=False):
        """Only what PPO trains (actor and critic adapters, value head): the frozen base is not
        the run's to save. In a checkpoint also the PPO state: iteration counter (which fixes the
        prompts and sampling seeds of every later iteration), KL controller, EMA."""
        output_dir = output_dir or self.args.output_dir
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        with gathered([p for _, p in trainable]):
            if self.args.should_save:
                os.makedirs(output_dir, exist_ok=True)
                save_file({n: p.detach().cpu().contiguous() for n, p in trainable},
                          os.path.join(output_dir, TRAINABLE_WEIGHTS_NAME), metadata={"format": "pt"})
        if _internal_call:
            if self.args.should_save:
                state = {"iteration": self.iteration, "steps_per_iteration": self.steps_per_iteration,
                         "kl_controller": self.kl_ctl.state_dict(), "seed": self.args.seed}
                with open(os.path.join(output_dir, PPO_STATE_NAME), "w", encoding="utf-8") as handle:
                    json.dump(state, handle, indent=2)
                if self.ema is not None:
                    self.save_ema(os.path.join(output_dir, "actor_ema"))
        elif self.args.should_save:
            self.tokenizer.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir):
        if not self.is_deepspeed_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        from accelerate.utils import DeepSpeedSchedulerWrapper
        from transformers.trainer import SCHEDULER_NAME

        # The Trainer leaves frozen weights out of DeepSpeed's checkpoint only for a PeftModel;
        # our module holds a frozen base too.
        self.model_wrapped.save_checkpoint(output_dir, exclude_frozen_parameters=True)
        if self.args.should_save and not isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        model = self.model if model is None else model
        path = os.path.join(resume_from_checkpoint, TRAINABLE_WEIGHTS_NAME)
        if not os.path.isfile(path):
            raise InputError(f"{resume_from_checkpoint}: not a PPO checkpoint (no {TRAINABLE_WEIGHTS_NAME})")
        weights = load_file(path)
        expected = {n for n, p in model.named_parameters() if p.requires_grad}
        if set(weights) != expected:
            raise InputError(f"{path}: the checkpoint's trained weights do not match this run's roles "
                             f"({len(set(weights) ^ expected)} names differ); resume with the same model options")
        model.load_state_dict(weights, strict=False)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.is_deepspeed_enabled and resume_from_checkpoint is not None:
            from transformers.integrations.deepspeed import deepspeed_load_checkpoint

            model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
            # Not strict: the checkpoint holds the trained weights only (see _save_optimizer_and_scheduler).
            deepspeed_load_checkpoint(self.model_wrapped, resume_from_checkpoint, load_module_strict=False)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        else:
            model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if resume_from_checkpoint is not None:
            self.load_ppo_state(resume_from_checkpoint)
        self.init_ema()
        logger.info("PPO: %d optimizer step(s) per iteration, %d iteration(s) to step %d, starting at iteration %d",
                    self.steps_per_iteration, math.ceil(max_steps / self.steps_per_iteration), max_steps, self.iteration)
        return model, train_dataloader

    def load_ppo_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, PPO_STATE_NAME)
        if not os.path.isfile(path):
            raise InputError(f"{checkpoint}: not a PPO checkpoint (no {PPO_STATE_NAME})")
        with open(path, encoding="utf-8") as handle:
            state = json.load(handle)
        if state["steps_per_iteration"] != self.steps_per_iteration:
            raise InputError(f"{path}: the checkpoint ran {state['steps_per_iteration']} optimizer steps per iteration, "
                             f"this run {self.steps_per_iteration}; resume with the same batch options")
        self.iteration = state["iteration"]
        self.kl_ctl.load_state_dict(state["kl_controller"])
        ema_path = os.path.join(checkpoint, "actor_ema", "adapter_model.safetensors")
        if self.args.enable_ema and os.path.isfile(ema_path):
            saved = load_file(ema_path)
            # Saved without peft's adapter name: map each saved key back to our parameter names.
            self.ema = {}
            for name, _ in self.model.actor_named_parameters():
                key = name.replace(".default.", ".")
                if key not in saved:
                    raise InputError(f"{ema_path}: no weight {key}; resume with the same model options")
                self.ema[name] = saved[key].float()


# ----------------------------------------------------------------------------- main


def main():
    model_args, data_args, training_args = parse_args((PPOModelArguments, PPODataArguments, PPOArguments))
    setup_logging(training_args)
    resume_checkpoint = resolve_resume_checkpoint(training_args)
    tokenizer, _, shared = check_models(model_args, data_args)
    template = use_template(data_args.template, tokenizer)
    prompts, eval_prompts = build_prompt_sets(data_args, tokenizer, template, training_args.seed)
    steps_per_iteration = check_schedule(training_args, len(prompts))
    ptx_blocks = None
    if data_args.unsupervised_dataset_dir:
        with training_args.main_process_first(desc="tokenize the ptx data"):
            ptx_blocks = build_pretraining_blocks(
                data_args.unsupervised_dataset_dir, tokenizer, data_args.max_prompt_seq_len + data_args.max_answer_seq_len,
                data_cache_dir(data_args.data_cache_dir))
    if eval_prompts is None and training_args.eval_strategy != "no":
        raise InputError("--eval_strategy needs held-out prompts: --validation_file or --validation_split_percentage")
    set_seed(training_args.seed)

    logger.info("placement: %s", "shared base (one frozen base, one adapter per role)" if shared else "separate models")
    if shared and model_args.offload_reference_model:
        logger.info("--offload_reference_model has nothing to move with --shared_base: the reference is the shared base")
    load = load_shared_policy if shared else load_separate_policy
    model = load(model_args, training_args, tokenizer)
    trainer = PPOTrainer(
        model=model,
        args=training_args,
        processing_class=tokenizer,
        eval_dataset=eval_prompts,
        callbacks=[SavePeftModelCallback("ppo_lora_model")],
        prompts=prompts,
        eval_prompts=eval_prompts,
        ptx_blocks=ptx_blocks,
        data_args=data_args,
        tokenizer=tokenizer,
        steps_per_iteration=steps_per_iteration,
    )
    train_and_finish(trainer, resume_checkpoint, False, eval_prompts, len(prompts))


if __name__ == "__main__":
    run_cli(main)
