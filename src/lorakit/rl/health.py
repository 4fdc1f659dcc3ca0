"""RL health monitors: the signals of a run that collapses while its reward rises (the KL to the reference and how
fast it climbs, the policy's entropy, the answers' length and the share cut at the limit, the reward's correlation
with length, each reward component's share, the critic's explained variance, the sampler-vs-trainer gap, and the
answers' diversity), judged once per iteration against the run's own first iterations, and the alarms they raise.

HealthMonitor is pure: it takes one dict of figures per iteration and returns the alarms. The figures come from the
statistics the stages already log (rl.experience, rl.grpo_trainer), reduced over every process; the few new ones
are computed here from the gathered answers (answer_diversity) or from moments reduced with the rest
(PairMoments). rl.rl_trainer wires the monitor into the Trainer (HealthCallback): logs, the alarm file, no
checkpoint while an alarm is active, --stop_on_alarm. Thresholds are relative to a baseline, the mean of each
signal's first BASELINE_ITERATIONS values, with absolute floors where the baseline may be ~0; they were fixed from
what the signals mean and what published RLHF runs report, before any collapsed run was measured
(docs/ppo.md#health-alarms)."""

import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from lorakit.core.cli import InputError, ReportedError
from lorakit.records.readers import conversation_of, find_record_files, read_records

if TYPE_CHECKING:
    import torch

# The baseline: the mean of each signal's first values. Three iterations average out one noisy rollout and still
# leave a short run most of its iterations to judge; the iterations of a signal's baseline are never judged on that
# signal. A signal judged against another's baseline (kl_acceleration, the KL's) spends none of its own values on
# one: it is judged from its first value on, once that other baseline is known.
BASELINE_ITERATIONS = 3

# KL to the reference, per answer token (an answer's length does not move it). 5x the baseline: a policy that
# drifts steadily reaches a few times its early KL over a run; a collapse onto one answer multiplies it tenfold
# and more. The floor, 0.5 nats per token, because the early KL of a run that starts at its reference is ~0: a
# KL-penalised run (--kl_ctl 0.1, InstructGPT's) settles around a tenth of a nat per token, and 0.5 nats per token
# means the policy's tokens are on average e^0.5 = 1.65x likelier under it than under the reference: it has left
# the model it started as, whatever its reward says.
KL_FACTOR = 5.0
KL_FLOOR = 0.5
# The KL's acceleration, its second difference over iterations (nats per token per iteration^2): a healthy KL
# climbs at a roughly steady pace (second difference ~0 up to the batch's noise, a few hundredths at a KL of ~0.1),
# a collapse shows as a sudden steepening an iteration or two before the KL itself is high. Alarm where one
# iteration adds 2x the baseline KL, and at least 0.15 nats per token (several times that noise, under a third of
# the KL floor), more than the iteration before it added.
KL_ACCELERATION_FACTOR = 2.0
KL_ACCELERATION_FLOOR = 0.15
# Policy entropy per answer token: RL lowers it, a collapse sends it towards 0. 0.3x the baseline: a fall by 70%,
# past the halving a converging run shows. A baseline under 0.05 nats (a policy already near-deterministic, e.g.
# greedy-like sampling) has nothing left to fall from: not judged.
ENTROPY_FACTOR = 0.3
ENTROPY_MIN_BASELINE = 0.05
# Answer length (tokens): 2x longer (rambling, repetition loops, length hacking of a reward model that likes long
# answers) or 0.5x shorter (a stock short answer) than the run's own start.
LENGTH_HIGH_FACTOR = 2.0
LENGTH_LOW_FACTOR = 0.5
# The shares of the batch (answers cut at the limit, taken by the most common answer, copying an SFT answer):
# past one half where the baseline was under a fifth. A share that was already high at the start (answers cut by a
# short limit from the first iteration, a batch of one prompt) is the run's design, not a drift: not judged.
SHARE_LIMIT = 0.5
SHARE_BASELINE_MAX = 0.2
# Pearson correlation of the reward with the answer length over the batch's answers: above 0.8 the reward is
# mostly length (a reward model's length bias being exploited); judged where it was under 0.4 at the start.
CORRELATION_LIMIT = 0.8
CORRELATION_BASELINE_MAX = 0.4
# A reward component's share |weight x mean| / sum over components: one component taking nine tenths of the reward
# (a format reward while correctness stalls) after holding under 0.7 of it at the start. Only with 2+ components.
REWARD_SHARE_LIMIT = 0.9
REWARD_SHARE_BASELINE_MAX = 0.7
# The critic's explained variance of the returns (PPO), 1 - Var(returns - values) / Var(returns): alarm where the
# unexplained share doubled from its baseline and exceeds the whole (the critic worse than predicting the mean),
# i.e. below min(2 x baseline - 1, 0). Its advantages are then mostly noise.
# The explained variance is a ratio of two of one batch's variances: on a small batch one iteration can fall far
# below any bound and recover the next (-32.4 and -8.7, two iterations apart, in a healthy 12-iteration PPO run),
# while a critic that stopped predicting stays below. It alarms only past its bound this many judged iterations
# in a row (docs/ppo.md#health-alarms: the rule was written before it was tried).
PERSISTENT_SIGNALS = {"explained_variance": 2}
# The sampler-vs-trainer gap, KL(sampler || trainer) per token: ~0 where both compute alike (fp32), ~1e-3 for a bf16
# or compiled sampler; 5x its baseline and at least 0.01 nats per token means the sampler's weights or numerics
# drift from the trained ones and the update is off-policy.
SAMPLER_GAP_FACTOR = 5.0
SAMPLER_GAP_FLOOR = 0.01
# Distinct-2 (distinct bigrams / bigrams) over the batch's answers to different prompts: halved from the start, the
# answers repeat each other whatever the prompt.
DISTINCT_FACTOR = 0.5


