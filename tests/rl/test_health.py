"""RL health monitors (rl.health, rl.alarms): each alarm fires on a trajectory built to trip it and stays quiet on
a healthy, noisy one; the thresholds are relative to the run's own first iterations; the figures they judge equal
hand-computed numbers; a real tiny GRPO run whose answers collapse to stubs stops with exit status 4 under
--stop_on_alarm and leaves the last alarm-free checkpoint's adapter as its result; the pipeline does not resume a
stage stopped by an alarm unless told with --from_stage."""

import json
import os
import random
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.commands import TRAINING, assert_ok, check_refused, options_to_argv, run_in_process
from helpers.corpora import CHINESE, ENGLISH
from helpers.pipeline_runs import PIPELINE, actions, run_pipeline, write_config
from helpers.run_outputs import adapter_weights, log_history
from lorakit.core.cli import InputError
from lorakit.rl.alarms import ALARM_FILE, HEALTH_STATE_NAME, HealthPlan, write_alarm_file
from lorakit.rl.health import (
    BASELINE_ITERATIONS,
    AnswerLimit,
    HealthMonitor,
    PairMoments,
    answer_diversity,
    distinct_ngrams,
    moment_sums,
    read_sft_answers,
)

GRPO_SCRIPT = os.path.join(TRAINING, "run_grpo.py")
PPO_SIGNALS = ["kl", "kl_acceleration", "entropy", "response_length", "truncated_share", "reward_length_corr",
               "explained_variance", "sampler_gap", "distinct_2", "top_answer_share", "sft_copy_share"]
ALL_SIGNALS = PPO_SIGNALS + ["reward_share/correct", "reward_share/format"]


def run_monitor(trajectory, signals=ALL_SIGNALS, answer_limit=None) -> HealthMonitor:
    """A monitor fed one figures dict per iteration (step = iteration + 1)."""
    monitor = HealthMonitor(signals, answer_limit)
    for iteration, figures in enumerate(trajectory):
        monitor.observe(iteration + 1, iteration, figures)
    return monitor


