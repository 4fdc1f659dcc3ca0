"""The demo report's verdicts on the preference and RL stages (docs/demo.md, "Verdict rules", 2026-12-08): one rule,
lorakit.demo.verdicts.judge, for PPO, DPO and GRPO. Met only with no health alarm, no collapse of the held-out answers
(the floor: at most 3 distinct of 20 or at least 10 of 20 in the other task's form, whatever the SFT policy did; or
against the SFT policy's) and a gain beyond the noise; a failing part makes it "not met", a missing figure
"unknown"."""

import copy

import pytest

from lorakit.demo.report import alarm_lines, render_targets
from lorakit.demo.stage_evaluation import answer_collapse, arithmetic_answer_collapse
from lorakit.demo.verdicts import collapse

KL_ALARM = {"signal": "kl", "step": 12, "iteration": 6, "value": 6.7, "threshold": 1.2, "direction": "above",
            "baseline": 0.05}
NO_ALARM = {"monitored": True, "first": [], "active": [], "ending": None}


def shares(distinct: int, other: int, of: int = 20) -> dict:
    """The collapse figures of `of` answers, as stage_evaluation.answer_collapse computes them (a count / of)."""
    return {"distinct_answer_share": distinct / of, "other_task_answer_share": other / of}


def alarmed(*alarms: dict) -> dict:
    return {"monitored": True, "first": list(alarms), "active": [a["signal"] for a in alarms], "ending": None}


def healthy() -> dict:
    """Every RL stage's figures, complete: each gain beyond its noise, no alarm, no collapse."""
    return {
        "reward before PPO": {"reward_mean": -0.822, **shares(7, 5)},  # the run of 2026-11-27's SFT policy
        "PPO": {"alarms": copy.deepcopy(NO_ALARM)},
        "reward after PPO": {"reward_mean": 0.678, **shares(8, 0)},
        "PPO, second seed": {"seed": 7, "reward_mean": 0.5, "alarms": copy.deepcopy(NO_ALARM), **shares(7, 1)},
        "DPO": {"steps": 20},  # no health monitors: no alarms figure
        "reward after DPO": {"reward_mean": 0.674, **shares(8, 1)},
        "DPO, second seed": {"seed": 7, "reward_mean": 0.6, **shares(9, 1)},
        "exact match after": {"correct": 67, "total": 200, "accuracy": 0.335, **shares(150, 4, of=200)},
        "GRPO": {"alarms": copy.deepcopy(NO_ALARM)},
        "exact match after GRPO": {"correct": 94, "total": 200, "accuracy": 0.47, **shares(160, 2, of=200),
                                   "sampled_gain": {"before": 0.259, "after": 0.410, "gain": 0.151,
                                                    "interval": [0.105, 0.198]}},
    }


def targets(by_stage: dict) -> dict[str, tuple[str, str]]:
    """The targets table: the row's first word -> (figure, met)."""
    lines = render_targets(by_stage, quick=False)
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[4:] if line.startswith("|")]
    return {row[0].split(" ")[0]: (row[1], row[2]) for row in rows}


# The figures each stage's verdict reads its own run's collapse from, and its SFT baseline.
ANSWERS = {"PPO": "reward after PPO", "DPO": "reward after DPO", "GRPO": "exact match after GRPO"}
SFT_ANSWERS = {"PPO": "reward before PPO", "DPO": "reward before PPO", "GRPO": "exact match after"}


def with_answers(stage: str, after: dict, sft: dict) -> dict:
    """healthy() with the collapse figures of the stage's held-out answers and of the SFT policy's replaced (shares:
    the same for GRPO's 200 questions)."""
    figures = healthy()
    figures[ANSWERS[stage]].update(after)
    figures[SFT_ANSWERS[stage]].update(sft)
    return figures


