"""Preference pairs as the reward and DPO stages (and the reward report) read them: the files found, validated and
tokenized with the chat template (DeepSpeed-Chat's data split, the held-out share), the rendering they are
tokenized with, and whether a model runs each pair's shared prompt once."""

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from transformers import PreTrainedConfig, PreTrainedTokenizerBase, TrainingArguments, set_seed

from lorakit.core.cli import InputError
from lorakit.data.build_dataset import build_preference_dataset
from lorakit.data.cache import data_cache_dir
from lorakit.data.splits import ValidationSplit, first_samples, held_out_check, split_validation
from lorakit.models.heads import MASKABLE_ATTENTION
from lorakit.models.loader import choose_pad_token
from lorakit.records.chat_templates import ChatTemplate, parse_template_kwargs, use_template
from lorakit.records.readers import find_record_files
from lorakit.trainers.arguments import PreferenceDataArguments
from lorakit.trainers.common import resolve_sequence_length

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from lorakit.trainers.dpo_config import DPOArguments
    from lorakit.trainers.reward_config import RewardArguments

logger = logging.getLogger(__name__)


class PairRendering(NamedTuple):
    """How the stage renders its pairs: the chat template with its keyword arguments, and --max_seq_length."""

    chat_template: ChatTemplate
    max_length: int


def build_pair_datasets(data_args: PreferenceDataArguments, tokenizer: PreTrainedTokenizerBase,
                        chat_template: ChatTemplate, max_length: int, seed: int) -> ValidationSplit:
    files = find_record_files(data_args.dataset_dir, data_args.data_path)
    if not files:
        raise InputError("no training data: give --dataset_dir or --data_path")
    common: dict[str, Any] = {"tokenizer": tokenizer, "template": chat_template.text,
                              "template_kwargs": chat_template.kwargs, "max_length": max_length,
                              "cache_dir": data_cache_dir(data_args.data_cache_dir),
                              "num_proc": data_args.preprocessing_num_workers}
    check = None if data_args.validation_file else held_out_check(data_args.validation_split_percentage, seed, "pairs")
    train = build_preference_dataset(files, data_split=data_args.data_split, data_phase=data_args.data_phase,
                                     seed=seed, check=check, **common)
    if data_args.validation_file:
        return ValidationSplit(train, build_preference_dataset(find_record_files(None, [data_args.validation_file]),
                                                            **common))
    return split_validation(train, data_args.validation_split_percentage, seed, "pairs")


def pair_rendering(data_args: PreferenceDataArguments, tokenizer: PreTrainedTokenizerBase,
                   config: PreTrainedConfig) -> PairRendering:
    """The chat template (the pad token chosen for it) and the sequence length the pairs are tokenized with."""
    max_length = resolve_sequence_length("--max_seq_length", data_args.max_seq_length, config)
    chat_template = use_template(data_args.template, tokenizer,
                                 parse_template_kwargs(data_args.template_kwargs, data_args.enable_thinking))
    choose_pad_token(tokenizer, chat_template)
    return PairRendering(chat_template, max_length)


def prepared_pairs(data_args: PreferenceDataArguments, training_args: TrainingArguments,
                   tokenizer: PreTrainedTokenizerBase, config: PreTrainedConfig,
                   rendering: PairRendering | None = None) -> ValidationSplit:
    """(train pairs, eval pairs or None), tokenized with the chat template (the pad token chosen for it), the
    main process first; shared with the DPO stage, which reads the same pairs."""
    chat_template, max_length = rendering or pair_rendering(data_args, tokenizer, config)
    set_seed(training_args.seed)
    with training_args.main_process_first(desc="tokenize the preference pairs"):
        train_dataset, eval_dataset = build_pair_datasets(data_args, tokenizer, chat_template, max_length,
                                                     training_args.seed)
    train_dataset = first_samples(train_dataset, data_args.max_train_samples)
    assert train_dataset is not None  # first_samples keeps a dataset it is given (typed Dataset | None for any)
    eval_dataset = first_samples(eval_dataset, data_args.max_eval_samples)
    logger.info("train pairs: %d, eval pairs: %d", len(train_dataset), len(eval_dataset) if eval_dataset else 0)
    return ValidationSplit(train_dataset, eval_dataset)


def shares_pair_prefix(model: "PreTrainedModel | PeftModel", training_args: "RewardArguments | DPOArguments") -> bool:
    """One row per pair (the prompt once) where the attention implementation takes the pair mask."""
    attention = model.config._attn_implementation
    share_prefix = training_args.share_pair_prefix and attention in MASKABLE_ATTENTION
    if training_args.share_pair_prefix and not share_prefix:
        logger.info("%s attention takes no custom mask: each pair's prompt is run twice (two rows)", attention)
    return share_prefix
