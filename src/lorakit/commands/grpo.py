"""Group-relative RL with LoRA: GRPO (with Dr. GRPO's and DAPO's losses), RLOO and REINFORCE++, rewarded by
programs (`--reward_funcs`), a learned reward model (`--reward_lora_model`), or both.

    torchrun --nproc_per_node 8 scripts/training/run_grpo.py \
        --model_name_or_path BASE --peft_path SFT_OUT/sft_lora_model \
        --dataset_dir PROMPTS --reward_funcs exact_match --num_generations 8 --max_completion_length 256 \
        --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --beta 0 \
        --output_dir OUT --max_steps 500 --deepspeed ds_configs/ds_zero2_no_offload.json ...

Flags take TRL's names (GRPOConfig), which users of this method bring; PPO's names are accepted as mapped aliases
with a log line (--kl_ctl -> --beta, --cliprange -> --epsilon, --ppo_epochs -> --num_iterations,
--max_answer_seq_len -> --max_completion_length, --actor_model_name_or_path / --actor_lora_model -> --model_name_or_path
/ --peft_path).

Each iteration (one rollout), every process takes per_device_train_batch_size x gradient_accumulation_steps /
num_generations prompts of its own stretch of the prompt stream, samples num_generations answers to each with the
current actor (rl.rollout's engine; the group of a prompt stays on its process), scores them (rl.reward_functions'
weighted sum, plus the reward model's score), turns the scores into advantages (rl.group_math: --advantage_estimator)
and trains --num_iterations optimizer steps on them (each of gradient_accumulation_steps micro-batches of
per_device_train_batch_size answers), as TRL's GRPOTrainer does with its default steps_per_generation.

Roles: the actor (the base with a LoRA adapter: new, or continuing --peft_path); the reference, only when --beta > 0
(the base with the adapter disabled, or a frozen copy of --peft_path); the reward model, only with
--reward_lora_model (an adapter of run_reward.py on the same base). No critic. Writes OUT/grpo_lora_model (actor
adapter + tokenizer), OUT/actor_ema (--enable_ema) and resumable OUT/checkpoint-N.

This module is the command; its arguments are rl.grpo_config, the checks on the inputs rl.grpo_checks, the Trainer
rl.grpo_trainer, the math rl.group_math, the rewards rl.reward_functions.
"""


from transformers import set_seed

from lorakit.core.cli import parse_args, run_cli
from lorakit.data.cache import cache_key
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.prompts import build_prompt_sets
from lorakit.data.run_record import note_data
from lorakit.models.loader import choose_pad_token
from lorakit.records.chat_templates import parse_template_kwargs, use_template
from lorakit.rl.group_policy import load_group_policy
from lorakit.rl.grpo_checks import GroupSchedule, check_grpo_models, check_save_schedule
from lorakit.rl.grpo_config import ARGUMENT_CLASSES
from lorakit.rl.health import read_sft_answers
from lorakit.rl.reward_functions import check_record_fields, load_reward_functions
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import check_held_out_data, resolve_resume_checkpoint, setup_logging, train_and_finish


def main() -> None:
    from lorakit.rl.grpo_trainer import GRPOTrainer

    model_args, data_args, training_args = parse_args(ARGUMENT_CLASSES)
    training_args.mapped_flags += model_args.mapped_flags + data_args.mapped_flags
    setup_logging(training_args)
    check_held_out_data(data_args, training_args, "prompts")
    schedule = GroupSchedule(training_args)
    rewards = load_reward_functions(training_args.reward_funcs, training_args.reward_weights,
                                    training_args.max_completion_length, training_args.overlong_buffer)
    resume_checkpoint = resolve_resume_checkpoint(training_args, model_args, data_args)
    tokenizer, config = check_grpo_models(model_args, data_args, training_args)
    sft_answers = read_sft_answers(training_args.sft_answers_file)
    chat_template = use_template(data_args.template, tokenizer,
                                 parse_template_kwargs(data_args.template_kwargs, data_args.enable_thinking))
    choose_pad_token(tokenizer, chat_template)
    prompt_sets = build_prompt_sets(data_args, tokenizer, chat_template, training_args.seed)
    check_record_fields(rewards, prompt_sets.train_records + (prompt_sets.evaluation_records or []))
    note_data(f"grpo-prompts-{cache_key({'train': prompt_sets.train, 'eval': prompt_sets.evaluation})}")
    answers = ConversationTokenizer(tokenizer, chat_template.text, training_args.max_completion_length,
                                    template_kwargs=chat_template.kwargs)
    check_save_schedule(training_args, schedule.steps, len(prompt_sets.train), schedule.prompts)
    set_seed(training_args.seed)
    model = load_group_policy(model_args, training_args, tokenizer, config)
    trainer = GRPOTrainer(
        model=model, args=training_args, processing_class=tokenizer, eval_dataset=prompt_sets.evaluation,
        callbacks=[SavePeftModelCallback("grpo_lora_model")], prompts=prompt_sets.train,
        eval_prompts=prompt_sets.evaluation, records=prompt_sets.train_records,
        eval_records=prompt_sets.evaluation_records, rewards=rewards, schedule=schedule, tokenizer=tokenizer,
        max_prompt_len=data_args.max_prompt_seq_len, after_turn_end_ids=answers.after_turn_end_ids(),
        answer_end_id=answers.answer_end_id(), sft_answers=sft_answers)
    train_and_finish(trainer, resume_checkpoint, False, prompt_sets.evaluation, len(prompt_sets.train))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