def healthy_figures(rng: random.Random, iteration: int) -> dict:
    """One iteration of a run that learns without collapsing, with the noise real runs show: the KL to the
    reference climbs from ~0 to ~0.12 nats/token over 200 iterations with +-10% noise, the entropy falls by a
    quarter, the length wanders +-20% and grows 30%, a few answers are cut, the reward and the length correlate
    weakly, the critic improves from 0.1 to 0.6 explained variance, the sampler gap is fp32-small, the answers stay
    varied, and the two reward components trade places without either taking over."""
    progress = iteration / 200
    noise = lambda scale: rng.gauss(0.0, scale)  # noqa: E731
    return {
        "kl": max(0.0, 0.12 * progress * (1 + noise(0.1)) + abs(noise(0.003))),
        "entropy": 2.0 * (1 - 0.25 * progress) * (1 + noise(0.05)),
        "response_length": 120 * (1 + 0.3 * progress) * (1 + noise(0.12)),
        "truncated_share": min(1.0, max(0.0, 0.05 + 0.05 * progress + noise(0.03))),
        "reward_length_corr": max(-1.0, min(1.0, 0.1 + 0.2 * progress + noise(0.12))),
        "explained_variance": 0.1 + 0.5 * progress + noise(0.1),
        "sampler_gap": abs(1e-4 + noise(3e-5)),
        "distinct_2": 0.8 * (1 - 0.15 * progress) * (1 + noise(0.04)),
        "top_answer_share": rng.choice([1, 1, 1, 2, 2, 3]) / 64,
        "sft_copy_share": min(1.0, max(0.0, 0.02 + 0.04 * progress + noise(0.02))),
        "reward_share/correct": (share := min(0.75, max(0.25, 0.4 + 0.25 * progress + noise(0.05)))),
        "reward_share/format": 1 - share,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_healthy_noisy_run_raises_no_alarm(seed):
    """Three seeds of 200 noisy, healthy iterations: every signal is judged from iteration 3 on, none alarms."""
    rng = random.Random(seed)
    monitor = run_monitor([healthy_figures(rng, iteration) for iteration in range(200)])
    assert set(monitor.baselines()) == set(ALL_SIGNALS)
    assert monitor.alarms == [], [alarm.message() for alarm in monitor.alarms]


def steady(**figures) -> list:
    """The baseline iterations of a run: the same figures BASELINE_ITERATIONS times."""
    return [dict(figures)] * BASELINE_ITERATIONS


# signal: (the baseline iterations, the iteration that trips it, its expected threshold and direction)
TRIPS = {
    "kl": (steady(kl=0.01), {"kl": 0.51}, 0.5, "above"),
    "entropy": (steady(entropy=2.0), {"entropy": 0.59}, 0.6, "below"),
    "response_length": (steady(response_length=100.0), {"response_length": 49.0}, 50.0, "below"),
    "truncated_share": (steady(truncated_share=0.1), {"truncated_share": 0.55}, 0.5, "above"),
    "reward_length_corr": (steady(reward_length_corr=0.2), {"reward_length_corr": 0.85}, 0.8, "above"),
    "sampler_gap": (steady(sampler_gap=1e-4), {"sampler_gap": 0.02}, 0.01, "above"),
    "distinct_2": (steady(distinct_2=0.8), {"distinct_2": 0.35}, 0.4, "below"),
    "top_answer_share": (steady(top_answer_share=0.05), {"top_answer_share": 0.6}, 0.5, "above"),
    "sft_copy_share": (steady(sft_copy_share=0.0), {"sft_copy_share": 0.75}, 0.5, "above"),
    "reward_share/format": (steady(**{"reward_share/format": 0.5}), {"reward_share/format": 0.95}, 0.9, "above"),
}


# A KL that reaches its 0.5 floor within one iteration of a baseline of 0.01 has steepened too: its acceleration,
# judged from its first value on, alarms with it (on the value short of the KL's threshold as well).
ALSO_TRIPPED = {"kl": {"kl_acceleration"}}


@pytest.mark.parametrize("signal", sorted(TRIPS))
def test_each_alarm_fires_on_a_trajectory_that_should_trip_it(signal):
    """The baseline iterations are never judged; the tripping iteration alarms on that signal (and no other signal
    but the KL's acceleration, for a KL jump), naming its value, threshold and step; the same value short of the
    threshold does not."""
    baseline, trip, threshold, direction = TRIPS[signal]
    monitor = run_monitor(baseline + [trip])
    also = ALSO_TRIPPED.get(signal, set())
    assert {a.signal for a in monitor.alarms} == {signal} | also
    (alarm,) = [a for a in monitor.alarms if a.signal == signal]
    assert (alarm.signal, alarm.step, alarm.iteration, alarm.direction) == (signal, 4, 3, direction)
    assert alarm.value == trip[signal] and alarm.threshold == pytest.approx(threshold)
    assert monitor.active == monitor.alarms and alarm in monitor.active
    expected = f"at step 4 (iteration 3): {signal} = {trip[signal]:.4g}, {direction} its threshold {threshold:.4g}"
    assert expected in alarm.message()
    short_of_it = {signal: threshold - 0.001 if direction == "above" else threshold + 0.001}
    assert {a.signal for a in run_monitor(baseline + [short_of_it]).alarms} == also


def jump_at(signal: str, step: int) -> list:
    """A trajectory whose jump in signal lands at step (its last iteration): TRIPS' tripping figures after their
    baseline's; the KL climbing 0.01 per iteration, then 0.2 more in one (kl_acceleration); the critic's explained
    variance from 0.6 to -0.1 at two iterations in a row (its persistence)."""
    if signal == "kl_acceleration":
        return [{"kl": 0.01 * i} for i in range(1, step)] + [{"kl": 0.01 * (step - 1) + 0.2}]
    if signal == "explained_variance":
        return [{signal: 0.6}] * (step - 2) + [{signal: -0.1}] * 2
    baseline, trip, _, _ = TRIPS[signal]
    return baseline[:1] * (step - 1) + [trip]


# The earliest step at which each signal can alarm (docs/ppo.md#health-alarms): the first iteration after its own
# 3-iteration baseline; kl_acceleration its first value, once the KL's baseline is known (the 3rd; the 6th before
# it spent three values of its own on a baseline its rule does not use); explained_variance 2 judged in a row.
EARLIEST = {signal: BASELINE_ITERATIONS + 1 for signal in TRIPS} | {"kl_acceleration": 3, "explained_variance": 5}


@pytest.mark.parametrize("signal", sorted(EARLIEST))
def test_each_signal_alarms_at_the_earliest_iteration_its_rule_allows_and_not_one_before(signal):
    """The jump at the earliest step alarms there; one step earlier it lands in the baseline (kl_acceleration: at an
    iteration with two KL values, so no acceleration yet; explained_variance: its first value past the bound in
    the baseline) and raises nothing on that signal, then or after."""
    earliest = EARLIEST[signal]
    alarms = [(a.signal, a.step) for a in run_monitor(jump_at(signal, earliest)).alarms if a.signal == signal]
    assert alarms == [(signal, earliest)]
    before = run_monitor(jump_at(signal, earliest - 1))
    assert [a for a in before.alarms if a.signal == signal] == []
    if signal == "kl_acceleration":
        assert earliest < 6 and "kl_acceleration" not in before.latest


def test_explained_variance_alarms_only_when_it_persists():
    """docs/ppo.md's persistence rule: past its bound (min(2 x 0.6 - 1, 0) = 0) at 2 judged iterations in a row,
    the alarm at the second, iteration 5 at the earliest; one iteration past it (the earliest judged, and any
    later one), and the healthy run's swings (-32.4 at step 4, -8.7 at step 6), raise nothing."""
    baseline = steady(explained_variance=0.6)
    (alarm,) = run_monitor(baseline + [{"explained_variance": -0.1}] * 2).alarms
    assert (alarm.signal, alarm.step, alarm.iteration, alarm.threshold) == ("explained_variance", 5, 4, 0.0)
    assert run_monitor(baseline + [{"explained_variance": -0.1}]).alarms == []
    assert run_monitor(baseline + [{"explained_variance": -0.1}, {"explained_variance": 0.5}] * 3).alarms == []
    assert run_monitor(baseline + [{"explained_variance": -0.1}, {"explained_variance": 0.001}]).alarms == []
    healthy = [{"explained_variance": value} for value in (0.3, 0.5, 0.4, -32.4, 0.2, -8.7, 0.4, 0.5, 0.6)]
    assert run_monitor(healthy).alarms == []


def test_a_streak_travels_in_the_checkpoint_and_an_older_one_starts_it_afresh():
    """Resumed between the two iterations past the bound, the run alarms where the uninterrupted one does; a
    checkpoint's state from before the rule (no streaks) loads, its streak counted from the resume."""
    first = run_monitor(steady(explained_variance=0.6) + [{"explained_variance": -0.1}])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = HealthMonitor(ALL_SIGNALS)
    resumed.load_state_dict(state)
    assert [alarm.step for alarm in resumed.observe(5, 4, {"explained_variance": -0.1})] == [5]
    older = HealthMonitor(ALL_SIGNALS)
    older.load_state_dict({name: value for name, value in state.items() if name != "streaks"})
    assert older.observe(5, 4, {"explained_variance": -0.1}) == []
    assert [alarm.step for alarm in older.observe(6, 5, {"explained_variance": -0.1})] == [6]


def test_response_length_alarms_both_ways_and_an_alarm_clears_when_the_signal_returns():
    monitor = run_monitor(steady(response_length=100.0) + [{"response_length": 201.0}, {"response_length": 150.0},
                                                             {"response_length": 49.0}])
    assert [(a.signal, a.direction, a.threshold, a.step) for a in monitor.alarms] == [
        ("response_length", "above", 200.0, 4), ("response_length", "below", 50.0, 6)]
    monitor.observe(7, 6, {"response_length": 90.0})
    assert monitor.active == [] and len(monitor.alarms) == 2


def test_the_kl_threshold_is_relative_to_the_run_own_baseline():
    """The same KL of 1.0 nat per token: a run that started at 0.01 (threshold: the 0.5 floor) alarms, and so does
    its acceleration (0.99 in one iteration, past its 0.15 floor); a run that started at 0.4 (thresholds 5 x 0.4 =
    2.0, and 2 x 0.4 = 0.8 for the acceleration of 0.6) does not; the entropy likewise against its own start."""
    low, high = run_monitor(steady(kl=0.01) + [{"kl": 1.0}]), run_monitor(steady(kl=0.4) + [{"kl": 1.0}])
    assert [(a.signal, a.threshold) for a in low.alarms] == [("kl", 0.5), ("kl_acceleration", 0.15)]
    assert high.alarms == [] and high.baselines()["kl"] == pytest.approx(0.4)
    assert run_monitor(steady(kl=0.4) + [{"kl": 2.01}]).alarms[0].threshold == pytest.approx(2.0)
    fell = run_monitor(steady(entropy=3.0) + [{"entropy": 0.8}])
    assert [(a.signal, a.threshold) for a in fell.alarms] == [("entropy", pytest.approx(0.9))]
    assert run_monitor(steady(entropy=1.0) + [{"entropy": 0.8}]).alarms == []


def test_shares_that_were_high_from_the_start_are_not_judged_and_named_so():
    """A batch cut by a short limit from the first iteration (truncated share 0.8) or of few prompts (top answer
    share 0.25) is the run's design: a share of 1.0 later raises nothing. Each share past its baseline's limit is
    named not judged, with its baseline; one under it is judged (absent)."""
    high = {"truncated_share": 0.8, "top_answer_share": 0.25, "sft_copy_share": 0.3, "reward_length_corr": 0.5,
            "reward_share/format": 0.75, "reward_share/correct": 0.25}
    started_high = set(high) - {"reward_share/correct"}
    monitor = run_monitor(steady(**high) + [dict.fromkeys(started_high, 1.0)])
    assert monitor.alarms == []
    not_judged = monitor.not_judged()
    assert set(not_judged) == started_high
    assert not_judged["truncated_share"].startswith("its baseline 0.8 is not under 0.2: a share that high from the "
                                                    "start is the run's design")
    assert not_judged["reward_length_corr"].startswith("its baseline 0.5 is not under 0.4")
    assert not_judged["reward_share/format"].startswith("its baseline 0.75 is not under 0.7")
    assert run_monitor(steady(**high)[:2]).not_judged() == {}  # decided when the baseline is complete


def test_an_entropy_that_starts_near_zero_is_named_not_judged():
    """An entropy baseline under 0.05 leaves no bound: a fall to 0 raises nothing, and not_judged says why."""
    monitor = run_monitor(steady(entropy=0.03) + [{"entropy": 0.0}])
    assert monitor.alarms == []
    assert monitor.not_judged() == {"entropy": "its baseline 0.03 is under 0.05: a policy near-deterministic from "
                                               "the start has nothing left to fall from"}
    assert run_monitor(steady(entropy=0.05)).not_judged() == {}


def test_a_length_bound_past_the_answer_limit_is_named_not_judged_and_the_other_still_alarms():
    """Answers of 10 tokens under a 16-token limit: the bound above, 2 x 10 = 20, is past what any answer reaches,
    so response_length is judged below only (and says so); a fall under 5 still alarms. At 7.9 tokens the bound,
    15.8, can be passed: judged both ways. Answers of 1.5 tokens have a bound below, 0.75, under the shortest
    answer; with a 2-token limit neither bound can be passed."""
    limit = AnswerLimit(16, "--max_completion_length")
    monitor = run_monitor(steady(response_length=10.0) + [{"response_length": 16.0}, {"response_length": 4.0}],
                          ["response_length"], limit)
    assert [(a.direction, a.threshold, a.step) for a in monitor.alarms] == [("below", 5.0, 5)]
    assert monitor.not_judged() == {"response_length": (
        "its bound above, 20 tokens, is not under the answer limit (--max_completion_length 16), which no answer "
        "passes (baseline 10): judged below only")}
    judged_both = run_monitor(steady(response_length=7.9) + [{"response_length": 16.0}], ["response_length"], limit)
    assert judged_both.not_judged() == {} and judged_both.alarms[0].threshold == pytest.approx(15.8)
    stubs = run_monitor(steady(response_length=1.5), ["response_length"], limit).not_judged()
    assert stubs["response_length"].endswith("is not over 1 token, the shortest answer (baseline 1.5): judged above "
                                             "only")
    neither = run_monitor(steady(response_length=1.5), ["response_length"], AnswerLimit(2, "--max_answer_seq_len"))
    reason = neither.not_judged()["response_length"]
    assert reason.startswith("its bound above, 3 tokens, is not under the answer limit (--max_answer_seq_len 2)")
    assert reason.endswith("; its bound below, 0.75 tokens, is not over 1 token, the shortest answer (baseline 1.5)")
    assert run_monitor(steady(response_length=10.0), ["response_length"]).not_judged() == {}  # no limit given


def test_each_kind_of_not_judged_is_in_the_alarm_file_and_named_in_one_line_when_decided(tmp_path, caplog):
    """The trainer's check (RLTrainer.check_health on constructed figures): the iteration that completes the
    baselines logs one line naming each signal they leave unable to alarm, with its reason, and writes them to
    rl_alarms.json's not_judged; no other iteration repeats the line."""
    from lorakit.rl.experience import SumStats
    from lorakit.rl.rl_trainer import RLTrainer

    plan = HealthPlan(["entropy", "response_length", "truncated_share", "distinct_2"], {},
                      AnswerLimit(16, "--max_completion_length"))
    trajectory = steady(entropy=0.03, response_length=10.0, truncated_share=0.3, distinct_2=0.8) * 2
    stub = SimpleNamespace(health_stats=SumStats(), stage_name="GRPO", health_plan=plan,
                           health=HealthMonitor(plan.signals, plan.answer_limit), stream=SimpleNamespace(iteration=0),
                           args=SimpleNamespace(device=torch.device("cpu"), process_index=0, output_dir=str(tmp_path)))
    lines = {}
    for iteration, figures in enumerate(trajectory):
        stub.stream.iteration, stub.health_figures = iteration + 1, lambda update, figures=figures: figures
        caplog.clear()
        with caplog.at_level("INFO", logger="lorakit.rl.alarms"):
            assert RLTrainer.check_health(stub, iteration + 1) == []
        lines[iteration + 1] = [r.getMessage() for r in caplog.records if "not judged" in r.getMessage()]
    assert {step: len(found) for step, found in lines.items()} == {1: 0, 2: 0, 3: 1, 4: 0, 5: 0, 6: 0}
    (line,) = lines[3]
    record = json.loads((tmp_path / ALARM_FILE).read_text())
    assert set(record["not_judged"]) == {"entropy", "response_length", "truncated_share"}
    for signal, reason in record["not_judged"].items():
        assert f"{signal}: {reason}" in line
    assert line.startswith("GRPO health monitors: not judged in this run (decided by their baselines): entropy: its "
                           "baseline 0.03 is under 0.05")
    assert "(--max_completion_length 16)" in record["not_judged"]["response_length"]
    assert "is not under 0.2" in record["not_judged"]["truncated_share"]
    write_alarm_file(str(tmp_path), "GRPO", plan, HealthMonitor(plan.signals))
    assert json.loads((tmp_path / ALARM_FILE).read_text())["not_judged"] == {}  # before any baseline


def test_kl_acceleration_warns_before_the_kl_itself_is_high():
    """A KL climbing 0.01 per iteration, then jumping by 0.2: its second difference 0.19 passes max(2 x 0.02, 0.15)
    while the KL, 0.25, is still under its 0.5 floor; the steady climb before it raised nothing."""
    kls = [0.01, 0.02, 0.03, 0.04, 0.05, 0.25]
    monitor = run_monitor([{"kl": kl} for kl in kls], ["kl", "kl_acceleration"])
    (alarm,) = monitor.alarms
    assert alarm.signal == "kl_acceleration" and alarm.step == 6
    assert alarm.value == pytest.approx(0.25 - 2 * 0.05 + 0.04) and alarm.threshold == pytest.approx(0.15)
    assert monitor.latest["kl_acceleration"] == pytest.approx(0.19)
    assert "baseline 0.02, the mean of kl's first 3 values" in alarm.message()


def test_a_missing_or_non_finite_figure_is_skipped_and_unknown_signals_are_refused():
    monitor = run_monitor(steady(entropy=2.0) + [{"entropy": float("nan")}, {"entropy": None}, {"entropy": 0.1}],
                          ["entropy"])
    assert [(a.signal, a.step) for a in monitor.alarms] == [("entropy", 6)]
    with pytest.raises(ValueError, match="no health rule"):
        HealthMonitor(["perplexity"])


def test_an_older_checkpoint_with_an_own_kl_acceleration_baseline_loads_and_judges_it_at_once():
    """A checkpoint from before kl_acceleration was judged against the KL's baseline alone holds values of its own
    baseline: they are dropped, and the resumed run judges its next value; a resumed monitor names the same signals
    not judged as the uninterrupted one (they follow from the baselines that travel, and the answer limit)."""
    older = {"baseline_values": {"kl": [0.01, 0.02, 0.03], "kl_acceleration": [0.0]}, "recent_kl": [0.02, 0.03],
             "latest": {}, "active": [], "alarms": []}
    monitor = HealthMonitor(["kl", "kl_acceleration"])
    monitor.load_state_dict(older)
    assert "kl_acceleration" not in monitor.state_dict()["baseline_values"]
    (alarm,) = monitor.observe(4, 3, {"kl": 0.25})
    assert (alarm.signal, alarm.step, alarm.value) == ("kl_acceleration", 4, pytest.approx(0.25 - 0.06 + 0.02))
    limit = AnswerLimit(16, "--max_answer_seq_len")
    whole = run_monitor(steady(response_length=10.0, entropy=0.01), ["response_length", "entropy"], limit)
    resumed = HealthMonitor(["response_length", "entropy"], limit)
    resumed.load_state_dict(json.loads(json.dumps(whole.state_dict())))
    assert resumed.not_judged() == whole.not_judged() and set(whole.not_judged()) == {"response_length", "entropy"}


def test_a_restored_monitor_judges_as_the_uninterrupted_one():
    """The state a checkpoint holds (JSON round trip): the resumed monitor raises the same alarms afterwards."""
    rng = random.Random(5)
    trajectory = [healthy_figures(rng, i) for i in range(6)] + [{"kl": 0.9, "entropy": 0.1}]
    whole = run_monitor(trajectory)
    first = run_monitor(trajectory[:4])
    resumed = HealthMonitor(ALL_SIGNALS)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for iteration, figures in enumerate(trajectory[4:], start=4):
        resumed.observe(iteration + 1, iteration, figures)
    assert resumed.alarms == whole.alarms and {a.signal for a in whole.alarms} >= {"kl", "entropy"}


def test_a_checkpoint_from_before_the_monitors_resumes_with_one_line(tmp_path, caplog):
    """No rl_health.json (a checkpoint of an earlier version): the monitor starts afresh, said in one warning; with
    one, the monitor is the saved one."""
    from lorakit.rl.alarms import load_health_state, save_health_state

    monitor = HealthMonitor(["entropy"])
    with caplog.at_level("WARNING"):
        load_health_state(str(tmp_path), monitor)
    assert monitor.baseline_values == {} and len(caplog.records) == 1
    assert f"holds no {HEALTH_STATE_NAME} (written before the health monitors)" in caplog.records[0].getMessage()
    save_health_state(str(tmp_path), run_monitor(steady(entropy=2.0), ["entropy"]))
    load_health_state(str(tmp_path), monitor)
    assert monitor.baselines() == {"entropy": 2.0}


# ----------------------------------------------------------------------------- the figures


def test_answer_diversity_compares_answers_across_prompts_only():
    """Groups of 2 answers to 3 prompts. Group answers that agree (GRPO converging) do not count against diversity:
    distinct-2 is taken over the k-th answers of the groups; the most common answer's share counts prompts."""
    a, b, c = [1, 2, 3], [4, 5, 6], [1, 2, 9]
    assert distinct_ngrams([a, c]) == pytest.approx(3 / 4)  # (1,2) twice, (2,3), (2,9)
    converged = answer_diversity([a, a, b, b, c, c], 2)
    assert converged.distinct_2 == pytest.approx(5 / 6) and converged.top_answer_share == pytest.approx(1 / 3)
    collapsed = answer_diversity([a, a, a, a, a, b], 2)
    # k=0: a, a, a -> 2 distinct of 6; k=1: a, a, b -> 4 of 6
    assert collapsed.distinct_2 == pytest.approx((2 / 6 + 4 / 6) / 2) and collapsed.top_answer_share == 1.0
    assert answer_diversity([[7], [8]], 1) == (None, 0.5)


def test_pair_moments_give_pearson_and_the_explained_variance():
    rng = np.random.default_rng(0)
    x, noise = rng.normal(size=50), rng.normal(size=50)
    y, weights = 0.5 * x + noise, np.ones(50)
    sums = moment_sums(torch.tensor(x), torch.tensor(y), torch.tensor(weights))
    moments = PairMoments(*(sums[name] / weights.sum() for name in PairMoments._fields))
    assert moments.correlation() == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-9)
    assert moments.explained_variance() == pytest.approx(1 - np.var(y) / np.var(x), abs=1e-9)
    constant = PairMoments(1.0, 2.0, 1.0, 5.0, 2.0)
    assert constant.correlation() is None and constant.explained_variance() is None


