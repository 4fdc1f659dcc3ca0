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

This module is the command; its arguments are rl.ppo_config, the checks on the inputs rl.ppo_checks, the roles
rl.role_policy and rl.ppo_policy, the Trainer rl.ppo_trainer and the math rl.rl_math.
"""

import logging
from typing import TYPE_CHECKING, NamedTuple

from transformers import set_seed

from lorakit.core.cli import parse_args, run_cli
from lorakit.data.build_dataset import build_pretraining_blocks
from lorakit.data.cache import cache_key, data_cache_dir, report_prepared_data
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.prompts import build_prompt_sets
from lorakit.data.run_record import note_data
from lorakit.models.loader import choose_pad_token
from lorakit.records.chat_templates import ChatTemplate, parse_template_kwargs, use_template
from lorakit.rl.health import read_sft_answers
from lorakit.rl.ppo_checks import check_models, check_role_loading, check_schedule
from lorakit.rl.ppo_config import ARGUMENT_CLASSES, PPOArguments, PPODataArguments, PPOModelArguments
from lorakit.rl.ppo_policy import (
    SeparatePolicy,
    SharedBasePolicy,
    check_frozen_roles_fit,
    load_separate_policy,
    load_shared_policy,
)
from lorakit.rl.ppo_trainer import PPOTrainer
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import check_held_out_data, resolve_resume_checkpoint, setup_logging, train_and_finish

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def main() -> None:
    model_args, data_args, training_args = parse_args(ARGUMENT_CLASSES)
    training_args.mapped_flags += model_args.mapped_flags
    setup_logging(training_args)
    check_held_out_data(data_args, training_args, "prompts")
    resume_checkpoint = None if data_args.prepare_data_only else resolve_resume_checkpoint(training_args, model_args,
                                                                                         data_args)
    tokenizer, configs, shared = check_models(model_args, data_args)
    sft_answers = read_sft_answers(training_args.sft_answers_file)
    check_role_loading(model_args, training_args, tokenizer, configs)
    if not shared:
        check_frozen_roles_fit(model_args, training_args, tokenizer, configs)
    chat_template = use_template(data_args.template, tokenizer,
                                 parse_template_kwargs(data_args.template_kwargs, data_args.enable_thinking))
    choose_pad_token(tokenizer, chat_template)
    prompt_sets = build_prompt_sets(data_args, tokenizer, chat_template, training_args.seed)
    prompts, eval_prompts = prompt_sets.train, prompt_sets.evaluation
    # Tokenized in memory, not cached: their fingerprint is the run's record of its prompts (a resume checks it).
    note_data(f"ppo-prompts-{cache_key({'train': prompts, 'eval': eval_prompts})}")
    after_turn_end_ids, answer_end_id = answer_ends(tokenizer, chat_template, data_args)
    steps_per_iteration = check_schedule(training_args, len(prompts))
    ptx_blocks = ptx_blocks_of(data_args, training_args, tokenizer)
    if data_args.prepare_data_only:  # the prompts are tokenized in memory at each launch: only ptx data is cached
        return report_prepared_data()
    set_seed(training_args.seed)
    model = load_policy(model_args, training_args, tokenizer, configs, shared)
    trainer = PPOTrainer(
        model=model, args=training_args, processing_class=tokenizer, eval_dataset=eval_prompts,
        callbacks=[SavePeftModelCallback("ppo_lora_model")], prompts=prompts, eval_prompts=eval_prompts,
        ptx_blocks=ptx_blocks, data_args=data_args, tokenizer=tokenizer, steps_per_iteration=steps_per_iteration,
        after_turn_end_ids=after_turn_end_ids, answer_end_id=answer_end_id, sft_answers=sft_answers)
    train_and_finish(trainer, resume_checkpoint, False, eval_prompts, len(prompts))


class AnswerEnds(NamedTuple):
    """Where an answer ends (its last token's id) and the ids the template puts after its turn's end: the reward
    model reads its score there (run_reward.py trains it so)."""

    after_turn_end_ids: list[int]
    answer_end_id: int


def answer_ends(tokenizer: "PreTrainedTokenizerBase", chat_template: ChatTemplate,
                data_args: PPODataArguments) -> AnswerEnds:
    """The template's answer ends, said in the log."""
    answers = ConversationTokenizer(tokenizer, chat_template.text, data_args.max_answer_seq_len,
                                    template_kwargs=chat_template.kwargs)
    ends = AnswerEnds(answers.after_turn_end_ids(), answers.answer_end_id())
    logger.info("answers end with %r and are scored after the template's turn end %r",
                tokenizer.convert_ids_to_tokens(ends.answer_end_id), tokenizer.decode(ends.after_turn_end_ids))
    return ends


def ptx_blocks_of(data_args: PPODataArguments, training_args: PPOArguments,
                  tokenizer: "PreTrainedTokenizerBase") -> "Dataset | None":
    """--unsupervised_dataset_dir's pretraining blocks of a whole rollout's length (prompt and answer), cached."""
    if not data_args.unsupervised_dataset_dir:
        return None
    with training_args.main_process_first(desc="tokenize the ptx data"):
        return build_pretraining_blocks(
            data_args.unsupervised_dataset_dir, tokenizer,
            data_args.max_prompt_seq_len + data_args.max_answer_seq_len, data_cache_dir(data_args.data_cache_dir),
            data_args.preprocessing_num_workers)


def load_policy(model_args: PPOModelArguments, training_args: PPOArguments, tokenizer: "PreTrainedTokenizerBase",
                configs: dict[str, "PreTrainedConfig"], shared: bool) -> SharedBasePolicy | SeparatePolicy:
    """The four roles on one shared base (an adapter each) or as separate models, said in the log."""
    logger.info("placement: %s", "shared base (one frozen base, one adapter per role)" if shared else "separate models")
    if shared and model_args.offload_reference_model:
        logger.info("--offload_reference_model has nothing to move with --shared_base: "
                    "the reference is the shared base")
    if shared:
        return load_shared_policy(model_args, training_args, tokenizer, configs)
    return load_separate_policy(model_args, training_args, tokenizer, configs)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
