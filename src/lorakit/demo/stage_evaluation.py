"""The demo's held-out evaluation of its stages' outputs, before and after each: perplexity on the held-out
documents (pt_merged against the base), exact match on the held-out arithmetic questions (SFT's and GRPO's
adapters, greedy and sampled, GRPO's gain over SFT with its paired-bootstrap interval), and the reward model's
mean score of the policies' greedy answers to the held-out review prompts (SFT, PPO, DPO). Every model the chain
went through stays on disk, so each is loaded frozen here (lorakit's own loader) and scored on the same data."""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

from lorakit.demo.exact_match import (
    exact_match,
    generate_answers,
    paired_bootstrap_interval,
    render_prompts,
    sampled_exact_match,
)
from lorakit.demo.heldout_eval import heldout_nll
from lorakit.demo.plan import (
    BLOCK_SIZE,
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    EVAL_SAMPLES,
    EVAL_SEED,
    SFT_MAX_NEW_TOKENS,
    Demo,
    RewardScorer,
    StageError,
    grpo_recipe,
)
from lorakit.demo.report import Figures
from lorakit.demo.sft_tasks import ANSWER_FORMAT
from lorakit.records.chat_templates import render_text

if TYPE_CHECKING:  # the models load lazily, inside the stages that score them
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger("demo")
# The arithmetic task's whole answer ("The answer is -7." included): an answer to a question in any other form counts as
# the other task's in the collapse figures.
ARITHMETIC_ANSWER = re.compile(re.escape(ANSWER_FORMAT).replace(r"\{\}", r"-?\d+"))


# ----------------------------------------------------------------------------- stages


def heldout_before(demo: Demo) -> Figures:
    return heldout_perplexity(demo, demo.model_dir)


def heldout_after(demo: Demo) -> Figures:
    return heldout_perplexity(demo, demo.path("pt_merged"))


def exact_match_before(demo: Demo) -> Figures:
    return heldout_exact_match(demo, adapter=None)


def exact_match_after(demo: Demo) -> Figures:
    figures = heldout_exact_match(demo, adapter=demo.path("sft", "sft_lora_model"), sampled=True)
    demo.sft_correct = [answer["correct"] for answer in figures["answers"]]
    demo.sft_sampled = figures["sampled"]["per_question"]
    return figures


def reward_before_ppo(demo: Demo) -> Figures:
    return heldout_reward(demo, demo.path("sft", "sft_lora_model"))


def reward_after_ppo(demo: Demo) -> Figures:
    return heldout_reward(demo, demo.path("ppo", "ppo_lora_model"))


def reward_after_dpo(demo: Demo) -> Figures:
    """The DPO policy's answers to PPO's held-out prompts, scored as the SFT and PPO policies' are."""
    return heldout_reward(demo, demo.path("sft", "sft_lora_model"), demo.path("dpo", "dpo_lora_model"))


def exact_match_after_grpo(demo: Demo) -> Figures:
    """The GRPO policy's exact match on the SFT policy's held-out questions, greedy and sampled, each gain over SFT's
    with its 95% paired-bootstrap interval (the same questions resampled for both)."""
    figures = heldout_exact_match(demo, adapter=demo.path("grpo", "grpo_lora_model"), sampled=True)
    correct = [answer["correct"] for answer in figures["answers"]]
    greedy = paired_gain(demo.sft_correct, correct)
    sampled = paired_gain(demo.sft_sampled, figures["sampled"]["per_question"])
    for name, gain in (("greedy", greedy), (f"{EVAL_SAMPLES} samples a question", sampled)):
        logger.info("GRPO: exact match (%s) %.3f -> %.3f, gain %+.3f, 95%% paired-bootstrap interval [%+.3f, %+.3f]",
                    name, gain["before"], gain["after"], gain["gain"], *gain["interval"])
    return {**figures, "sft_correct": sum(demo.sft_correct), "gain": greedy["gain"],
            "gain_interval": greedy["interval"], "sampled_gain": sampled, "bootstrap_resamples": BOOTSTRAP_RESAMPLES}