class Bounds(NamedTuple):
    """A signal's alarm thresholds for one baseline: it alarms below low or above high (None: no bound)."""

    low: float | None
    high: float | None


class Rule(NamedTuple):
    """How a signal is judged: its bounds from a baseline, the rule as the log and the docs state it, the signal
    whose baseline it uses (None: its own), why a bound its baseline removes is not judged (off, formatted with
    baseline=), and whether the signal is an answer length (in_tokens: it lies between 1 token and the answer limit,
    so a bound outside that range cannot be passed)."""

    bounds: Callable[[float], Bounds]
    text: str
    baseline_of: str | None = None
    off: str = ""
    in_tokens: bool = False


def share_rule(limit: float, baseline_max: float, why_off: str) -> Rule:
    """A share (or correlation) judged above limit only where its baseline was under baseline_max."""
    return Rule(lambda baseline: Bounds(None, limit if baseline < baseline_max else None),
                f"> {limit:g} where the baseline was < {baseline_max:g}",
                off=f"its baseline {{baseline:.4g}} is not under {baseline_max:g}: {why_off}")


SHARE_OFF = "a share that high from the start is the run's design (a short answer limit, few prompts), not a drift"
RULES: dict[str, Rule] = {
    "kl": Rule(lambda b: Bounds(None, max(KL_FACTOR * b, KL_FLOOR)),
               f"> max({KL_FACTOR:g} x baseline, {KL_FLOOR:g})"),
    "kl_acceleration": Rule(lambda b: Bounds(None, max(KL_ACCELERATION_FACTOR * b, KL_ACCELERATION_FLOOR)),
                            f"> max({KL_ACCELERATION_FACTOR:g} x the KL's baseline, {KL_ACCELERATION_FLOOR:g})", "kl"),
    "entropy": Rule(lambda b: Bounds(ENTROPY_FACTOR * b if b >= ENTROPY_MIN_BASELINE else None, None),
                    f"< {ENTROPY_FACTOR:g} x baseline",
                    off=f"its baseline {{baseline:.4g}} is under {ENTROPY_MIN_BASELINE:g}: a policy near-deterministic "
                        "from the start has nothing left to fall from"),
    "response_length": Rule(lambda b: Bounds(LENGTH_LOW_FACTOR * b, LENGTH_HIGH_FACTOR * b),
                            f"< {LENGTH_LOW_FACTOR:g} x or > {LENGTH_HIGH_FACTOR:g} x baseline", in_tokens=True),
    "truncated_share": share_rule(SHARE_LIMIT, SHARE_BASELINE_MAX, SHARE_OFF),
    "reward_length_corr": share_rule(CORRELATION_LIMIT, CORRELATION_BASELINE_MAX,
                                     "a reward that followed the length from the start is the reward's design"),
    "reward_share": share_rule(REWARD_SHARE_LIMIT, REWARD_SHARE_BASELINE_MAX,
                               "a component that held most of the reward from the start is the reward's design"),
    "explained_variance": Rule(lambda b: Bounds(min(2 * b - 1, 0.0), None), "< min(2 x baseline - 1, 0)"),
    "sampler_gap": Rule(lambda b: Bounds(None, max(SAMPLER_GAP_FACTOR * b, SAMPLER_GAP_FLOOR)),
                        f"> max({SAMPLER_GAP_FACTOR:g} x baseline, {SAMPLER_GAP_FLOOR:g})"),
    "distinct_2": Rule(lambda b: Bounds(DISTINCT_FACTOR * b, None), f"< {DISTINCT_FACTOR:g} x baseline"),
    "top_answer_share": share_rule(SHARE_LIMIT, SHARE_BASELINE_MAX, SHARE_OFF),
    "sft_copy_share": share_rule(SHARE_LIMIT, SHARE_BASELINE_MAX, SHARE_OFF),
}


