"""Chat with a merged model, or a base model + LoRA adapter, in the terminal; or answer a file of
prompts in batches.

    python scripts/inference/chat.py --base_model MERGED_DIR
    python scripts/inference/chat.py --base_model BASE --lora_model outputs/sft/sft_lora_model
    python scripts/inference/chat.py --base_model MERGED_DIR \
        --data_file prompts.jsonl --predictions_file predictions.jsonl --batch_size 8

Prompts are rendered with the chat template saved with the tokenizer at training time. In a
chat, /clear forgets the history and /quit (or end of input) leaves; the oldest exchanges are
dropped when the conversation outgrows the context.
"""

import logging
import os
import sys
from dataclasses import asdict

from transformers import set_seed

from lorakit.core.cli import InputError, parse_args, run_cli
from lorakit.serve.chat import (
    chat_loop,
    encode_prompts,
    predict_file,
    prompt_budget,
    read_prompt_records,
    sampling_settings,
)
from lorakit.serve.chat_config import ARGUMENT_CLASSES
from lorakit.serve.inference import load_generator, log_mapped_flags

logger = logging.getLogger(__name__)


def main() -> None:
    model_args, chat_args = parse_args(ARGUMENT_CLASSES)
    # Logs go to stderr: stdout carries the conversation (or nothing, in batch mode).
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO, stream=sys.stderr, force=True)
    log_mapped_flags(model_args, chat_args)
    settings = sampling_settings(chat_args)
    batch_mode = chat_args.data_file or chat_args.predictions_file
    records = None
    if batch_mode:
        if not (chat_args.data_file and chat_args.predictions_file):
            raise InputError("batch mode needs both --data_file and --predictions_file")
        if os.path.exists(chat_args.predictions_file):
            raise InputError(f"{chat_args.predictions_file}: --predictions_file already exists; "
                             "choose another name or remove it")
        records = read_prompt_records(chat_args.data_file, chat_args.system_prompt)
    # The data, the tokenizer and its template are checked before the weights are loaded.
    generator = load_generator(model_args, chat_args.trust_remote_code)
    logger.info("sampling: %s", asdict(settings))
    if chat_args.seed is not None:
        set_seed(chat_args.seed)  # once: each turn then continues the same random stream
    if records is not None:  # batch mode
        prompts = encode_prompts(records, generator, prompt_budget(generator, settings.max_new_tokens))
        predict_file(generator, prompts, settings, chat_args.batch_size, chat_args.predictions_file)
    else:
        chat_loop(generator, settings, chat_args.system_prompt, chat_args.show_prompt)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