def test_healthy_gains_beyond_the_noise_are_met_and_the_rows_give_the_figures():
    rows = targets(healthy())
    assert rows["PPO"] == ("gain +1.500, spread 0.178 (seed 7: 0.500)", "yes")
    assert rows["DPO"] == ("DPO 0.674, SFT -0.822, PPO 0.678: gain +1.496, spread 0.074 (seed 7: 0.600)", "yes")
    assert rows["GRPO"] == ("0.259 -> 0.410: gain +15.1 points, interval [+10.5, +19.8]", "yes")


# ----------------------------------------------------------------------------- collapse, for every stage


@pytest.mark.parametrize("stage", ["PPO", "DPO", "GRPO"])
def test_three_distinct_answers_of_twenty_are_collapsed_whatever_the_sft_policy_did(stage):
    # The SFT policy as repetitive: the relative test alone would pass this (0.15 is not below half of 0.15).
    figures = with_answers(stage, shares(3, 0), sft=shares(3, 0))
    figure, met = targets(figures)[stage]
    assert met == "**not met**"
    assert figure.startswith("**reward rose, policy collapsed** (held-out answers: 15% distinct, 0% in the other "
                             "task's form; SFT 15% and 0%): ")


@pytest.mark.parametrize("stage", ["PPO", "DPO", "GRPO"])
def test_half_the_answers_in_the_other_tasks_form_are_collapsed_whatever_the_sft_policy_did(stage):
    figures = with_answers(stage, shares(8, 10), sft=shares(8, 9))  # a rise of 0.05: the relative test passes it
    figure, met = targets(figures)[stage]
    assert met == "**not met**" and "(held-out answers: 40% distinct, 50% in the other task's form; SFT 40% and 45%)" \
        in figure


@pytest.mark.parametrize("stage", ["PPO", "DPO", "GRPO"])
def test_answers_collapsed_against_the_sft_policys_are_collapsed(stage):
    figures = with_answers(stage, shares(4, 0), sft=shares(9, 0))  # above the floor, fewer than half SFT's 9
    assert targets(figures)[stage][1] == "**not met**"
    figures = with_answers(stage, shares(8, 6), sft=shares(8, 1))  # 0.30 in the other form, SFT's 0.05 + 0.25
    assert targets(figures)[stage][1] == "**not met**"
    figures = with_answers(stage, shares(5, 5), sft=shares(9, 1))  # 5 of 9 distinct, a rise of 0.20: holds
    assert targets(figures)[stage][1] == "yes"


@pytest.mark.parametrize("stage", ["PPO", "DPO"])
def test_a_collapsed_second_seed_is_not_met(stage):
    figures = healthy()
    figures[f"{stage}, second seed"].update(shares(2, 0))
    figure, met = targets(figures)[stage]
    assert met == "**not met**" and figure.startswith("seed 7: **reward rose, policy collapsed** (held-out answers: "
                                                      "10% distinct")


def test_the_floors_boundaries():
    sft = shares(4, 9)
    assert collapse(shares(4, 0), sft, gain=1.0).holds is True  # 4 distinct of 20: not collapsed by the floor
    assert collapse(shares(3, 0), sft, gain=1.0).holds is False
    assert collapse(shares(20, 9), sft, gain=1.0).holds is True  # 9 of 20 in the other form: not collapsed
    assert collapse(shares(20, 10), sft, gain=1.0).holds is False
    assert collapse(shares(30, 0, of=200), shares(30, 0, of=200), gain=1.0).holds is False  # 15% of GRPO's 200
    assert collapse(shares(31, 99, of=200), shares(31, 99, of=200), gain=1.0).holds is True
    # The relative test at its boundary, where float arithmetic puts 57 / 200 - 7 / 200 a hair below 0.25.
    assert collapse(shares(100, 57, of=200), shares(100, 7, of=200), gain=1.0).holds is False
    assert collapse(shares(100, 56, of=200), shares(100, 7, of=200), gain=1.0).holds is True
    assert collapse(shares(100, 0, of=200), shares(201, 0, of=200), gain=1.0).holds is False  # fewer than half
    assert collapse(shares(100, 0, of=200), shares(200, 0, of=200), gain=1.0).holds is True