class AnswerLimit(NamedTuple):
    """The most tokens the stage samples per answer and the flag that sets it: no answer, so no mean length, passes
    it."""

    tokens: int
    flag: str


def rule_of(signal: str) -> Rule:
    """A signal's rule; reward_share/<component> signals share one."""
    return RULES[signal.split("/")[0]]


class Alarm(NamedTuple):
    """One signal past its threshold at one iteration: direction is "above" or "below"."""

    step: int
    iteration: int
    signal: str
    value: float
    threshold: float
    direction: str
    baseline: float

    def message(self) -> str:
        rule = rule_of(self.signal)
        whose = f"{rule.baseline_of}'s" if rule.baseline_of else "its"  # kl_acceleration is judged on the KL's
        return (f"health alarm at step {self.step} (iteration {self.iteration}): {self.signal} = {self.value:.4g}, "
                f"{self.direction} its threshold {self.threshold:.4g} ({self.signal} {rule.text}; baseline "
                f"{self.baseline:.4g}, the mean of {whose} first {BASELINE_ITERATIONS} values)")


def judged(signal: str, value: float, baseline: float, step: int, iteration: int) -> Alarm | None:
    """The alarm of one signal's value against the bounds of its baseline, or None."""
    low, high = rule_of(signal).bounds(baseline)
    if high is not None and value > high:
        return Alarm(step, iteration, signal, value, high, "above", baseline)
    if low is not None and value < low:
        return Alarm(step, iteration, signal, value, low, "below", baseline)
    return None


def unreachable_length_bounds(bounds: Bounds, limit: AnswerLimit | None) -> dict[str, str]:
    """{"above"/"below": why} for an answer length's bounds that no value can pass: a mean length lies between 1
    token (an answer holds at least its first token) and the answer limit."""
    unreachable = {}
    if bounds.high is not None and limit is not None and bounds.high >= limit.tokens:
        unreachable["above"] = (f"its bound above, {bounds.high:.4g} tokens, is not under the answer limit "
                                f"({limit.flag} {limit.tokens}), which no answer passes")
    if bounds.low is not None and bounds.low <= 1:
        unreachable["below"] = f"its bound below, {bounds.low:.4g} tokens, is not over 1 token, the shortest answer"
    return unreachable