def paired_gain(before: Sequence[float], after: Sequence[float]) -> Figures:
    """Mean score before and after on the same questions, the gain and its 95% paired-bootstrap interval."""
    low, high = paired_bootstrap_interval(before, after, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    return {"before": mean_before, "after": mean_after, "gain": mean_after - mean_before, "interval": [low, high]}


# ----------------------------------------------------------------------------- scoring


class FrozenModel(NamedTuple):
    """A model loaded for scoring only (float32, eval mode), and the tokenizer it was trained with."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def load_frozen_model(base: str | Path, adapters: tuple[Path, ...] = (), task: str = "causal_lm") -> FrozenModel:
    """The model and tokenizer through the toolkit's own loader: base, or base + adapters folded in, in
    order (DPO's policy: the SFT adapter, then DPO's, as the merge tool applies them), with the last
    adapter's saved tokenizer (its vocabulary and chat template; the embeddings grown to it first),
    in float32, in eval mode."""
    import peft

    from lorakit.core.model_files import has_tokenizer
    from lorakit.models.adapters import load_peft_adapter
    from lorakit.models.arguments import ModelArguments
    from lorakit.models.loader import load_model, load_tokenizer

    first, last = (str(adapters[0]), str(adapters[-1])) if adapters else (None, None)
    model_args = ModelArguments(model_name_or_path=str(base), peft_path=first,
                                tokenizer_name_or_path=last if has_tokenizer(last) else None, torch_dtype="float32")
    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, None, tokenizer, task=task, trainable=False)
    assert not isinstance(model, peft.PeftModel)  # trainable=False: the adapter folded in (models.adapters.frozen)
    for adapter in adapters[1:]:
        adapted = load_peft_adapter(model, str(adapter), is_trainable=False, flag="--lora_model")
        # peft types merge_and_unload() as any nn.Module: it returns the transformers model it wraps.
        model = cast("PreTrainedModel", adapted.merge_and_unload())
    return FrozenModel(model.eval(), tokenizer)


def heldout_perplexity(demo: Demo, model_dir: str | Path) -> Figures:
    model, tokenizer = load_frozen_model(model_dir)
    figures = heldout_nll(model, tokenizer, demo.heldout_texts, BLOCK_SIZE,
                          desc=f"Held-out NLL ({Path(model_dir).name})")
    del model
    gc.collect()  # the next stage may load a model of the same size
    logger.info("held-out: %d tokens, %d chars: perplexity %.3f per token, %.3f per char",
                figures["tokens"], figures["chars"], figures["ppl_token"], figures["ppl_char"])
    return {"vocabulary": len(tokenizer), **figures}


def heldout_exact_match(demo: Demo, adapter: Path | None, sampled: bool = False) -> Figures:
    """Greedy answers to the held-out questions by pt_merged (the model SFT starts from), with or
    without an adapter (SFT's, GRPO's); sampled, also EVAL_SAMPLES sampled answers a question at GRPO's
    temperature ("sampled"). With an adapter, the prompts are rendered by the tokenizer saved with it, i.e.
    by the chat template the adapter was trained with."""
    model, tokenizer = load_frozen_model(demo.path("pt_merged"), (adapter,) if adapter else ())
    if not tokenizer.chat_template:
        raise StageError(f"{adapter or demo.path('pt_merged')}: the tokenizer has no chat_template")
    # In one batch: 50 questions take 5.5 s instead of 8 in batches of 16 (2 CPU cores).
    figures = exact_match(model, tokenizer, demo.sft_heldout, max_new_tokens=SFT_MAX_NEW_TOKENS,
                          batch_size=len(demo.sft_heldout),
                          desc=f"Exact match ({'with ' + adapter.name if adapter else 'pt_merged'})")
    if sampled:
        figures["sampled"] = sampled_exact_match(
            model, tokenizer, demo.sft_heldout, EVAL_SAMPLES, grpo_recipe(demo)["temperature"], EVAL_SEED,
            SFT_MAX_NEW_TOKENS, desc=f"Sampled exact match ({adapter.name if adapter else 'pt_merged'})")
        logger.info("sampled exact match: %.3f (%d answers a question)", figures["sampled"]["accuracy"], EVAL_SAMPLES)
    del model
    gc.collect()
    logger.info("exact match: %d / %d correct (%.1f%%)", figures["correct"], figures["total"],
                100 * figures["accuracy"])
    for answer in figures["answers"][:3]:
        logger.info("  %s -> %r (expected %r)", answer["instruction"], answer["generated"], answer["expected"])
    return {"prompt_template_from": str(adapter or demo.path("pt_merged")),
            "prompt_example": render_prompts(tokenizer, demo.sft_heldout[:1])[0],
            **arithmetic_answer_collapse([answer["generated"] for answer in figures["answers"]]), **figures}


def heldout_reward(demo: Demo, *policy: Path) -> Figures:
    """Mean reward-model score of the policy's greedy answers to the held-out review prompts; the
    policy is pt_merged + its adapters, folded in in order."""
    answers = heldout_answers(demo, *policy)
    scores = score_answers(demo, reward_scorer(demo), answers)
    mean = sum(scores) / len(scores)
    logger.info("held-out mean reward with %s: %.3f over %d prompts", "+".join(path.name for path in policy), mean,
                len(scores))
    return {"policy": ",".join(map(str, policy)), "prompts": len(scores), "reward_mean": mean,
            **answer_collapse(answers),
            "answers": [{"prompt": p, "answer": a, "reward": s}
                        for p, a, s in zip(demo.ppo_heldout_prompts, answers, scores, strict=True)]}


def heldout_answers(demo: Demo, *policy: Path) -> list[str]:
    """The policy's greedy answers (pt_merged + its adapters, folded in in order) to the held-out review prompts."""
    model, tokenizer = load_frozen_model(demo.path("pt_merged"), policy)
    prompts = [render_text(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
               for prompt in demo.ppo_heldout_prompts]
    # One batch: 20 answers take 5 s instead of 8 in batches of 16 and 4 (2 CPU cores).
    answers = generate_answers(model, tokenizer, prompts, max_new_tokens=demo.flags["ppo"]["max_answer_seq_len"],
                               batch_size=len(prompts), desc=f"Answers ({policy[-1].name})")
    del model
    gc.collect()
    return answers


def score_answers(demo: Demo, scorer: RewardScorer, answers: list[str]) -> list[float]:
    """A reward model's score of each held-out answer, as PPO scores it: prompt + answer + EOS + the template's turn
    end, read at the last token."""
    import torch

    from lorakit.models.heads import score_sequences

    model, tokenizer, turn_end = scorer
    scores = []
    with torch.inference_mode():
        for prompt, answer in zip(demo.ppo_heldout_prompts, answers, strict=True):
            text = (render_text(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True) + answer
                    + tokenizer.eos_token)
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"] + turn_end])
            scores.append(score_sequences(model, ids, torch.ones_like(ids)).item())
    return scores


def answer_collapse(answers: list[str]) -> Figures:
    """How far greedy answers to different held-out review prompts have collapsed, which a mean reward hides: the
    share of distinct answers, and the share written in the other task's form, the arithmetic one ("The answer is
    N.")."""
    other_task = ANSWER_FORMAT.split("{}")[0]
    return answer_forms(answers, lambda answer: other_task in answer)


def arithmetic_answer_collapse(answers: list[str]) -> Figures:
    """answer_collapse's figures for greedy answers to held-out arithmetic questions (the verdict on GRPO): to them,
    the other task's form is any answer whose first line is not the arithmetic one, "The answer is N."."""
    return answer_forms(answers, lambda answer: not in_arithmetic_form(answer))


def in_arithmetic_form(answer: str) -> bool:
    """The answer's first line is "The answer is N." (is_exact_match reads the same line)."""
    lines = answer.strip().splitlines()
    return bool(lines) and ARITHMETIC_ANSWER.fullmatch(lines[0].strip()) is not None


def answer_forms(answers: list[str], in_other_form: Callable[[str], bool]) -> Figures:
    """The share of distinct answers (stripped) and the share in_other_form says are in the other task's form."""
    stripped = [answer.strip() for answer in answers]
    return {"distinct_answer_share": len(set(stripped)) / len(stripped),
            "other_task_answer_share": sum(in_other_form(answer) for answer in stripped) / len(stripped)}


def reward_scorer(demo: Demo) -> RewardScorer:
    """demo.scorer, loaded at the first held-out scoring: the same reward model scores every policy."""
    if demo.scorer is None:
        demo.scorer = load_reward_scorer(demo, demo.path("reward", "rm_lora_model"))
    return demo.scorer


def load_reward_scorer(demo: Demo, adapter: Path) -> RewardScorer:
    """pt_merged with a reward adapter, frozen, and the turn-end ids PPO appends to an answer before scoring it."""
    from lorakit.data.conversation_tokenizer import ConversationTokenizer

    scorer, tokenizer = load_frozen_model(demo.path("pt_merged"), (adapter,), task="reward")
    answer_length = demo.flags["ppo"]["max_answer_seq_len"]
    turn_end = ConversationTokenizer(tokenizer, tokenizer.chat_template, answer_length).after_turn_end_ids()
    return RewardScorer(scorer, tokenizer, turn_end)
