"""The PPO stage's Trainer: experience (generation, no-grad scoring, KL-penalised rewards, GAE),
the clipped PPO update of actor and critic in one module, EMA, and checkpoints that resume the
iteration stream exactly."""

import json
import logging
import math
import os
import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from model_utils import gathered_trainable, last_position
from ppo_policy import SharedBasePolicy
from ppo_utils import (
    ema_update,
    entropy_from_logits,
    gae_advantages_and_returns,
    kl_penalty_rewards,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)
from training_utils import InputError, ResumableTrainer

logger = logging.getLogger(__name__)

PPO_STATE_NAME = "ppo_state.json"
TRAINABLE_WEIGHTS_NAME = "ppo_trainable.safetensors"


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


def append_turn_end(input_ids, attention_mask, eos_token_id: int, turn_end_ids: list) -> tuple:
    """Rows whose last attended token is EOS (answers that ended) get the template's turn end
    (ChatML's "\n") right after it, where the reward model was trained to read its score (see
    build_dataset.ConversationTokenizer's keep_turn_end). Rows cut at the answer length limit
    are scored where they stop. Returns new (ids, mask), len(turn_end_ids) columns wider."""
    if not turn_end_ids:
        return input_ids, attention_mask
    extra = len(turn_end_ids)
    ids = F.pad(input_ids, (0, extra), value=eos_token_id)
    mask = F.pad(attention_mask, (0, extra), value=0)
    last = last_position(attention_mask)
    rows = torch.nonzero(input_ids.gather(1, last[:, None]).squeeze(1) == eos_token_id).squeeze(1)
    for offset, token in enumerate(turn_end_ids, start=1):
        ids[rows, last[rows] + offset] = token
        mask[rows, last[rows] + offset] = 1
    return ids, mask


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

    def __init__(self, *args, prompts, eval_prompts, ptx_blocks, data_args, tokenizer, steps_per_iteration,
                 turn_end_ids=(), answer_end_id=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.prompts, self.eval_prompts, self.ptx_blocks = prompts, eval_prompts, ptx_blocks
        self.turn_end_ids = list(turn_end_ids)
        # The token that ends an answer: the template's turn end (Phi-3's <|end|>, Gemma's
        # <end_of_turn>) where it is not EOS; generation stops on it and scores are read after it.
        self.answer_end_id = tokenizer.eos_token_id if answer_end_id is None else answer_end_id
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
            eos_token_id=self.answer_end_id, pad_token_id=self.pad_id, use_cache=True,
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
        mask, has_eos = answer_mask(answers, self.answer_end_id)
        return {"input_ids": torch.cat([prompt_ids, answers], dim=1).to(device),
                "attention_mask": torch.cat([prompt_mask, mask], dim=1).to(device),
                "mask": mask.to(device), "has_eos": has_eos.to(device), "width": width,
                "logprobs": padded(logprobs, 0.0).to(device) * mask.to(device),
                "entropy": padded(entropy, 0.0).to(device) * mask.to(device)}

    @torch.no_grad()
    def score_experience(self, rollout: dict) -> dict:
        """The no-grad passes, one generation batch at a time: reference log-probs of the answer
        tokens, critic values, reward scores (of each answer closed by the template's turn end)."""
        model, width, eos = self.model, rollout["width"], self.answer_end_id

        def passes(ids, mask, prompt_length):
            return {"ref_logprobs": model.answer_logprobs("reference", ids, mask, prompt_length),
                    "values": model.answer_values(ids, mask, prompt_length),
                    "scores": model.scores(*append_turn_end(ids, mask, eos, self.turn_end_ids))}

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