def test_ppo_logs_the_critic_explained_variance_and_the_reward_length_correlation():
    """experience_metrics on a hand-made experience of 3 answers: explained_variance = 1 - Var(returns - values) /
    Var(returns) over the answer tokens, reward_length_corr = Pearson's r of score and length over the answers."""
    from lorakit.rl.experience import Experience, experience_metrics

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    returns = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 1.0, 4.0]])
    values = torch.tensor([[0.5, 2.0, 0.0], [2.0, 0.0, 0.0], [1.0, 1.0, 3.0]])
    scores, zeros = torch.tensor([0.2, -1.0, 1.4]), torch.zeros(3, 3)
    experience = Experience(
        input_ids=torch.zeros(3, 4, dtype=torch.long), attention_mask=torch.ones(3, 4, dtype=torch.long),
        prompt_length=1, response_mask=mask, has_eos=torch.tensor([True, True, False]), old_logprobs=zeros,
        sampler_logprobs=zeros, ref_logprobs=zeros, old_values=values, entropy=zeros, scores=scores, kl=zeros,
        rewards=zeros, advantages=zeros, returns=returns)
    metrics = experience_metrics(experience, torch.device("cpu"))
    real = mask.bool()
    targets, errors = returns[real].numpy(), (returns - values)[real].numpy()
    assert metrics["explained_variance"] == pytest.approx(1 - np.var(errors) / np.var(targets), abs=1e-6)
    assert metrics["reward_length_corr"] == pytest.approx(np.corrcoef([0.2, -1.0, 1.4], [2, 1, 3])[0, 1], abs=1e-6)


