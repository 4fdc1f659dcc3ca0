"""What a health alarm (rl.health) does to an RL run: the Trainer callback that judges each iteration at its end and
keeps a checkpoint from being saved while an alarm is active, the alarm figures in the Trainer's logs, the alarm
file a report reads (OUTPUT/rl_alarms.json), the monitor's state in each checkpoint (a resumed run judges as the
uninterrupted one), and the adapter published when a run ends with an alarm active: the last checkpoint's, saved
with none. rl.rl_trainer wires it for every RL stage."""

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from transformers import TrainerCallback

from lorakit.core.atomic import replace_directory, write_json_atomically
from lorakit.core.model_files import checkpoint_states
from lorakit.rl.health import BASELINE_ITERATIONS, Alarm, AnswerLimit, HealthMonitor, rule_of

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger(__name__)

ALARM_FILE = "rl_alarms.json"
HEALTH_STATE_NAME = "rl_health.json"


class HealthPlan(NamedTuple):
    """The signals a stage monitors (rl.health.RULES' names, reward_share/<component>), for each signal it cannot
    have, why (said once in the log and in the alarm file), and the stage's answer limit (a length bound past it
    cannot fire: the monitor names it not judged)."""

    signals: list[str]
    left_out: dict[str, str]
    answer_limit: AnswerLimit | None = None

    def describe(self, stage: str) -> str:
        left_out = "; ".join(f"{signal} ({why})" for signal, why in self.left_out.items())
        return (f"{stage} health monitors: {', '.join(self.signals)}; baseline: the first {BASELINE_ITERATIONS} "
                f"iterations" + (f"; left out: {left_out}" if left_out else ""))


class HealthCallback(TrainerCallback):
    """At the end of each iteration (every steps_per_iteration optimizer steps, and the last step) check(step)
    judges it and returns its alarms (every process gets rank 0's); a new alarm makes the step a logged one, and
    with stop (--stop_on_alarm) ends training there (the Trainer then ends as usual and rl.rl_trainer raises
    StoppedByAlarm). While an alarm is active nothing is saved, so the last checkpoint on disk holds weights no
    alarm was raised on, unless publish (--publish_on_alarm) keeps what is trained through alarms."""

    def __init__(self, check: Callable[[int], list[Alarm]], monitor: HealthMonitor, steps_per_iteration: int,
                 stop: bool, publish: bool) -> None:
        self.check, self.monitor, self.steps_per_iteration = check, monitor, steps_per_iteration
        self.stop, self.publish = stop, publish
        self.stopped = False

    def holds_saving(self) -> bool:
        return bool(self.monitor.active) and not self.publish

    def on_step_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                    **kwargs: Any) -> "TrainerControl":
        if state.global_step % self.steps_per_iteration == 0 or state.global_step >= state.max_steps:
            alarms = self.check(state.global_step)
            if alarms:
                control.should_log = True
            if alarms and self.stop:
                control.should_training_stop = self.stopped = True
        if self.holds_saving():
            control.should_save = False
        return control

    def on_epoch_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                     **kwargs: Any) -> "TrainerControl":
        if self.holds_saving():  # the Trainer may save once more as its loop ends
            control.should_save = False
        return control


def alarm_logs(monitor: HealthMonitor) -> dict[str, float]:
    """What each training log carries: alarms_active (how many signals are past their thresholds at the last
    iteration judged), alarm/<signal> = 1 for each of them, and kl_acceleration where it was measured."""
    logs = {"alarms_active": float(len(monitor.active))}
    logs.update({f"alarm/{alarm.signal}": 1.0 for alarm in monitor.active})
    if "kl_acceleration" in monitor.latest:
        logs["kl_acceleration"] = monitor.latest["kl_acceleration"]
    return logs


def write_alarm_file(output_dir: str, stage: str, plan: HealthPlan, monitor: HealthMonitor,
                     ending: dict[str, Any] | None = None) -> None:
    """OUTPUT/rl_alarms.json, whole or not at all: the signals monitored and left out, each rule and baseline, the
    signals their baselines leave unable to alarm and why (not_judged), every alarm (step, iteration, signal, value,
    threshold, direction, baseline), the alarms active at the last iteration judged, and, once training ended, how
    (ending: stopped, published)."""
    record = {"stage": stage, "baseline_iterations": BASELINE_ITERATIONS, "signals": plan.signals,
              "left_out": plan.left_out, "rules": {signal: rule_of(signal).text for signal in plan.signals},
              "baselines": monitor.baselines(), "not_judged": monitor.not_judged(),
              "alarms": [alarm._asdict() for alarm in monitor.alarms],
              "active": [alarm._asdict() for alarm in monitor.active], "ending": ending}
    write_json_atomically(os.path.join(output_dir, ALARM_FILE), record, make_parents=True)