def not_judged_reason(signal: str, baseline: float, limit: AnswerLimit | None) -> str | None:
    """Why a signal cannot alarm in a run with this baseline (its rule removes its bounds, or puts one where no value
    reaches), or None where it can. A length with one bound left says which direction is still judged."""
    rule = rule_of(signal)
    bounds = rule.bounds(baseline)
    if bounds.low is None and bounds.high is None:
        return rule.off.format(baseline=baseline)
    unreachable = unreachable_length_bounds(bounds, limit) if rule.in_tokens else {}
    if not unreachable:
        return None
    reasons = "; ".join(unreachable.values())
    if len(unreachable) == 2:
        return f"{reasons} (baseline {baseline:.4g})"
    kept = "below" if "above" in unreachable else "above"
    return f"{reasons} (baseline {baseline:.4g}): judged {kept} only"


class HealthMonitor:
    """The signals a stage has (names of RULES, reward_share/<component>), judged each iteration (observe) against
    the mean of the first BASELINE_ITERATIONS values of their own, or of the signal their rule names (baseline_of).
    answer_limit: the stage's most tokens per answer (a length bound past it cannot fire: not_judged). active: the
    alarms of the last iteration observed; alarms: every alarm so far. Its state travels in checkpoints
    (state_dict), so a resumed run judges as the uninterrupted one would."""

    def __init__(self, signals: Iterable[str], answer_limit: AnswerLimit | None = None) -> None:
        self.signals = list(signals)
        unknown = [signal for signal in self.signals if signal.split("/")[0] not in RULES]
        if unknown:
            raise ValueError(f"no health rule for {unknown}")
        self.answer_limit = answer_limit
        # The signals whose values make a baseline: those judged against their own, and those another's rule uses.
        borrowed = [source for source in (rule_of(signal).baseline_of for signal in self.signals) if source]
        self.baseline_sources = list(dict.fromkeys(
            [signal for signal in self.signals if rule_of(signal).baseline_of is None] + borrowed))
        self.baseline_values: dict[str, list[float]] = {}
        self.recent_kl: list[float] = []  # the KL of the last iterations, for its second difference
        self.streaks: dict[str, int] = {}  # PERSISTENT_SIGNALS: judged iterations in a row past the bound
        self.latest: dict[str, float] = {}  # the figures of the last iteration judged
        self.active: list[Alarm] = []
        self.alarms: list[Alarm] = []

    def baseline(self, signal: str) -> float | None:
        values = self.baseline_values.get(signal, [])
        return sum(values) / len(values) if len(values) == BASELINE_ITERATIONS else None

    def with_acceleration(self, figures: Mapping[str, float]) -> dict[str, float]:
        """figures plus kl_acceleration, the second difference of the KL over the last three iterations that had
        one in a row (an iteration without a KL starts the count again)."""
        figures = dict(figures)
        if "kl" not in figures:
            self.recent_kl = []
            return figures
        self.recent_kl = (self.recent_kl + [figures["kl"]])[-3:]
        if len(self.recent_kl) == 3 and "kl_acceleration" in self.signals:
            older, previous, latest = self.recent_kl
            figures["kl_acceleration"] = latest - 2 * previous + older
        return figures

    def add_to_baselines(self, figures: Mapping[str, float]) -> set[str]:
        """Each baseline still short of BASELINE_ITERATIONS values takes this iteration's; returns the signals that
        took one (not judged at this iteration). All are taken before any signal is judged, so a rule that uses
        another signal's baseline has it at the iteration that completes it."""
        taken = set()
        for name in self.baseline_sources:
            if name not in figures:
                continue
            values = self.baseline_values.setdefault(name, [])
            if len(values) < BASELINE_ITERATIONS:
                values.append(figures[name])
                taken.add(name)
        return taken

    def observe(self, step: int, iteration: int, figures: Mapping[str, float | None]) -> list[Alarm]:
        """Judge one iteration's figures (a figure the stage does not monitor, or not finite, is ignored): a
        signal's first BASELINE_ITERATIONS values make its baseline; each later value alarms past its bounds; a
        signal with another's baseline is judged from its first value on, once that baseline is known."""
        finite = {name: float(value) for name, value in figures.items()
                  if value is not None and math.isfinite(value)}
        judged_figures = self.with_acceleration(finite)
        self.latest = {name: value for name, value in judged_figures.items() if name in self.signals}
        in_baseline = self.add_to_baselines(judged_figures)
        alarms = []
        for signal in self.signals:
            if signal not in judged_figures or signal in in_baseline:
                continue
            baseline = self.baseline(rule_of(signal).baseline_of or signal)
            alarm = None if baseline is None else judged(signal, judged_figures[signal], baseline, step, iteration)
            persisting = self.persisted(signal, alarm)
            if persisting is not None:
                alarms.append(persisting)
        self.record(alarms)
        return alarms

    def persisted(self, signal: str, alarm: Alarm | None) -> Alarm | None:
        """alarm where its signal needs no persistence or has now been past its bound PERSISTENT_SIGNALS[signal]
        judged iterations in a row; None otherwise (the streak counted)."""
        needed = PERSISTENT_SIGNALS.get(signal, 1)
        self.streaks[signal] = self.streaks.get(signal, 0) + 1 if alarm is not None else 0
        return alarm if self.streaks[signal] >= needed else None

    def record(self, alarms: list[Alarm]) -> None:
        """alarms as the verdict of the latest iteration (the one every process takes: rank 0's)."""
        self.active = list(alarms)
        self.alarms.extend(alarms)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps. not_judged is no state: it follows from the baselines and the answer limit."""
        return {"baseline_values": self.baseline_values, "recent_kl": self.recent_kl, "streaks": self.streaks,
                "latest": self.latest,
                "active": [alarm._asdict() for alarm in self.active],
                "alarms": [alarm._asdict() for alarm in self.alarms]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # A checkpoint from before kl_acceleration was judged against the KL's baseline holds values of its own
        # baseline: nothing uses them any more (the resumed run judges it from its next value on, docs/ppo.md).
        self.baseline_values = {name: list(values) for name, values in state["baseline_values"].items()
                                if name.split("/")[0] not in RULES or rule_of(name).baseline_of is None}
        self.recent_kl = list(state["recent_kl"])
        # A checkpoint from before the persistence rule has no streaks: they count from the resume (docs/ppo.md).
        self.streaks = dict(state.get("streaks", {}))
        self.latest = dict(state["latest"])
        self.active = [Alarm(**alarm) for alarm in state["active"]]
        self.alarms = [Alarm(**alarm) for alarm in state["alarms"]]

    def baselines(self) -> dict[str, float]:
        """{signal: the baseline its rule compares with} (kl_acceleration's is the KL's), once it is known."""
        known = {signal: self.baseline(rule_of(signal).baseline_of or signal) for signal in self.signals}
        return {signal: value for signal, value in known.items() if value is not None}

    def not_judged(self) -> dict[str, str]:
        """{signal: why it cannot alarm in this run} for each signal whose baseline is known and leaves it no bound
        a value can pass (or, for a length, says which direction it is still judged in)."""
        reasons = {signal: not_judged_reason(signal, baseline, self.answer_limit)
                   for signal, baseline in self.baselines().items()}
        return {signal: reason for signal, reason in reasons.items() if reason is not None}


class StoppedByAlarm(ReportedError):
    """--stop_on_alarm: a health alarm ended the run; the published adapter is the last one saved without an
    alarm (conventions: exit status 4, never resumed by the pipeline unless told with --from_stage)."""

    exit_status = 4


# -- figures the stages do not log elsewhere ---------------------------------------------


class PairMoments(NamedTuple):
    """Weighted means of x, y, x^2, y^2 and x*y over some rows or tokens (their sums reduced over every process with
    the other statistics), from which a correlation or an explained variance follows."""

    x: float
    y: float
    xx: float
    yy: float
    xy: float

    def variance_x(self) -> float:
        return max(self.xx - self.x ** 2, 0.0)

    def variance_y(self) -> float:
        return max(self.yy - self.y ** 2, 0.0)

    def correlation(self) -> float | None:
        """Pearson's r of x and y; None where either is constant (no correlation to speak of)."""
        spread = math.sqrt(self.variance_x() * self.variance_y())
        return None if spread < 1e-12 else max(-1.0, min(1.0, (self.xy - self.x * self.y) / spread))

    def explained_variance(self) -> float | None:
        """1 - Var(y) / Var(x) for x the critic's targets and y its errors (targets - values); None where the
        targets are constant."""
        variance = self.variance_x()
        return None if variance < 1e-12 else 1.0 - self.variance_y() / variance