# ----------------------------------------------------------------------------- health alarms


@pytest.mark.parametrize("stage", ["PPO", "GRPO"])
def test_a_gain_with_a_health_alarm_is_not_met(stage):
    figures = healthy()
    figures[stage]["alarms"] = alarmed(KL_ALARM)
    figure, met = targets(figures)[stage]
    assert met == "**not met**" and figure.startswith("**reward rose, policy collapsed** (kl at step 12): ")


def test_an_alarm_of_the_second_seed_is_not_met_and_a_fall_with_an_alarm_says_so():
    figures = healthy()
    figures["PPO, second seed"]["alarms"] = alarmed(KL_ALARM)
    assert targets(figures)["PPO"] == ("seed 7: **reward rose, policy collapsed** (kl at step 12): gain +1.500, "
                                       "spread 0.178 (seed 7: 0.500)", "**not met**")
    figures = healthy()
    figures["PPO"]["alarms"] = alarmed(KL_ALARM)
    figures["reward after PPO"]["reward_mean"] = -1.0
    assert targets(figures)["PPO"][0].startswith("**health alarms raised** (kl at step 12): gain -0.178")


def test_dpo_has_no_health_monitors_and_its_row_says_so():
    figures = healthy()
    del figures["DPO"]
    target_line = next(line for line in render_targets(figures, quick=False) if line.startswith("| DPO"))
    assert "(DPO has no health monitors)" in target_line and target_line.endswith("| yes |")


# ----------------------------------------------------------------------------- missing figures


@pytest.mark.parametrize("stage", ["PPO", "DPO"])
def test_a_missing_second_seed_is_unknown_and_named(stage):
    figures = healthy()
    del figures[f"{stage}, second seed"]
    figure, met = targets(figures)[stage]
    assert met == "**unknown**"
    assert figure.startswith("**unknown** (missing: a second seed's held-out reward): ") and "spread -" in figure


@pytest.mark.parametrize("stage", ["PPO", "GRPO"])
def test_a_missing_alarm_file_is_unknown_never_healthy(stage):
    figures = healthy()
    figures[stage]["alarms"] = {"monitored": False, "first": [], "active": [], "ending": None}  # no rl_alarms.json
    healthy_figure = targets(healthy())[stage][0]
    assert targets(figures)[stage] == (f"**unknown** (missing: rl_alarms.json): {healthy_figure}", "**unknown**")
    del figures[stage]["alarms"]  # an older run's figures, without the key
    assert targets(figures)[stage][1] == "**unknown**"


def test_a_missing_alarm_file_of_the_second_seed_is_unknown():
    figures = healthy()
    del figures["PPO, second seed"]["alarms"]
    assert targets(figures)["PPO"][0].startswith("seed 7: **unknown** (missing: rl_alarms.json): ")
    assert targets(figures)["PPO"][1] == "**unknown**"


@pytest.mark.parametrize("stage", ["PPO", "DPO", "GRPO"])
def test_missing_distinct_answer_figures_are_unknown_never_not_collapsed(stage):
    figures = healthy()
    del figures[ANSWERS[stage]]["distinct_answer_share"]
    figure, met = targets(figures)[stage]
    assert met == "**unknown**"
    assert figure.startswith("**unknown** (missing: the distinct-answer figures of the held-out answers): ")


@pytest.mark.parametrize("stage", ["PPO", "DPO", "GRPO"])
def test_missing_sft_figures_are_unknown_unless_the_floor_decides(stage):
    figures = healthy()
    for key in ("distinct_answer_share", "other_task_answer_share"):
        del figures[SFT_ANSWERS[stage]][key]
    figure, met = targets(figures)[stage]
    assert met == "**unknown**" and figure.startswith("**unknown** (missing: the SFT policy's distinct-answer figures)")
    figures[ANSWERS[stage]].update(shares(2, 0))  # the floor needs no SFT figures
    assert targets(figures)[stage][1] == "**not met**"