def test_ppo_judges_the_kl_per_answer_token_and_the_cut_share():
    """PPO logs its KL summed over an answer: the monitor judges it per token (kl / response_length), and the
    share cut at the limit as 1 - eos_fraction; the sampler gap from the experience, else the update's."""
    from lorakit.rl.ppo_trainer import PPOTrainer

    stub = SimpleNamespace(experience_stats={"kl": 6.0, "response_length": 20.0, "eos_fraction": 0.75,
                                             "entropy": 1.5, "distinct_2": 0.4}, sft_answers=None,
                           maker=SimpleNamespace(max_answer_len=64))
    figures = PPOTrainer.health_figures(stub, {"sampler_gap/kl": 0.002})
    assert figures["kl"] == pytest.approx(0.3) and figures["truncated_share"] == pytest.approx(0.25)
    assert figures["sampler_gap"] == 0.002 and figures["entropy"] == 1.5 and figures["sft_copy_share"] is None
    plan = PPOTrainer.plan_health(stub)
    assert plan.signals == PPO_SIGNALS[:-1] and set(plan.left_out) == {"reward_share", "sft_copy_share"}
    assert plan.answer_limit == AnswerLimit(64, "--max_answer_seq_len")


def test_grpo_gives_its_monitor_the_completion_limit():
    """The answer limit a length bound is compared with is --max_completion_length."""
    from lorakit.rl.grpo_trainer import GRPOTrainer

    stub = SimpleNamespace(model=SimpleNamespace(score_head=None), sft_answers=None,
                           args=SimpleNamespace(beta=0.04, max_completion_length=48),
                           reward_weights=lambda: {"correct": 1.0})
    plan = GRPOTrainer.plan_health(stub)
    assert plan.answer_limit == AnswerLimit(48, "--max_completion_length") and "kl_acceleration" in plan.signals


