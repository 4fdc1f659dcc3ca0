"""Token-budget batching (--max_tokens_per_batch): batches cut by tokens, the same on every rank and every
resume, each rank its own share; the loss over the accumulated batch's tokens; a run that trains and resumes bit for
bit (its kill-and-resume proof is a case of tests/trainers/test_sft.py's sft_resume); a budget below the longest row
refused."""

import json

import pytest
import torch
import torch.nn.functional as F

from helpers.commands import SFT_SCRIPT, check_refused, refuse
from helpers.tiny_runs import tiny_sft_args
from lorakit.core.cli import InputError
from lorakit.trainers.causal_lm import CausalLMTrainer
from lorakit.trainers.token_batches import TokenBudgetBatchSampler, budget_batches, check_token_budget, padded_width


def test_budget_batches_cut_rows_longest_first_by_padded_tokens():
    lengths = [5, 12, 3, 9, 16, 4, 7]
    # Sorted: 16 (row 4), 12 (1), 9 (3), 7 (6), 5 (0), 4 (5), 3 (2); budget 24, widths padded to 8:
    # [16] then 12 -> 2 x 16 = 32 > 24, new batch [12 (width 16)] + 9 -> 2 x 16 > 24, new [9 (16)] ...
    assert budget_batches(list(range(7)), lengths, 24, 8) == [[4], [1], [3], [6, 0, 5], [2]]
    # Without padding: [16]; [12, 9] (2 x 12 = 24); [7, 5, 4] (3 x 7 = 21, a fourth: 28); [3].
    assert budget_batches(list(range(7)), lengths, 24, 1) == [[4], [1, 3], [6, 0, 5], [2]]
    assert padded_width(9, 8) == 16 and padded_width(16, 8) == 16 and padded_width(9, 1) == 9


def test_a_budget_below_a_full_row_is_refused():
    with pytest.raises(InputError, match=r"--max_tokens_per_batch 15 is below --max_seq_length 9 \(16 once padded "
                                         r"to a multiple of 8\)"):
        check_token_budget(15, 9, 8)
    check_token_budget(16, 9, 8)


def sampler_epochs(lengths, budget, ranks, epochs=2):
    """{epoch: [each rank's batches]} of samplers built as each rank builds its own."""
    samplers = [TokenBudgetBatchSampler(lengths, budget, 1, seed=7, dp_size=ranks, rank=rank) for rank in range(ranks)]
    result = {}
    for epoch in range(epochs):
        for sampler in samplers:
            sampler.set_epoch(epoch)
        result[epoch] = [list(sampler) for sampler in samplers]
    return samplers, result


def test_each_rank_gets_its_own_batches_within_budget_the_same_count_every_epoch():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 64, (300,), generator=generator).tolist()
    samplers, epochs = sampler_epochs(lengths, 256, ranks=2)
    assert len(samplers[0]) == len(samplers[1]) == len(samplers[0].batches) // 2
    all_batches = sorted(map(sorted, samplers[0].batches))
    for by_rank in epochs.values():
        assert [len(batches) for batches in by_rank] == [len(samplers[0])] * 2
        dealt = [sorted(batch) for batches in by_rank for batch in batches]
        # Every batch within the budget; the ranks' batches disjoint, all of the cut batches but at most one.
        assert all(len(batch) * max(lengths[i] for i in batch) <= 256 for batch in dealt)
        assert len({tuple(batch) for batch in dealt}) == len(dealt)
        assert {tuple(batch) for batch in dealt} <= {tuple(batch) for batch in all_batches}
        assert len(all_batches) - len(dealt) == len(all_batches) % 2
    # Batches of about a full budget: sorting within windows leaves little padding.
    fed = sum(len(batch) * max(lengths[i] for i in batch) for batch in samplers[0].batches)
    assert sum(lengths) / fed > 0.9 and fed / (len(samplers[0].batches) * 256) > 0.85
    # Another epoch, another order; a sampler built again (a resumed run) deals the same.
    assert epochs[0] != epochs[1]
    assert sampler_epochs(lengths, 256, ranks=2)[1] == epochs


def budget_trainer(model_dir, output_dir, rows: list[list[int]], **overrides) -> CausalLMTrainer:
    """The SFT stage's Trainer over rows (token ids, each its own labels) with a 48-token budget, 2 micro-batches a
    step, on the tiny model with a fresh LoRA adapter."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorakit.data.build_dataset import DataCollatorForSupervisedDataset
    from lorakit.trainers.sft_config import SFTArguments

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    options = {"output_dir": str(output_dir), "use_cpu": True, "max_tokens_per_batch": 48,
               "gradient_accumulation_steps": 2, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
               "seed": 3, **overrides}
    dataset = Dataset.from_dict({"input_ids": rows, "labels": rows, "length": [len(row) for row in rows]})
    return CausalLMTrainer(model=model, args=SFTArguments(**options), train_dataset=dataset,
                           data_collator=DataCollatorForSupervisedDataset(0))


def test_token_budget_loss_is_over_the_tokens_of_the_whole_accumulated_batch(tiny_model_dir, tmp_path):
    """The first step's logged loss (the adapter still a no-op) is the summed next-token loss of its two
    micro-batches, which hold different numbers of rows and tokens, over their labelled tokens together: not the
    mean of the two micro-batches' means. Training then lowers it."""
    generator = torch.Generator().manual_seed(1)
    lengths = [24, 6, 7, 5, 16, 12, 8, 20, 4, 9, 11, 3] * 2
    rows = [torch.randint(5, 200, (n,), generator=generator).tolist() for n in lengths]
    trainer = budget_trainer(tiny_model_dir, tmp_path / "out", rows, max_steps=8, learning_rate=2e-2)
    sampler = trainer.get_train_dataloader().batch_sampler
    first_step = list(sampler)[:2]
    assert {len(batch) for batch in first_step} != {1} and len(first_step[0]) != len(first_step[1])
    sums, counts = [], []
    with torch.no_grad():
        for batch in first_step:
            inputs = trainer.data_collator([{"input_ids": rows[i], "labels": rows[i]} for i in batch])
            logits = trainer.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            labels = inputs["labels"][:, 1:]
            losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100, reduction="none")
            sums.append(float(losses.sum()))
            counts.append(int((labels != -100).sum()))
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged[0] == pytest.approx(sum(sums) / sum(counts), abs=1e-4)
    mean_of_means = sum(total / count for total, count in zip(sums, counts, strict=True)) / 2
    assert abs(mean_of_means - sum(sums) / sum(counts)) > 1e-3  # the two readings differ on these batches
    assert len(logged) == 8 and logged[-1] < 0.8 * logged[0]


def test_token_budget_refusal_writes_nothing(tiny_model_dir, tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"instruction": "hello", "output": "hi"}) + "\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = tiny_sft_args(tiny_model_dir, out, cache, data_path=data, max_seq_length=64, max_tokens_per_batch=32)
    check_refused(refuse(SFT_SCRIPT, args, in_process=True), "--max_tokens_per_batch 32 is below --max_seq_length 64")
    assert not out.exists() and not cache.exists()