def not_judged_line(stage: str, decided: dict[str, str]) -> str:
    """The one line naming the signals whose just completed baselines leave them unable to alarm, and why."""
    reasons = "; ".join(f"{signal}: {why}" for signal, why in decided.items())
    return f"{stage} health monitors: not judged in this run (decided by their baselines): {reasons}"


def report_iteration(output_dir: str, stage: str, plan: HealthPlan, monitor: HealthMonitor, alarms: list[Alarm],
                     not_judged_before: dict[str, str]) -> None:
    """On rank 0, once an iteration is judged (alarms: its alarms): a warning line per alarm, one line for the
    signals whose baselines it completed and left unable to alarm (not_judged_before: the monitor's not_judged()
    before it), and the alarm file where either is new, so that a report read during the run has them."""
    decided = {signal: why for signal, why in monitor.not_judged().items() if not_judged_before.get(signal) != why}
    if decided:
        logger.info(not_judged_line(stage, decided))
    for alarm in alarms:
        logger.warning(alarm.message())
    if decided or alarms:
        write_alarm_file(output_dir, stage, plan, monitor)


def save_health_state(directory: str, monitor: HealthMonitor) -> None:
    with open(os.path.join(directory, HEALTH_STATE_NAME), "w", encoding="utf-8") as handle:
        json.dump(monitor.state_dict(), handle, indent=1)


def load_health_state(checkpoint: str, monitor: HealthMonitor) -> None:
    """The monitor as the checkpoint left it; a checkpoint written before the monitors resumes with one line."""
    path = os.path.join(checkpoint, HEALTH_STATE_NAME)
    if not os.path.isfile(path):
        logger.warning("%s holds no %s (written before the health monitors): their baselines are taken from the "
                       "resumed run's first %d iterations", checkpoint, HEALTH_STATE_NAME, BASELINE_ITERATIONS)
        return
    with open(path, encoding="utf-8") as handle:
        monitor.load_state_dict(json.load(handle))


def last_alarm_free_checkpoint(output_dir: str, step: int) -> str | None:
    """The last complete checkpoint at or before step: none is saved while an alarm is active."""
    complete = [path for saved, path, problem in checkpoint_states(output_dir) if problem is None and saved <= step]
    return complete[-1] if complete else None


def publish_from_checkpoint(output_dir: str, checkpoint: str | None, names: Sequence[str]) -> None:
    """OUTPUT/<name> for each name (the adapter, actor_ema): a copy of checkpoint/<name> put in place of what the
    end of training wrote (whole or not at all, core.atomic), or removed where there is no checkpoint to take it
    from (nothing trained while an alarm was active is published)."""
    for name in names:
        target = os.path.join(output_dir, name)
        source = os.path.join(checkpoint, name) if checkpoint else None
        if source is None or not os.path.isdir(source):
            shutil.rmtree(target, ignore_errors=True)
            continue
        built = tempfile.mkdtemp(prefix=f".{name}.from-checkpoint-", dir=output_dir)
        try:
            shutil.copytree(source, built, dirs_exist_ok=True)
            replace_directory(built, target)
        finally:
            shutil.rmtree(built, ignore_errors=True)  # only still there after a failure


def publication_note(adapter: str, checkpoint: str | None) -> str:
    if checkpoint is None:
        return f"no checkpoint was saved before the alarm: no {adapter} is published"
    return f"{adapter} is {os.path.basename(checkpoint)}'s, the last saved with no alarm active"


def ended_under_alarm_note(adapter: str, checkpoint: str | None, published_through: bool) -> str:
    """The warning of a run that trained to its end with an alarm active: what it published, and how to keep what
    it trained (a resume of a stopped run without --publish_on_alarm retrains into the same alarm and publishes the
    same checkpoint again)."""
    if published_through:
        return f"--publish_on_alarm: {adapter} is the end of training's, trained through the alarm"
    return (f"{publication_note(adapter, checkpoint)} (what was trained under the alarm is not kept; "
            "--publish_on_alarm on a resume trains on through it and publishes its end)")


def stop_message(alarms: Sequence[Alarm], adapter: str, checkpoint: str | None, output_dir: str) -> str:
    """The one line of a run --stop_on_alarm ended (exit status 4)."""
    first = alarms[0]
    more = f" (and {len(alarms) - 1} more)" if len(alarms) > 1 else ""
    return (f"training stopped by a health alarm (--stop_on_alarm) at step {first.step}: {first.signal} = "
            f"{first.value:.4g}, {first.direction} its threshold {first.threshold:.4g}{more}; "
            f"{publication_note(adapter, checkpoint)}; every alarm is in {os.path.join(output_dir, ALARM_FILE)}; "
            "check the reward and lower the learning rate before running again, or, if the alarm is false, resume "
            "with --publish_on_alarm instead of --stop_on_alarm to train on through it and publish its end")
