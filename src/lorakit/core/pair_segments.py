"""The segment ids of a shared-prefix preference-pair row: written by the pair collator
(data.build_dataset.DataCollatorForPreferencePairs), read by the reward model's attention mask and
score pooling (models.heads). A foundation module, so neither of the two layers imports the other
for four numbers."""

PAIR_PREFIX, PAIR_CHOSEN, PAIR_REJECTED, PAIR_PADDING = 0, 1, 2, 3