def test_grpo_without_its_interval_is_unknown():
    figures = healthy()
    del figures["exact match after GRPO"]["sampled_gain"]
    assert targets(figures)["GRPO"] == ("**unknown** (missing: the gain's paired-bootstrap interval): -", "**unknown**")


def test_a_failing_part_outranks_a_missing_one():
    figures = healthy()
    del figures["PPO, second seed"]
    figures["PPO"]["alarms"] = alarmed(KL_ALARM)
    assert targets(figures)["PPO"][1] == "**not met**"


def test_a_gain_within_the_noise_is_not_met():
    figures = healthy()
    figures["PPO, second seed"]["reward_mean"] = -1.271  # the run of 2026-11-27: gain +1.500 < spread 1.949
    assert targets(figures)["PPO"] == ("gain +1.500, spread 1.949 (seed 7: -1.271)", "**not met**")
    figures = healthy()
    figures["exact match after GRPO"]["sampled_gain"]["interval"] = [-0.01, 0.2]
    assert targets(figures)["GRPO"][1] == "**not met**"


# ----------------------------------------------------------------------------- the collapse figures


def test_the_collapse_figures_of_review_and_arithmetic_answers():
    one_answer = ["The answer is 1."] * 17 + ["很好", "不错", "一般"]  # 4 distinct of 20, 17 in the arithmetic form
    assert answer_collapse(one_answer) == shares(4, 17)
    assert collapse(answer_collapse(one_answer), shares(7, 5), gain=1.0).holds is False
    arithmetic = ["The answer is 42.", " The answer is -7.\n(more)", "The answer is 42", "很好的酒店", ""]
    assert arithmetic_answer_collapse(arithmetic) == {"distinct_answer_share": 1.0, "other_task_answer_share": 0.6}


# ----------------------------------------------------------------------------- the alarm lines


def test_the_alarm_lines_name_the_alarm_and_the_checkpoint_published_instead():
    assert alarm_lines("PPO", {"alarms": alarmed(KL_ALARM)})[0] == (
        "**Health alarms (PPO, rl_alarms.json):** kl 6.7 above its threshold 1.2 at step 12. Still active at the end: "
        "kl.")
    assert alarm_lines("PPO", {"alarms": NO_ALARM})[0] == "Health alarms (PPO, rl_alarms.json): none raised."
    alarms = {"monitored": True, "first": [KL_ALARM], "active": [],
              "ending": {"published_from": "checkpoint-4/ppo_lora_model"}}
    assert alarm_lines("PPO", {"alarms": alarms})[0].endswith("at step 12. Published: checkpoint-4/ppo_lora_model.")


def test_an_older_runs_alarm_file_and_reward_figures_still_render():
    from lorakit.demo.report import render_reward

    alarms = {"monitored": True, "first": [KL_ALARM], "active": [], "ending": {"published": "checkpoint-2/x"}}
    assert alarm_lines("PPO", {"alarms": alarms})[0].endswith("Published: checkpoint-2/x.")
    rm = {"sample_pair": {"prompt": "p", "chosen": "c", "rejected": "r"}, "clear_sentiment": 0.8, "steps": 60,
          "batch_size": 8, "train_pairs": 480, "learning_rate": 2e-3, "loss_first": 0.7, "loss_first_step": 5,
          "loss_last": 0.4, "loss_last_step": 60, "logging_steps": 5, "eval_samples": 100, "eval_accuracy": 0.8,
          "eval_chosen_score": 1.0, "eval_rejected_score": -1.0}
    text = "\n".join(render_reward({"reward model": rm}))
    assert "arithmetic task" not in text and "accuracy 0.800" in text
    assert "In 120 of the training pairs the rejected answer is the arithmetic task's" in "\n".join(
        render_reward({"reward model": {**rm, "other_task_rejected": 120}}))
