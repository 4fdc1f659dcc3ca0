"""The demo's PPO sweep: its other-task rejected pairs, the collapse figures of held-out answers, which run holds
and which is best, and the table."""

import pytest

from lorakit.demo.ppo_sweep import best_variant, holds, render_table, sweep_variants
from lorakit.demo.review_tasks import with_other_task_rejections
from lorakit.demo.run_demo import answer_collapse

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
    collapsed = answer_collapse(["The answer is 1.", " The answer is 1.\n", "The answer is 1.", "很好的酒店"])
    assert collapsed == {"distinct_answer_share": 0.5, "other_task_answer_share": 0.75}
    assert answer_collapse(["很好", "不错", "一般"]) == {"distinct_answer_share": 1.0, "other_task_answer_share": 0.0}


def run(name, gain, alarms=(), distinct=1.0, other=0.0):
    figures = {"variant": name, "kl_ctl": 0.2, "seed": 42, "minutes": 2.0, "kl_last": 0.05, "published": None,
               "alarms": {"first": [{"signal": s, "step": 6} for s in alarms], "active": [], "ending": None},
               "reward_mean": -2.6 + gain, "reward_gain": gain, "distinct_answer_share": distinct,
               "other_task_answer_share": other}
    return {**figures, "holds": holds(figures)}


def test_a_run_holds_only_without_alarm_or_collapse_and_the_best_is_the_largest_gain_that_holds():
    runs = [run("alarmed", 1.7, alarms=["kl"]), run("collapsed", 1.5, distinct=0.4),
            run("other-task", 1.4, other=0.05), run("small", 0.2), run("held", 0.6)]
    assert [r["holds"] for r in runs] == [False, False, False, True, True]
    assert best_variant(runs) == "held"
    assert best_variant(runs[:3]) is None
    table = render_table(runs, {"reward_mean": -2.6, "distinct_answer_share": 1.0, "other_task_answer_share": 0.0},
                         best_variant(runs))
    assert "| alarmed | 0.2 | 42 | kl at step 6 | last | -0.900 (+1.700) | 1.00 | 0.00 | 0.050 | 2.0 | no |" in table
    assert table.endswith("Best recipe that held: **held**.\n")
    assert "No recipe held" in render_table(runs[:3], {"reward_mean": -2.6, "distinct_answer_share": 1.0,
                                                       "other_task_answer_share": 0.0}, None)


def test_the_sweep_tries_three_kl_coefficients_and_the_other_task_reward_model():
    variants = sweep_variants()
    assert [v.kl_ctl for v in variants if not v.other_task_rejections] == [0.05, 0.2, 0.5]
    assert [v.name for v in variants if v.other_task_rejections] == ["kl0.05-other-task-rm"]