def test_sft_answers_are_read_from_any_sft_shape_and_compared_whitespace_aside(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"instruction": "2+2?", "output": "The answer is  4.\n"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                      {"role": "user", "content": "1+0?"}, {"role": "assistant", "content": " The answer is 1."}]},
    ]) + "\n")
    assert read_sft_answers(str(path)) == {"The answer is 4.", "Hello!", "The answer is 1."}
    assert read_sft_answers(None) is None
    (tmp_path / "bad.jsonl").write_text('{"instruction": "x"}\n')
    with pytest.raises(InputError, match="bad.jsonl:1"):
        read_sft_answers(str(tmp_path / "bad.jsonl"))


# ----------------------------------------------------------------------------- a real run


# Rewards the shorter answer: the tiny policy learns to stop at once, and its answers collapse to stubs within a
# few rollouts (the answer-length alarm: under half the first three rollouts' length).
SHORT_REWARD = textwrap.dedent('''
    def shorter(completion_ids, **kwargs):
        return [-len(ids) / 16.0 for ids in completion_ids]
''')


@pytest.fixture(scope="module")
def collapse_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("health_inputs")
    rng = random.Random(7)
    records = [{"instruction": " ".join(rng.choice(ENGLISH + CHINESE) for _ in range(rng.randint(3, 8)))}
               for _ in range(64)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")
    (root / "rewards.py").write_text(SHORT_REWARD)
    return root


def collapse_args(model_dir, inputs, output_dir, **overrides) -> list:
    options = {"model_name_or_path": model_dir, "data_path": inputs / "prompts.jsonl", "template": "human_assistant",
               "reward_funcs": f"{inputs / 'rewards.py'}:shorter", "max_prompt_seq_len": 32,
               "max_completion_length": 16, "num_generations": 4, "per_device_train_batch_size": 16, "lora_rank": 8,
               "lora_alpha": 16, "trainable": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
               "torch_dtype": "float32", "learning_rate": 2e-3, "lr_scheduler_type": "constant", "report_to": "none",
               "save_strategy": "steps", "save_steps": 1, "logging_steps": 1, "max_steps": 12,
               "output_dir": output_dir, "seed": 1, **overrides}
    return ["--use_cpu"] + options_to_argv(options)


def checkpoint_steps(output_dir) -> list:
    return sorted(int(name.split("-")[1]) for name in os.listdir(output_dir) if name.startswith("checkpoint-"))


def same_weights(first_dir, second_dir) -> bool:
    first, second = adapter_weights(first_dir), adapter_weights(second_dir)
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


@pytest.mark.slow  # two GRPO runs (stopped, then resumed)
def test_stop_on_alarm_exits_4_and_publishes_the_last_alarm_free_checkpoint(tiny_model_dir, collapse_inputs,
                                                                           tmp_path):
    """GRPO rewarding short answers at a high learning rate: the answers shrink under half their first three
    rollouts' length within a few rollouts. --stop_on_alarm ends the run there with exit status 4 and one line; no
    checkpoint is saved from the alarm on; grpo_lora_model is the last checkpoint's adapter, bit for bit; the alarm
    is in the step log (alarm/response_length, alarms_active) and in rl_alarms.json with its value and threshold."""
    out = tmp_path / "out"
    result = run_in_process(GRPO_SCRIPT, collapse_args(tiny_model_dir, collapse_inputs, out, stop_on_alarm=True))
    assert result.returncode == 4, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    record = json.loads((out / ALARM_FILE).read_text())
    first = record["alarms"][0]
    stop = first["step"]
    assert error.startswith(f"error: training stopped by a health alarm (--stop_on_alarm) at step {stop}: "
                            "response_length = ")
    assert f"grpo_lora_model is checkpoint-{stop - 1}'s, the last saved with no alarm active" in error
    assert "health alarm at step" in result.stdout and "response_length" in result.stdout
    baseline = record["baselines"]["response_length"]
    assert first["signal"] == "response_length" and first["direction"] == "below" and stop > BASELINE_ITERATIONS
    assert first["threshold"] == pytest.approx(0.5 * baseline) and first["value"] < first["threshold"]
    assert record["ending"] == {"step": stop, "stopped": True, "alarm_active": True,
                                "published_from": f"checkpoint-{stop - 1}/grpo_lora_model",
                                "published_through_alarm": False}
    assert error.endswith("resume with --publish_on_alarm instead of --stop_on_alarm to train on through it and "
                          "publish its end")
    assert record["left_out"]["kl"].startswith("--beta 0") and "sft_copy_share" in record["left_out"]
    assert checkpoint_steps(out) == list(range(1, stop))
    assert same_weights(out / "grpo_lora_model", out / f"checkpoint-{stop - 1}" / "grpo_lora_model")
    assert not same_weights(out / "grpo_lora_model", out / "checkpoint-1" / "grpo_lora_model")
    steps = [entry for entry in log_history(out) if "loss" in entry]
    assert [entry["step"] for entry in steps] == list(range(1, stop + 1))
    assert steps[-1]["alarm/response_length"] == 1 and steps[-1]["alarms_active"] >= 1
    assert all(entry["alarms_active"] == 0 and not any(k.startswith("alarm/") for k in entry) for entry in steps[:3])
    assert steps[-1]["response_length"] == pytest.approx(first["value"])
    saved_state = json.loads((out / f"checkpoint-{stop - 1}" / HEALTH_STATE_NAME).read_text())
    assert saved_state["baseline_values"]["response_length"] == [entry["response_length"] for entry in steps[:3]]
    # Both alarm flags may change on a resume: the command the line gives resumes from the last alarm-free
    # checkpoint, whose monitor raises the same alarm at the same step, and trains on through it to the end,
    # saving checkpoints and publishing the end of training (not checkpoint-{stop - 1}'s adapter again).
    resumed = run_in_process(GRPO_SCRIPT, collapse_args(tiny_model_dir, collapse_inputs, out, publish_on_alarm=True))
    assert_ok(resumed)
    assert f"resuming from {out / f'checkpoint-{stop - 1}'}" in resumed.stdout
    assert "--publish_on_alarm: grpo_lora_model is the end of training's, trained through the alarm" in resumed.stdout
    again = json.loads((out / ALARM_FILE).read_text())
    assert again["alarms"][0] == first and again["ending"] == {"step": 12, "stopped": False, "alarm_active": True,
                                                               "published_from": None,
                                                               "published_through_alarm": True}
    assert checkpoint_steps(out) == list(range(1, 13))
    assert same_weights(out / "grpo_lora_model", out / "checkpoint-12" / "grpo_lora_model")
    assert not same_weights(out / "grpo_lora_model", out / f"checkpoint-{stop - 1}" / "grpo_lora_model")


def test_a_run_that_ends_with_an_alarm_active_publishes_the_last_alarm_free_checkpoint(tiny_model_dir,
                                                                                    collapse_inputs, tmp_path):
    """Without --stop_on_alarm the same run trains on to its last step (exit 0), saving no checkpoint at a step whose
    iteration alarmed; it ends with the alarm active, so grpo_lora_model is the last checkpoint's adapter. Given SFT
    answers the tiny policy never gives, sft_copy_share is monitored and 0 at every step. Its rollouts of 4 prompts
    leave top_answer_share not judged, said in one line and in the alarm file."""
    out = tmp_path / "out"
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"instruction": "1+0?", "output": "The answer is 1."}) + "\n")
    result = run_in_process(GRPO_SCRIPT, collapse_args(tiny_model_dir, collapse_inputs, out, sft_answers_file=sft))
    assert_ok(result)
    assert all(entry["sft_copy_share"] == 0 for entry in log_history(out) if "loss" in entry)
    record = json.loads((out / ALARM_FILE).read_text())
    assert "sft_copy_share" in record["signals"] and record["baselines"]["sft_copy_share"] == 0
    # 16 answers in groups of 4: 4 prompts, so the most common answer's share is at least 0.25 from the start.
    assert record["not_judged"]["top_answer_share"].startswith("its baseline 0.25 is not under 0.2")
    (line,) = [line for line in result.stdout.splitlines() if "not judged in this run" in line]
    assert f"top_answer_share: {record['not_judged']['top_answer_share']}" in line
    alarmed = {alarm["step"] for alarm in record["alarms"]}
    saved = checkpoint_steps(out)
    assert 12 in alarmed and record["ending"]["alarm_active"] and not record["ending"]["stopped"]
    assert saved and not alarmed & set(saved) and set(saved) | alarmed == set(range(1, 13))
    assert record["ending"]["published_from"] == f"checkpoint-{saved[-1]}/grpo_lora_model"
    assert not record["ending"]["published_through_alarm"]
    assert (f"grpo_lora_model is checkpoint-{saved[-1]}'s, the last saved with no alarm active (what was trained "
            "under the alarm is not kept; --publish_on_alarm on a resume trains on through it") in result.stdout
    assert same_weights(out / "grpo_lora_model", out / f"checkpoint-{saved[-1]}" / "grpo_lora_model")
    assert not (out / "actor_ema").exists()


