"""The demo's verdict rule on every preference and RL stage (docs/demo.md, "Verdict rules", written on 2026-12-08
before any run judged under it): a target is met only with no health alarm, no collapse of the greedy held-out
answers and a gain beyond the noise, in every run the verdict rests on; a part that fails makes it "not met", a part
whose figure is missing "unknown", never met. Pure functions on the stages' figure dicts (report.json's).

A stage plugs in with one function that turns its figures into Evidence (its runs, the SFT policy's answers, its
gain and its noise test) and an entry in EVIDENCE; `judge` is the rule, the same for every stage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeGuard

# One stage's figures by name (demo.stages' stage functions return them; report.json holds them).
Figures = dict[str, Any]

# Collapsed whatever the SFT policy did: at most 3 distinct answers of 20, or at least 10 of 20 in the other task's
# form. Shares, so that the same floor judges GRPO's 200 questions; k / n rounds to the same double as the literal,
# so the boundaries (3 and 10 of 20) are exact.
COLLAPSED_DISTINCT_FLOOR, COLLAPSED_OTHER_TASK_FLOOR = 0.15, 0.5
# Collapsed against the SFT policy's answers to the same prompts: fewer than half as many distinct, or a share in the
# other task's form higher by at least 0.25. Kept from 2026-11-27: the demo's SFT policy is itself repetitive (7
# distinct answers of 20 in that run), which the floor alone would not see move.
COLLAPSED_DISTINCT_RATIO, COLLAPSED_OTHER_TASK_RISE = 0.5, 0.25
# The shares are counts / n: a rise of exactly 0.25 (57 against 7 of 200) can come out of float arithmetic a hair short.
SHARE_TOLERANCE = 1e-9
ANSWER_FORMS = ("distinct_answer_share", "other_task_answer_share")


class Check(NamedTuple):
    """One part of a verdict: holds (True), fails (False) or unknown (None: its figure is missing), and what the
    target row says of it ("" where it holds)."""

    holds: bool | None
    text: str = ""


HOLDS = Check(True)


class Run(NamedTuple):
    """One trained policy a verdict rests on: the stage's own run, or its second seed."""

    label: str  # "" for the stage's own run, "seed 7" for a second seed's
    alarms: Figures | None  # demo.stages.health_alarms' dict; None where the run's figures hold none
    answers: Figures | None  # its greedy held-out answers' figures (ANSWER_FORMS); None where it was not scored


class Evidence(NamedTuple):
    """What the rule judges a stage on, the same shape for every stage."""

    target: str  # the target row's text
    monitored: bool  # the stage has health monitors (rl_alarms.json): PPO and GRPO do, DPO does not
    runs: list[Run]
    sft_answers: Figures | None  # the SFT policy's answers to the same prompts (the relative collapse test)
    gain: float | None  # the held-out gain over the SFT policy; None where a figure is missing
    noise: Check  # the gain beyond the stage's own noise measure
    figure: str  # the figures the row shows


class Verdict(NamedTuple):
    met: bool | None  # None: unknown
    figure: str


def judge(evidence: Evidence) -> Verdict:
    """The rule: a part that fails -> not met; else a part unknown -> unknown; else met. The row's figure is
    prefixed with every part that did not hold, the run named where it is a second seed's."""
    gain = evidence.gain if evidence.gain is not None else 0.0
    parts = []
    for run in evidence.runs:
        prefix = f"{run.label}: " if run.label else ""
        for check in (health(run.alarms, evidence.monitored, gain), collapse(run.answers, evidence.sft_answers, gain)):
            parts.append(check._replace(text=prefix + check.text) if check.text else check)
    parts.append(evidence.noise)
    states = [part.holds for part in parts]
    met = False if any(state is False for state in states) else None if None in states else True
    return Verdict(met, "".join(f"{part.text}: " for part in parts if part.text) + evidence.figure)


def health(alarms: Figures | None, monitored: bool, gain: float) -> Check:
    """No health alarm. A stage without monitors (DPO) has nothing to raise one; a monitored run without its
    rl_alarms.json is unknown, never healthy."""
    if not monitored:
        return HOLDS
    if not alarms or not alarms.get("monitored"):
        return Check(None, "**unknown** (missing: rl_alarms.json)")
    if not alarms["first"]:
        return HOLDS
    what = "reward rose, policy collapsed" if gain > 0 else "health alarms raised"
    return Check(False, f"**{what}** ({alarm_names(alarms)})")


def collapse(after: Figures | None, before: Figures | None, gain: float) -> Check:
    """No collapse of the greedy held-out answers: the floor first (it needs no SFT figures), then against the SFT
    policy's; a missing figure the verdict needs is unknown, never "not collapsed"."""
    if not has_answer_forms(after):
        return Check(None, "**unknown** (missing: the distinct-answer figures of the held-out answers)")
    floor = (after["distinct_answer_share"] <= COLLAPSED_DISTINCT_FLOOR
             or after["other_task_answer_share"] >= COLLAPSED_OTHER_TASK_FLOOR)
    if not floor:
        if not has_answer_forms(before):
            return Check(None, "**unknown** (missing: the SFT policy's distinct-answer figures)")
        if not collapsed_against(after, before):
            return HOLDS
    what = "reward rose, policy collapsed" if gain > 0 else "policy collapsed"
    sft = (f"; SFT {before['distinct_answer_share']:.0%} and {before['other_task_answer_share']:.0%}"
           if has_answer_forms(before) else "")
    return Check(False, f"**{what}** (held-out answers: {after['distinct_answer_share']:.0%} distinct, "
                        f"{after['other_task_answer_share']:.0%} in the other task's form{sft})")


