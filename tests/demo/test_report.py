"""The demo report's verdicts on RL stages: a reward gain that comes with a health alarm is reported as "reward rose,
policy collapsed", never as a met target; the same gain with no alarm is met."""

from lorakit.demo.report import alarm_lines, render_targets

KL_ALARM = {"signal": "kl", "step": 12, "iteration": 6, "value": 6.7, "threshold": 1.2, "direction": "above",
            "baseline": 0.05}


def ppo_figures(alarms: list) -> dict:
    ppo = {"alarms": {"monitored": True, "first": alarms, "active": [a["signal"] for a in alarms], "ending": None}}
    return {"reward before PPO": {"reward_mean": -2.614}, "reward after PPO": {"reward_mean": -0.879},
            "PPO, second seed": {"reward_mean": -0.95, "seed": 7}, "PPO": ppo}


def target_row(by_stage: dict) -> str:
    return next(line for line in render_targets(by_stage, quick=False) if line.startswith("| PPO"))


def test_a_reward_gain_with_an_alarm_is_a_collapse_not_a_met_target():
    row = target_row(ppo_figures([KL_ALARM]))
    assert "**reward rose, policy collapsed** (kl at step 12): gain +1.735" in row and row.endswith("| **not met** |")
    lines = alarm_lines("PPO", ppo_figures([KL_ALARM])["PPO"])
    assert lines[0] == ("**Health alarms (PPO, rl_alarms.json):** kl 6.7 above its threshold 1.2 at step 12. Still "
                        "active at the end: kl.")


def test_the_same_gain_with_no_alarm_is_met():
    row = target_row(ppo_figures([]))
    assert "collapsed" not in row and row.endswith("| yes |")
    assert alarm_lines("PPO", ppo_figures([])["PPO"])[0] == "Health alarms (PPO, rl_alarms.json): none raised."


def test_collapsed_heldout_answers_are_a_collapse_even_without_an_alarm():
    figures = ppo_figures([])
    figures["reward before PPO"].update(distinct_answer_share=0.35, other_task_answer_share=0.05)
    figures["reward after PPO"].update(distinct_answer_share=0.05, other_task_answer_share=1.0)
    row = target_row(figures)
    assert ("**reward rose, policy collapsed** (held-out answers: 5% distinct, 100% in the arithmetic task's form; "
            "before 35% and 5%): gain +1.735") in row and row.endswith("| **not met** |")
    figures["reward after PPO"].update(distinct_answer_share=0.2, other_task_answer_share=0.25)  # within both rules
    assert target_row(figures).endswith("| yes |")
    figures["reward after PPO"].update(other_task_answer_share=0.3)
    assert target_row(figures).endswith("| **not met** |")


def test_the_alarm_lines_name_the_checkpoint_published_instead():
    alarms = {"monitored": True, "first": [KL_ALARM], "active": [],
              "ending": {"published_from": "checkpoint-4/ppo_lora_model"}}
    assert alarm_lines("PPO", {"alarms": alarms})[0].endswith("at step 12. Published: checkpoint-4/ppo_lora_model.")


def test_the_second_seed_is_held_to_the_same_alarms_and_collapse():
    figures = ppo_figures([])
    figures["PPO, second seed"]["alarms"] = {"monitored": True, "first": [KL_ALARM], "active": [], "ending": None}
    row = target_row(figures)
    assert "seed 7: **reward rose, policy collapsed** (kl at step 12)" in row and row.endswith("| **not met** |")


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