# ----------------------------------------------------------------------------- the pipeline after exit 4


def grpo_pipeline(model_dir, inputs, output_dir, processes=1, **flags) -> dict:
    """A pipeline of the collapsing GRPO run alone: 16 answers per rollout over the processes."""
    stage = {"stage": "grpo", "data_path": str(inputs / "prompts.jsonl"), "template": "human_assistant",
             "reward_funcs": f"{inputs / 'rewards.py'}:shorter", "max_prompt_seq_len": 32,
             "max_completion_length": 16, "num_generations": 4, "per_device_train_batch_size": 16 // processes,
             **flags}
    return {"base_model": model_dir, "output_dir": str(output_dir),
            "deployment": {"mode": "single_node", "nproc_per_node": processes},
            "training_flags": {"use_cpu": True, "max_steps": 12, "save_steps": 1, "logging_steps": 1,
                               "learning_rate": 2e-3, "lr_scheduler_type": "constant", "lora_rank": 8,
                               "lora_alpha": 16, "seed": 1, "torch_dtype": "float32", "report_to": "none"},
            "stages": [stage]}


@pytest.mark.parametrize("status", [4, 1])
def test_the_pipeline_does_not_resume_a_stage_a_health_alarm_stopped(status, tiny_model_dir, collapse_inputs,
                                                                      tmp_path):
    """A stage whose process exits 4 (here an interpreter that does only that): the pipeline exits 4, and a rerun
    with the same config and data is refused in one line until --from_stage says to run it afresh; after a crash
    (1) the same rerun goes ahead."""
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\necho 'a stage that stops'\nexit {status}\n")
    fake_python.chmod(0o755)
    path = write_config(tmp_path / "pipeline.yaml", grpo_pipeline(tiny_model_dir, collapse_inputs, tmp_path / "out"))
    failed = run_pipeline(path, "--python", fake_python)
    assert failed.returncode == status, failed.stderr[-3000:]
    marker = json.loads((tmp_path / "out" / ".pipeline" / "grpo.json").read_text())
    assert marker["failed"]["status"] == status
    if status == 4:
        check_refused(run_in_process(PIPELINE, [path, "--dry_run"]),
                      "stage 'grpo' stopped with exit status 4 (a health alarm) on its last run")
    else:
        assert actions(run_in_process(PIPELINE, [path, "--dry_run"])) == {"grpo": "run"}
    forced = run_in_process(PIPELINE, [path, "--from_stage", "grpo", "--dry_run"])
    assert_ok(forced)
    assert actions(forced) == {"grpo": "run"} and "--from_stage grpo" in forced.stdout