MOMENT_PARTS = PairMoments._fields


def moment_sums(x: "torch.Tensor", y: "torch.Tensor", weights: "torch.Tensor") -> dict[str, float]:
    """{part: the weighted sum} of PairMoments' parts for tensors x, y and weights of one shape; each is added to a
    SumStats with weights.sum() as its count, so that the reduced statistic is the weighted mean."""
    x, y, weights = x.double(), y.double(), weights.double()
    parts = {"x": x, "y": y, "xx": x * x, "yy": y * y, "xy": x * y}
    return {name: (values * weights).sum().item() for name, values in parts.items()}


def pop_moments(metrics: dict[str, float], prefix: str) -> PairMoments:
    """The PairMoments reduced as prefix/<part>, removed from metrics (they are no figure to log)."""
    return PairMoments(*(metrics.pop(f"{prefix}/{name}") for name in MOMENT_PARTS))


class Diversity(NamedTuple):
    """answer_diversity's figures (None where the batch cannot tell)."""

    distinct_2: float | None
    top_answer_share: float | None


def distinct_ngrams(answers: Sequence[Sequence[int]], n: int = 2) -> float | None:
    """Distinct n-grams / n-grams over the answers' token ids (Li et al. 2016's distinct-n); None without any."""
    grams = [tuple(answer[i:i + n]) for answer in answers for i in range(len(answer) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def answer_diversity(answers: Sequence[Sequence[int]], group_size: int) -> Diversity:
    """How alike the answers to different prompts are; answers come in groups of group_size consecutive answers to
    one prompt (1 for PPO). Within a group answers may rightly agree (GRPO converging on the right one), so both
    figures compare across prompts only: distinct-2 over the k-th answers of every group, averaged over k, and the
    share of the groups (prompts) whose answers include the batch's most common answer."""
    groups = [answers[start:start + group_size] for start in range(0, len(answers), group_size)]
    if not groups:
        return Diversity(None, None)
    per_position = [distinct_ngrams([group[k] for group in groups if k < len(group)]) for k in range(group_size)]
    measured = [value for value in per_position if value is not None]
    counts = Counter(answer for group in groups for answer in {tuple(member) for member in group})
    return Diversity(sum(measured) / len(measured) if measured else None, max(counts.values()) / len(groups))


def normalized_answer(text: str) -> str:
    """An answer as compared with the SFT answers: whitespace runs as one space, no edge spaces."""
    return " ".join(text.split())


def read_sft_answers(path: str | None) -> frozenset[str] | None:
    """--sft_answers_file: every assistant turn of the SFT records in a .json/.jsonl file (or a directory of them),
    normalized; None without the flag. Bad records are refused as the SFT stage refuses them (file:line)."""
    if not path:
        return None
    files = find_record_files(path, None) if os.path.isdir(path) else find_record_files(None, [path])
    answers: set[str] = set()
    for file in files:
        for line, record in read_records(file):
            messages = conversation_of(f"{file}:{line}", record)
            answers.update(normalized_answer(str(m.get("content") or "")) for m in messages if m["role"] == "assistant")
    answers.discard("")
    if not answers:
        raise InputError(f"{path}: --sft_answers_file holds no answer to compare the rollouts with")
    return frozenset(answers)
