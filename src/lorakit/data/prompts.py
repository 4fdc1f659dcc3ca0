"""PPO's prompts: the records of each file as conversations ending where the model answers next,
split into train and held-out, rendered with the generation prompt and tokenized."""

import logging
from typing import Optional

from lorakit.core.cli import InputError
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.splits import held_out_indices, phase_part
from lorakit.records.readers import find_record_files, prompt_of, records_of

logger = logging.getLogger(__name__)


def read_prompts(files: list, data_split: Optional[str], data_phase: int, seed: int) -> list:
    """[(where, messages)] of every file (its --data_phase part with --data_split)."""
    prompts = []
    for path in files:
        prompts += [(where, prompt_of(where, record))
                    for where, record in phase_part(records_of(path), data_split, data_phase, seed)]
    if not prompts:
        raise InputError(f"no prompt in {', '.join(files)} for --data_phase {data_phase} of --data_split {data_split}")
    return prompts


def tokenize_prompts(prompts: list, tokenizer, template: str, max_prompt_len: int, desc: str,
                     template_kwargs: Optional[dict] = None) -> list:
    """Token ids of each prompt rendered with the generation prompt; a prompt longer than
    max_prompt_len keeps its end (the question nearest the answer), as DeepSpeed-Chat does."""
    renderer = ConversationTokenizer(tokenizer, template, max_prompt_len, template_kwargs=template_kwargs)
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


def build_prompt_sets(data_args, tokenizer, chat_template, seed: int) -> tuple:
    """(train prompt ids, held-out prompt ids or None) from run_ppo's PPODataArguments, rendered
    with the run's chat_templates.ChatTemplate."""
    files = find_record_files(data_args.dataset_dir, data_args.data_path)
    if not files:
        raise InputError("no prompts: give --dataset_dir or --data_path")
    prompts = read_prompts(files, data_args.data_split, data_args.data_phase, seed)
    eval_prompts = None
    if data_args.validation_file:
        eval_prompts = read_prompts(find_record_files(None, [data_args.validation_file]), None, data_args.data_phase,
                                    seed)
    elif data_args.validation_split_percentage > 0:
        train, held_out = held_out_indices(len(prompts), data_args.validation_split_percentage, seed, "prompts")
        prompts, eval_prompts = [prompts[i] for i in train], [prompts[i] for i in held_out]
    if data_args.max_train_samples is not None:
        prompts = prompts[: data_args.max_train_samples]
    if eval_prompts is not None and data_args.max_eval_samples is not None:
        eval_prompts = eval_prompts[: data_args.max_eval_samples]
    rows = {}
    for name, chosen in (("train", prompts), ("eval", eval_prompts)):
        rows[name] = None if chosen is None else tokenize_prompts(
            chosen, tokenizer, chat_template.text, data_args.max_prompt_seq_len, f"{name} prompts",
            chat_template.kwargs)
    return rows["train"], rows["eval"]
