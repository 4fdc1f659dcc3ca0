"""The inputs every measurement reads, written once in the parent before the first run.

Tokenizer: a byte-level BPE of ~1k tokens trained on seeded pseudo-words (one word is about one token); the models'
embeddings keep their full vocabulary, so the LM head costs what it costs the real model. Data: seeded single-turn
chats ("messages" records, one jsonl that both sides read) of uniformly spread lengths up to --seq_len, rendered with
lorakit's "human_assistant" template; one long chat per memory row length; instruction prompts for PPO and GRPO; and
GRPO's reward function (bench_grpo.py's: the length of each answer's text modulo 7).
"""

from __future__ import annotations

import random
from pathlib import Path

from bench_grpo import REWARD_SOURCE
from measure import write_jsonl

from .shapes import SEED

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def pseudo_words(count: int, rng: random.Random) -> list:
    words = set()
    while len(words) < count:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))))
    return sorted(words)


def write_tokenizer(directory: Path, words: list) -> None:
    """A byte-level BPE trained on the words: with ~1k merges each word becomes about one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([" ".join(words[i:i + 20]) for i in range(0, len(words), 20)] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(str(directory))


def chat(words: list, rng: random.Random, answer_words: int) -> dict:
    prompt = " ".join(rng.choice(words) for _ in range(8))
    answer = " ".join(rng.choice(words) for _ in range(max(1, answer_words)))
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def write_data(work: Path, settings: dict) -> dict:
    """The tokenizer, the data files and the reward function every measurement reads: {name: path}."""
    rng = random.Random(SEED)
    words = pseudo_words(400, rng)
    paths = {"tokenizer": work / "tokenizer", "sft": work / "sft.jsonl", "prompts": work / "prompts.jsonl",
             "reward_function": work / "grpo_reward.py"}
    write_tokenizer(paths["tokenizer"], words)
    seq_len, rows = settings["seq_len"], max(batch for _, _, batch in settings["models"].values())
    # Lengths spread from a sixteenth of seq_len to a little over it (the longest cut to seq_len).
    write_jsonl(paths["sft"], [chat(words, rng, rng.randint(seq_len // 16, seq_len + seq_len // 8))
                               for _ in range(settings["steps"] * rows * 2)])
    for length in settings["memory_lengths"]:
        paths[f"memory-{length}"] = work / f"memory-{length}.jsonl"
        write_jsonl(paths[f"memory-{length}"], [chat(words, rng, length + 64) for _ in range(4)])
    write_jsonl(paths["prompts"], [{"instruction": " ".join(rng.choice(words) for _ in range(12))}
                                   for _ in range(settings["ppo_prompts"] * settings["ppo_iterations"])])
    paths["reward_function"].write_text(REWARD_SOURCE, encoding="utf-8")
    return {name: str(path) for name, path in paths.items()}