@pytest.mark.parametrize("alarm_active", [True, False])
def test_a_stage_that_published_no_adapter_fails_and_after_an_alarm_is_not_resumed(alarm_active, tiny_model_dir,
                                                                                    collapse_inputs, tmp_path):
    """A stage that exits 0 without its adapter (here an interpreter that writes only the alarm file of a run that
    ended with an alarm active and no checkpoint before it): the pipeline fails it instead of letting the next stage
    fail on the missing adapter, with status 4 and no resume after an alarm, 1 otherwise."""
    from lorakit.pipeline.runner import ALARM_FILE as PIPELINE_ALARM_FILE

    assert PIPELINE_ALARM_FILE == ALARM_FILE  # the pipeline names the file without importing the stage's code
    ending = json.dumps({"ending": {"alarm_active": alarm_active, "published_from": None}})
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\nwhile [ $# -gt 0 ]; do [ \"$1\" = --output_dir ] && out=\"$2\"; shift; done\n"
                           f"mkdir -p \"$out\" && echo '{ending}' > \"$out/{ALARM_FILE}\"\n")
    fake_python.chmod(0o755)
    path = write_config(tmp_path / "pipeline.yaml", grpo_pipeline(tiny_model_dir, collapse_inputs, tmp_path / "out"))
    failed = run_pipeline(path, "--python", fake_python)
    expected = 4 if alarm_active else 1
    assert failed.returncode == expected, failed.stderr[-3000:]
    if alarm_active:
        assert "stage 'grpo' ended with a health alarm active and no checkpoint saved before it, so it published no " \
               "grpo_lora_model" in failed.stderr
        check_refused(run_in_process(PIPELINE, [path, "--dry_run"]), "stage 'grpo' stopped with exit status 4")
    else:
        assert "stage 'grpo' exited 0 but wrote no grpo_lora_model" in failed.stderr


