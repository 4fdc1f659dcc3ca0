"""The names Chinese-LLaMA-Alpaca-2's build_dataset.py gives users, offered from the package for code written
against them: the cached data pipelines (pretraining blocks, supervised conversations, preference pairs, packed
rows), DataCollatorForSupervisedDataset, and SavePeftModelCallback. The code lives in lorakit.data.build_dataset
and lorakit.trainers.checkpoints; new code imports it from there."""

from lorakit.data.build_dataset import (  # noqa: F401  (the card's names, re-exported)
    DataCollatorForSupervisedDataset,
    build_preference_dataset,
    build_pretraining_blocks,
    build_sft_dataset,
    cached_packed_rows,
)
from lorakit.trainers.checkpoints import SavePeftModelCallback  # noqa: F401  (the card's name, re-exported)
