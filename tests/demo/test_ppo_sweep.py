"""The demo's PPO sweep: its other-task rejected pairs, the collapse figures of held-out answers, which run holds
and which is best, and the table."""

import json

import pytest

from lorakit.demo.ppo_sweep import best_variant, holds, render_table, sweep_variants
from lorakit.demo.review_tasks import with_other_task_rejections
from lorakit.demo.stage_evaluation import answer_collapse

PAIRS = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(9)]


def test_every_fourth_rejected_answer_becomes_the_other_tasks():
    answers = ["The answer is 1.", "The answer is 2.", "The answer is 3.", "unused"]
    mixed = with_other_task_rejections(PAIRS, answers, every=4)
    assert [pair["rejected"] for pair in mixed] == ["The answer is 1.", "bad 1", "bad 2", "bad 3", "The answer is 2.",
                                                    "bad 5", "bad 6", "bad 7", "The answer is 3."]
    assert [pair["chosen"] for pair in mixed] == [pair["chosen"] for pair in PAIRS]
    assert PAIRS[0]["rejected"] == "bad 0"  # the input is not changed
    with pytest.raises(ValueError, match="need 3 answers of the other task, have 2"):
        with_other_task_rejections(PAIRS, answers[:2], every=4)


def test_answer_collapse_counts_distinct_answers_and_the_other_tasks_form():
    collapsed = answer_collapse(["The answer is 1.", " The answer is 1.\n", "“The answer is 1.", "很好的酒店"])
    assert collapsed == {"distinct_answer_share": 0.75, "other_task_answer_share": 0.75}
    assert answer_collapse(["很好", "不错", "一般"]) == {"distinct_answer_share": 1.0, "other_task_answer_share": 0.0}


# The SFT policy's held-out answers, as in the demo: repetitive already (7 distinct of 20, one arithmetic answer).
SFT = {"reward_mean": -2.6, "distinct_answer_share": 0.35, "other_task_answer_share": 0.05}


def run(name, gain, alarms=(), distinct=0.35, other=0.05):
    figures = {"variant": name, "kl_ctl": 0.2, "seed": 42, "minutes": 2.0, "kl_last": 0.05, "published": "last",
               "alarms": {"first": [{"signal": s, "step": 6} for s in alarms], "active": [], "ending": None},
               "reward_mean": -2.6 + gain, "reward_gain": gain, "distinct_answer_share": distinct,
               "other_task_answer_share": other, "answers": ["是，是。"]}
    return {**figures, "holds": holds(figures, SFT)}


def test_a_run_holds_only_without_alarm_or_collapse_against_sft_and_the_best_is_the_largest_gain_that_holds():
    # Collapsed: fewer than half SFT's distinct share (0.175), or a quarter more answers in the other task's form.
    runs = [run("alarmed", 1.7, alarms=["kl"]), run("collapsed", 1.5, distinct=0.15),
            run("other-task", 1.4, other=0.30), run("small", 0.2, distinct=0.2, other=0.25), run("held", 0.6)]
    assert [r["holds"] for r in runs] == [False, False, False, True, True]
    assert best_variant(runs) == "held"
    assert best_variant(runs[:3]) is None
    table = render_table(runs, SFT, best_variant(runs))
    assert "| alarmed | 0.2 | 42 | kl at step 6 | last | -0.900 (+1.700) | 0.35 | 0.05 | 0.050 | 2.0 | no |" in table
    assert table.endswith("Best recipe that held: **held**.\n")
    assert "No recipe held" in render_table(runs[:3], SFT, None)
    unpublished = {**run("nothing", 0.0, alarms=["kl"]), "published": "nothing", "answers": [], "holds": False}
    assert "| nothing | 0.2 | 42 | kl at step 6 | nothing | - | - | - | 0.050 | 2.0 | no |" in render_table(
        [unpublished], SFT, None)


def test_the_sweep_tries_three_kl_coefficients_against_each_reward_model():
    variants = sweep_variants()
    assert [(v.kl_ctl, v.other_task_rejections) for v in variants] == [
        (0.05, False), (0.2, False), (0.5, False), (0.05, True), (0.2, True), (0.5, True)]
    assert [variants[0].name, variants[5].name] == ["kl0.05-sentiment-rm", "kl0.5-other-task-rm"]


def test_the_sweep_before_a_demo_run_is_one_line_naming_what_is_missing(tmp_path):
    from lorakit.core.cli import InputError
    from lorakit.demo.ppo_sweep import demo_after_run

    with pytest.raises(InputError, match=r"pt_merged is missing: run `make demo` \(in full, not QUICK\) first"):
        demo_after_run(tmp_path / "cache", tmp_path / "demo")


def test_the_demos_reward_pairs_reject_one_arithmetic_answer_in_four():
    import re

    from lorakit.demo.plan import OTHER_TASK_EVERY
    from lorakit.demo.stages import other_task_answers

    answers = other_task_answers(480)
    assert OTHER_TASK_EVERY == 4 and len(answers) == 120
    assert all(re.fullmatch(r"The answer is \d+\.", answer) for answer in answers) and len(set(answers)) > 50
    mixed = with_other_task_rejections(PAIRS, other_task_answers(len(PAIRS)), OTHER_TASK_EVERY)
    assert sum(pair["rejected"].startswith("The answer is") for pair in mixed) == 3


def finished_demo(root, quick: bool, rejected: str):
    for needed in ("pt_merged", "sft/sft_lora_model", "reward/rm_lora_model", "rm_data/train"):
        (root / needed).mkdir(parents=True)
    (root / "rm_data/train/pairs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "好", "rejected": rejected}))
    (root / "report.json").write_text(json.dumps({"quick": quick}))
    return root


def test_the_sweep_refuses_a_quick_demo_and_one_from_before_its_recipe(tmp_path):
    from lorakit.core.cli import InputError
    from lorakit.demo.ppo_sweep import demo_after_run

    with pytest.raises(InputError, match=r"report.json: a `make demo QUICK=1` run"):
        demo_after_run(tmp_path / "cache", finished_demo(tmp_path / "quick", True, "The answer is 3."))
    with pytest.raises(InputError, match="no rejected answer from the arithmetic task: a demo run from before"):
        demo_after_run(tmp_path / "cache", finished_demo(tmp_path / "old", False, "差"))