@pytest.mark.slow
def test_a_real_stage_stopped_by_an_alarm_on_two_processes_exits_4_and_is_not_resumed(tiny_model_dir,
                                                                                     collapse_inputs, tmp_path):
    """The grpo stage itself under the pipeline, on two processes (8 answers each), --stop_on_alarm: both processes
    take rank 0's verdict and stop at the same step (the launcher reports their one status, 4, and their line), the
    stage's checkpoints stay, and the rerun is refused rather than resumed from them."""
    out = tmp_path / "out"
    path = write_config(tmp_path / "pipeline.yaml",
                        grpo_pipeline(tiny_model_dir, collapse_inputs, out, processes=2, stop_on_alarm=True))
    failed = run_pipeline(path)
    assert failed.returncode == 4, failed.stderr[-3000:]
    assert "training stopped by a health alarm (--stop_on_alarm) at step" in failed.stderr
    record = json.loads((out / "grpo" / ALARM_FILE).read_text())
    stop = record["ending"]["step"]
    assert record["ending"]["stopped"] and record["alarms"][0]["signal"] == "response_length"
    assert checkpoint_steps(out / "grpo") == list(range(1, stop))
    assert "process 0 of 2" in (out / "logs" / "grpo.log").read_text()
    check_refused(run_in_process(PIPELINE, [path]), "stage 'grpo' stopped with exit status 4 (a health alarm)")