def collapsed_against(after: Figures, before: Figures) -> bool:
    """The relative test: the answers collapsed against the SFT policy's (COLLAPSED_DISTINCT_RATIO, ..._RISE)."""
    return (after["distinct_answer_share"] < COLLAPSED_DISTINCT_RATIO * before["distinct_answer_share"]
            or after["other_task_answer_share"] - before["other_task_answer_share"]
            >= COLLAPSED_OTHER_TASK_RISE - SHARE_TOLERANCE)


def has_answer_forms(figures: Figures | None) -> TypeGuard[Figures]:
    return bool(figures and all(figures.get(key) is not None for key in ANSWER_FORMS))


def alarm_names(alarms: Figures) -> str:
    return ", ".join(f"{alarm['signal']} at step {alarm['step']}" for alarm in alarms["first"])


# ----------------------------------------------------------------------------- noise


def beyond_seed_spread(gain: float | None, reward: float | None, second_reward: float | None) -> Check:
    """PPO's and DPO's noise test: the gain above the spread between two seeds' held-out rewards."""
    if gain is None or reward is None:
        return Check(None, "**unknown** (missing: the held-out reward of the policy or of the SFT policy)")
    if second_reward is None:
        return Check(None, "**unknown** (missing: a second seed's held-out reward)")
    return Check(gain > abs(reward - second_reward))


def beyond_interval(interval: list[float] | None) -> Check:
    """GRPO's noise test: the 95% paired-bootstrap interval of the gain above 0."""
    if not interval:
        return Check(None, "**unknown** (missing: the gain's paired-bootstrap interval)")
    return Check(interval[0] > 0)


# ----------------------------------------------------------------------------- the stages' evidence


def reward_mean(figures: Figures | None) -> float | None:
    return (figures or {}).get("reward_mean")


def seeded_evidence(by_stage: dict[str, Figures], stage: str, target: str, monitored: bool) -> Evidence | None:
    """A stage judged on the reward model's mean score of its held-out answers against a second seed's (PPO, DPO):
    its figures are by_stage[stage] (training), ["reward after <stage>"] and ["<stage>, second seed"]."""
    train, after, second = (by_stage.get(name) for name in (stage, f"reward after {stage}", f"{stage}, second seed"))
    if not (train or after):
        return None  # the stage did not run: the report says where the demo stopped
    sft = by_stage.get("reward before PPO")  # PPO and DPO both start from the SFT policy
    reward, sft_reward, second_reward = reward_mean(after), reward_mean(sft), reward_mean(second)
    gain = reward - sft_reward if reward is not None and sft_reward is not None else None
    runs = [Run("", (train or {}).get("alarms"), after)]
    if second:
        runs.append(Run(f"seed {second.get('seed')}", second.get("alarms"), second))
    # A second_reward means second's figures (reward_mean of None is None).
    spread = (f"spread {abs(reward - second_reward):.3f} (seed {second.get('seed')}: {second_reward:.3f})"
              if second and reward is not None and second_reward is not None else "spread -")
    figure = f"gain {gain:+.3f}, {spread}" if gain is not None else f"gain -, {spread}"
    return Evidence(target, monitored, runs, sft, gain, beyond_seed_spread(gain, reward, second_reward), figure)


def ppo_evidence(by_stage: dict[str, Figures]) -> Evidence | None:
    return seeded_evidence(by_stage, "PPO", "PPO held-out reward gain > the spread between two seeds, with no health "
                                            "alarm and no collapse of the held-out answers", monitored=True)


def dpo_evidence(by_stage: dict[str, Figures]) -> Evidence | None:
    evidence = seeded_evidence(by_stage, "DPO", "DPO held-out reward gain over the SFT policy's > the spread between "
                                                "two seeds, with no collapse of the held-out answers (DPO has no "
                                                "health monitors)", monitored=False)
    if not evidence:
        return None
    means = [f"{label} {reward_mean(by_stage.get(name)):.3f}" for label, name in (
        ("DPO", "reward after DPO"), ("SFT", "reward before PPO"), ("PPO", "reward after PPO"))
        if reward_mean(by_stage.get(name)) is not None]
    return evidence._replace(figure=f"{', '.join(means)}: {evidence.figure}" if means else evidence.figure)


def grpo_evidence(by_stage: dict[str, Figures]) -> Evidence | None:
    train, sft, after = (by_stage.get(name) for name in ("GRPO", "exact match after", "exact match after GRPO"))
    if not (train or after):
        return None
    sampled = (after or {}).get("sampled_gain") or {}
    interval = sampled.get("interval")
    figure = (f"{sampled['before']:.3f} -> {sampled['after']:.3f}: gain {100 * sampled['gain']:+.1f} points, "
              f"interval [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]" if interval else "-")
    return Evidence("GRPO held-out exact match (sampled) above SFT's, beyond the 95% paired-bootstrap interval, with "
                    "no health alarm and no collapse of the greedy answers", True,
                    [Run("", (train or {}).get("alarms"), after)], sft, sampled.get("gain"), beyond_interval(interval),
                    figure)


# Every preference and RL stage's target row, in the report's order; a new stage (KTO) adds its function here.
EVIDENCE: tuple[Callable[[dict[str, Figures]], Evidence | None], ...] = (ppo_evidence, dpo_evidence, grpo_evidence)


class TargetRow(NamedTuple):
    target: str
    figure: str
    met: bool | None  # None: unknown


def rl_targets(by_stage: dict[str, Figures]) -> list[TargetRow]:
    """The target row of every preference and RL stage that ran, each judged by the one rule."""
    rows = []
    for evidence in (build(by_stage) for build in EVIDENCE):
        if evidence:
            verdict = judge(evidence)
            rows.append(TargetRow(evidence.target, verdict.figure, verdict.met))
    return rows
