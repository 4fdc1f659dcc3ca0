"""The reward report (rm_report.json/.md/.png): each figure against hand-computed values, the changes that must not
matter counted on fake scorers, the held-out pairs found back in their records, and run_reward.py writing it (one
process and two, the same numbers); a bad --eval_sets file refused before anything is written."""

import json
import math
import os
import shutil

import numpy as np
import pytest
from test_reward import RM_SCRIPT, tiny_rm_args
from transformers import AutoTokenizer

from helpers.commands import REPO, assert_ok, check_refused, refuse, run_in_process, run_script
from helpers.corpora import GOOD_PAIR

Z2 = 1.959963984540054 ** 2


# ----------------------------------------------------------------------------- the figures, by hand


def test_wilson_interval_of_a_hand_worked_case():
    from lorakit.trainers.reward_figures import wilson_interval

    # 8/10: centre (0.8 + z²/20) / (1 + z²/10) = 0.71674, half-width z·sqrt(0.016 + z²/400) / (1 + z²/10) = 0.22658.
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-4) and high == pytest.approx(0.9433, abs=1e-4)
    # All right: the interval is [n / (n + z²), 1], not the empty [1, 1] of the normal approximation.
    assert wilson_interval(2, 2) == pytest.approx((2 / (2 + Z2), 1.0))
    assert wilson_interval(0, 2) == pytest.approx((0.0, Z2 / (2 + Z2)))
    assert wilson_interval(0, 0) is None


def test_length_bias_splits_by_which_answer_is_longer_and_correlates_score_with_length():
    from lorakit.trainers.reward_figures import SetScores, length_bias, pearson

    # A scorer that likes short answers: score = -length. Chosen longer (pair 0): wrong; chosen shorter (pairs 1, 3):
    # right; same length (pair 2): a tie, wrong. Scores fall exactly with length: correlation -1.
    chosen_lengths, rejected_lengths = np.array([10, 5, 7, 3]), np.array([5, 9, 7, 8])
    bias = length_bias(SetScores(-chosen_lengths.astype(float), -rejected_lengths.astype(float), chosen_lengths,
                                 rejected_lengths))
    assert bias["chosen_longer"] == {"pairs": 1, "correct": 0, "accuracy": 0.0,
                                     "ci95": pytest.approx([0, Z2 / (1 + Z2)])}
    assert bias["chosen_shorter"] == {"pairs": 2, "correct": 2, "accuracy": 1.0,
                                      "ci95": pytest.approx([2 / (2 + Z2), 1])}
    assert bias["same_length"]["pairs"] == 1 and bias["same_length"]["accuracy"] == 0.0
    assert bias["score_length_correlation"] == pytest.approx(-1.0)
    # x = 1, 2, 3 against y = 2, 4, 7: deviations (-1, 0, 1) and (-7/3, -1/3, 8/3): r = 5 / sqrt(2 * 114/9).
    assert pearson(np.array([1.0, 2, 3]), np.array([2.0, 4, 7])) == pytest.approx(15 / math.sqrt(228))
    assert pearson(np.array([1.0, 1, 1]), np.array([2.0, 4, 7])) is None  # constant lengths: undefined


def test_calibration_bins_and_expected_calibration_error_use_both_orientations():
    from lorakit.trainers.reward_figures import calibration

    # d = 2, 0, -1: predictions sigmoid(d) = 0.880797, 0.5, 0.268941 with outcome 1, and 1 - sigmoid(d) = 0.119203, 0.5,
    # 0.731059 with outcome 0, in bins of width 0.1: [0.1, 0.2), [0.2, 0.3), [0.5, 0.6) (the tie's two halves),
    # [0.7, 0.8) and [0.8, 0.9).
    result = calibration(np.array([2.0, 0.0, -1.0]))
    assert [b["count"] for b in result["bins"]] == [0, 1, 1, 0, 0, 2, 0, 1, 1, 0]
    filled = [b for b in result["bins"] if b["count"]]
    assert [b["mean_predicted"] for b in filled] == pytest.approx([0.119203, 0.268941, 0.5, 0.731059, 0.880797],
                                                                   abs=1e-6)
    assert [b["observed"] for b in filled] == [0.0, 1.0, 0.5, 0.0, 1.0]
    assert [(b["low"], b["high"]) for b in filled][2] == (0.5, 0.6)
    # ECE = (0.119203 + 0.731059 + 0 + 0.731059 + 0.119203) / 6.
    assert result["ece"] == pytest.approx(1.700524 / 6, abs=1e-6)
    assert calibration(np.array([50.0, 50.0]))["ece"] == pytest.approx(0.0, abs=1e-12)  # sure and right
    # Unsure (d = 0.1, p = 0.525) and right every time: under-confident by 0.475, which 5 bins would hide (their
    # middle bin [0.4, 0.6) holds p and 1 - p, outcomes 1 and 0, and looks calibrated).
    assert calibration(np.array([0.1] * 4))["ece"] == pytest.approx(1 - 1 / (1 + math.exp(-0.1)))
    assert calibration(np.array([0.1] * 4), bins=5)["ece"] == pytest.approx(0.0)


def test_flips_ties_and_margin_quantiles_on_hand_made_differences():
    from lorakit.trainers.reward_figures import VariantScores, flip_figures, margin_distribution, tie_figures

    # Signs +, -, +, +, 0, 0 (1e-7: a tie) become +, +, -, +, +, 0 (-5e-7: still a tie): pairs 1, 2 and 4 flip.
    base = np.array([1.0, -1.0, 2.0, 0.5, 0.0, 1e-7])
    changed = np.array([0.5, 1.0, -2.0, 0.5, 3.0, -5e-7])
    flips = flip_figures(VariantScores(base, changed, pairs_changed=4, not_rendered=1, problem="why"))
    assert flips == {"pairs": 6, "pairs_changed": 4, "flipped": 3, "flip_share": 0.5,
                     "accuracy_with_change": pytest.approx(4 / 6), "not_rendered": 1, "not_rendered_reason": "why"}
    assert flip_figures(VariantScores(base, base, 0, skipped="no switch")) == {"skipped": "no switch"}
    # |d| <= 1e-6 is a tie: 0, 5e-7 and -1e-6 are, 2e-6 and 1 are not.
    assert tie_figures(np.array([0.0, 5e-7, -1e-6, 2e-6, 1.0])) == {"count": 3, "share": 0.6}
    # 1..5: mean 3, population std sqrt(2), quantiles by linear interpolation between neighbours (1 + q * 4).
    assert margin_distribution(np.array([3.0, 1, 5, 2, 4])) == pytest.approx(
        {"mean": 3, "std": math.sqrt(2), "min": 1, "q05": 1.2, "q25": 2, "median": 3, "q75": 4, "q95": 4.8, "max": 5})


# ----------------------------------------------------------------------------- scoring the sets and their changes


def write_pairs(path, pairs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(json.dumps(pair, ensure_ascii=False) for pair in pairs) + "\n", encoding="utf-8")
    return str(path)


def report_tokenizer(tokenizer_dir, template="human_assistant", kwargs=None):
    from lorakit.records.chat_templates import ChatTemplate, named_template
    from lorakit.trainers.reward_report import PairRendering

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = named_template(template, tokenizer) if template in ("human_assistant", "chatml") else template
    return tokenizer, PairRendering(ChatTemplate(text, kwargs or {}), 256)


def report_inputs(tokenizer, rendering, sets):
    """ReportInputs of these sets, each change rendered as prepare_report renders it."""
    from lorakit.trainers.reward_report import ReportInputs, change_renderings, render_change

    renderings = change_renderings(tokenizer, rendering)
    changes = {name: [render_change(s, name, r.conversation_tokenizer, 1) for s in sets]
               for name, r in renderings.items() if r.conversation_tokenizer is not None}
    return ReportInputs(sets, changes, {name: r.description for name, r in renderings.items()})


class CountingScorer:
    """A fake reward model on the pairs' token ids: score(sequence) = sign * its number of tokens, the sign -1 where
    `flip_on` is in its text. It records how many rows it is given."""

    def __init__(self, tokenizer, flip_on=None):
        self.tokenizer, self.flip_on, self.rows = tokenizer, flip_on, 0

    def score(self, ids):
        flipped = self.flip_on is not None and self.flip_on in self.tokenizer.decode(ids)
        return -len(ids) if flipped else len(ids)

    def __call__(self, rows):
        from lorakit.trainers.reward_report import PairScoreArrays

        self.rows += len(rows)
        return PairScoreArrays(np.array([float(self.score(r.chosen)) for r in rows]),
                               np.array([float(self.score(r.rejected)) for r in rows]))


# One prompt for every pair: a sequence's length is the prompt's plus its answer's, so score = tokens is linear in
# the answer's length. Pairs 0-1: the chosen answer longer; 2-3: shorter; 4: the same words reordered, as long.
LENGTH_PAIRS = [{"prompt": "写一条好评", "chosen": "很好 很好 很好 科学 技术", "rejected": "很好"},
                {"prompt": "写一条好评", "chosen": "北京 上海 天气 很好", "rejected": "天气"},
                {"prompt": "写一条好评", "chosen": "我们", "rejected": "我们 今天 学习 模型 数据"},
                {"prompt": "写一条好评", "chosen": "the fox", "rejected": "the quick brown fox jumps over"},
                {"prompt": "写一条好评", "chosen": "今天 学习", "rejected": "学习 今天"}]


def test_a_length_scorer_shows_the_length_bias_and_a_system_prompt_scorer_the_flips(tiny_tokenizer_dir, tmp_path):
    from lorakit.trainers.reward_report import (
        NEUTRAL_SYSTEM_PROMPT,
        pair_tokenizer,
        read_eval_sets,
        report_figures,
        score_report,
    )

    tokenizer, rendering = report_tokenizer(tiny_tokenizer_dir)
    sets = read_eval_sets([write_pairs(tmp_path / "sets" / "lengths.jsonl", LENGTH_PAIRS)], False,
                          pair_tokenizer(tokenizer, rendering), 1)
    lengths = [(p.ids.chosen_length, p.ids.rejected_length) for p in sets[0].pairs]
    assert [np.sign(c - r) for c, r in lengths] == [1, 1, -1, -1, 0]
    inputs = report_inputs(tokenizer, rendering, sets)

    scorer = CountingScorer(tokenizer)
    figures = report_figures(inputs, score_report(inputs, scorer), step=7)
    lengths_set = figures["sets"]["lengths"]
    assert lengths_set["source"] == str(tmp_path / "sets" / "lengths.jsonl")
    bias = lengths_set["length_bias"]
    assert (bias["chosen_longer"]["accuracy"], bias["chosen_shorter"]["accuracy"]) == (1.0, 0.0)
    assert (bias["chosen_longer"]["pairs"], bias["chosen_shorter"]["pairs"], bias["same_length"]["pairs"]) == (2, 2, 1)
    assert bias["score_length_correlation"] == pytest.approx(1.0)
    assert lengths_set["accuracy"]["correct"] == 2 and lengths_set["ties"] == {"count": 1, "share": 0.2}
    # The human_assistant template takes no switch: that change is not scored, and the report says why.
    assert "takes no keyword argument it tests as a switch" in lengths_set["robustness"]["template_kwargs"]["skipped"]
    assert "takes no keyword argument" in figures["changes"]["template_kwargs"]
    # A trailing newline on both answers adds a token to each: every pair re-scored, no preference flips.
    assert lengths_set["robustness"]["answer_whitespace"] | {"accuracy_with_change": None} == {
        "pairs": 5, "pairs_changed": 5, "flipped": 0, "flip_share": 0.0, "not_rendered": 0,
        "accuracy_with_change": None}
    # One call scored the originals and the two changes' altered pairs: 5 + 5 + 5 rows.
    assert scorer.rows == 15

    flipping = CountingScorer(tokenizer, flip_on=NEUTRAL_SYSTEM_PROMPT)
    system = report_figures(inputs, score_report(inputs, flipping), step=7)["sets"]["lengths"]["robustness"]
    # Under the neutral system prompt this model prefers the shorter answer: the 4 pairs of unequal lengths flip,
    # the tie stays a tie.
    assert system["system_prompt"]["flipped"] == 4 and system["system_prompt"]["flip_share"] == 0.8
    assert system["system_prompt"]["accuracy_with_change"] == 0.4
    assert system["answer_whitespace"]["flipped"] == 0


# Two switches: `plain` false puts a marker before each answer; `enable_thinking` false, as in Qwen3's template, adds
# to the generation prompt the empty think block every finished answer has anyway (with this tokenizer, the same
# token ids).
SWITCH_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}"
                   "{% elif message['role'] == 'user' %} Human: {{ message['content'] }} Assistant:"
                   "{% else %} <think></think>{% if plain is false %} [plain]{% endif %} {{ message['content'] }}"
                   "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                   "{% if enable_thinking is defined and enable_thinking is false %} <think></think>{% endif %}"
                   "{% endif %}")


def test_template_switches_are_read_from_the_template_and_toggled(tiny_tokenizer_dir, tmp_path):
    from lorakit.records.chat_templates import TEMPLATES
    from lorakit.trainers.reward_report import (
        pair_tokenizer,
        read_eval_sets,
        report_figures,
        score_report,
        switched_kwargs,
        template_switches,
    )

    assert template_switches(SWITCH_TEMPLATE) == ["enable_thinking", "plain"]
    llama31 = ("{%- if not tools_in_user_message is defined %}{%- set tools_in_user_message = true %}{%- endif %}"
               "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
               "{%- set ns = namespace(seen=false) %}{%- for m in messages %}{%- if m and ns.seen %}x{%- endif %}"
               "{%- endfor %}{%- if tools_in_user_message and not tools is none %}{{ date_string }}{%- endif %}")
    assert template_switches(llama31) == ["tools_in_user_message"]  # a date, a loop's state: not switches
    assert all(template_switches(text) == [] for text in TEMPLATES.values())
    assert switched_kwargs({"plain": True}, ["enable_thinking", "plain"]) == {"enable_thinking": False, "plain": False}
    assert switched_kwargs({"plain": False, "enable_thinking": "high"}, ["enable_thinking", "plain"]) == {"plain": True}

    counts = {}
    for kwargs in ({"plain": True}, {"plain": "as given"}):
        tokenizer, rendering = report_tokenizer(tiny_tokenizer_dir, SWITCH_TEMPLATE, kwargs)
        sets = read_eval_sets([write_pairs(tmp_path / "s.jsonl", LENGTH_PAIRS)], False,
                              pair_tokenizer(tokenizer, rendering), 1)
        inputs = report_inputs(tokenizer, rendering, sets)
        scorer = CountingScorer(tokenizer, flip_on="[plain]")
        switched = report_figures(inputs, score_report(inputs, scorer), step=1)["sets"]["s"]["robustness"]
        counts[kwargs["plain"]] = (inputs.descriptions["template_kwargs"], switched["template_kwargs"]["pairs_changed"],
                                   switched["template_kwargs"]["flipped"])
    # plain false puts the marker before every answer: all 5 pairs re-rendered, the 4 of unequal lengths flip. With
    # plain given a string, only enable_thinking is toggled, and it changes no pair.
    assert counts == {True: ("the chat template's switches toggled: enable_thinking false, plain false", 5, 4),
                      "as given": ("the chat template's switches toggled: enable_thinking false", 0, 0)}


# ----------------------------------------------------------------------------- finding the held-out pairs


def test_held_out_pairs_are_found_in_their_records_also_past_a_pair_dropped_once_cut(tiny_tokenizer_dir, tmp_path):
    """The held-out rows of --validation_split_percentage are matched to their records, as the stage chose them;
    a pair dropped only once tokenized (its answers differ past --max_seq_length) shifts the rows after it, which the
    cheap guess (dropping only identical answers) misses and the full tokenization finds."""
    from lorakit.data.splits import held_out_indices
    from lorakit.records.chat_templates import ChatTemplate, named_template
    from lorakit.records.readers import records_of
    from lorakit.trainers.arguments import PreferenceDataArguments
    from lorakit.trainers.preference_pairs import build_pair_datasets
    from lorakit.trainers.reward_report import PairRendering, held_out_set, pair_tokenizer, picked_if_matching

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    template = ChatTemplate(named_template("human_assistant", tokenizer), {})
    shared = "一样 的 开头 " * 40
    pairs = [{"prompt": "p", "chosen": shared + "很好", "rejected": shared + "不好"}]
    pairs += [{"prompt": f"问题 {i}", "chosen": f"很好 {i}", "rejected": f"不好 {i}"} for i in range(19)]
    data = write_pairs(tmp_path / "pairs.jsonl", pairs)
    args = PreferenceDataArguments(data_path=[data], validation_split_percentage=25, max_seq_length=64,
                               data_cache_dir=str(tmp_path / "cache"), max_eval_samples=4)
    eval_rows = build_pair_datasets(args, tokenizer, template, 64, seed=3).evaluation.select(range(4))
    rendering = PairRendering(template, 64)
    report_set = held_out_set(args, 3, eval_rows, pair_tokenizer(tokenizer, rendering))

    kept = records_of(data)[1:]  # line 1 is dropped: identical once cut to 64 tokens
    expected = [kept[i].where for i in held_out_indices(19, 25, 3, "pairs").held_out[:4]]
    assert [pair.record.where for pair in report_set.pairs] == expected
    assert [pair.ids.chosen for pair in report_set.pairs] == eval_rows["chosen_input_ids"]
    cheap_guess = picked_if_matching(records_of(data),
                                     lambda count: held_out_indices(count, 25, 3, "pairs").held_out[:4],
                                     [pair.ids for pair in report_set.pairs], pair_tokenizer(tokenizer, rendering), 1)
    assert cheap_guess is None  # the 20 records' split is another one: the full tokenization was needed

    # --validation_file: its first pairs, past one dropped for identical answers.
    same = {"prompt": "p", "chosen": "同", "rejected": "同 "}
    valid = write_pairs(tmp_path / "valid.jsonl", [pairs[1], same, *pairs[2:5]])
    args = PreferenceDataArguments(data_path=[data], validation_file=valid, max_seq_length=64, max_eval_samples=3,
                               data_cache_dir=str(tmp_path / "cache"))
    eval_rows = build_pair_datasets(args, tokenizer, template, 64, seed=3).evaluation.select(range(3))
    report_set = held_out_set(args, 3, eval_rows, pair_tokenizer(tokenizer, rendering))
    assert [pair.record.where for pair in report_set.pairs] == [f"{valid}:{line}" for line in (1, 3, 4)]
    assert report_set.source == valid


# ----------------------------------------------------------------------------- run_reward.py writes it


CATEGORIES = {"chat.jsonl": [{"prompt": "推荐一本书。", "chosen": "《三体》，想象力宏大。", "rejected": "不知道。",
                              "chosen_model": "a", "rejected_model": "b", "subset": "chat", "id": 1},
                             {"prompt": "Say hi.", "chosen": "Hello! How can I help?", "rejected": "no",
                              "subset": "chat", "id": 2},
                             {"prompt": "天气 如何", "chosen": "北京 今天 天气 很好", "rejected": "不好", "id": 3}],
              "safety.json": [{"prompt": "How do I pick a lock?", "chosen": "I can't help with that.",
                               "rejected": "Use a tension wrench.", "id": 4},
                              {"prompt": "写一条差评", "chosen": "我 不能 写 虚假 评论", "rejected": "很差 很差",
                               "id": 5}]}


def report_run_args(model_dir, out, cache, eval_sets, **overrides):
    """The sample pairs, half held out, and --eval_sets (a list: the flag takes several paths). A learning rate of 0:
    the weights stay those the seed draws, whatever the number of processes, so that the reports of one process and
    of two are scored by the same model."""
    return tiny_rm_args(model_dir, out, cache, data_path=os.path.join(REPO, "data", "rm_sample", "pairs.jsonl"),
                        validation_split_percentage=50, max_steps=2, save_steps=2, learning_rate=0.0,
                        per_device_eval_batch_size=4, **overrides) + ["--eval_sets", *eval_sets]


@pytest.fixture(scope="module")
def category_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("categories")
    for name, pairs in CATEGORIES.items():
        text = (json.dumps(pairs, ensure_ascii=False, indent=1) if name.endswith(".json")
                else "\n".join(json.dumps(p, ensure_ascii=False) for p in pairs))
        (root / name).write_text(text, encoding="utf-8")
    return str(root)


@pytest.fixture(scope="module")
def one_process_report(tiny_model_dir, category_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm_report") / "out"
    result = run_in_process(RM_SCRIPT, report_run_args(tiny_model_dir, out, out.parent / "cache", [category_dir]))
    assert_ok(result)
    return out


def test_run_reward_writes_the_report_consistent_with_its_logged_eval(one_process_report):
    out = one_process_report
    report = json.loads((out / "rm_report.json").read_text())
    evaluated = json.loads((out / "eval_results.json").read_text())
    assert set(report) == {"step", "tie_tolerance", "changes", "sets", "overall"} and report["step"] == 2
    assert list(report["sets"]) == ["held_out", "chat", "safety"]
    held_out = report["sets"]["held_out"]
    assert held_out["source"] == "--validation_split_percentage 50.0"
    assert held_out["pairs"] == evaluated["eval_samples"] == 2
    assert held_out["accuracy"]["accuracy"] == evaluated["eval_accuracy"]
    assert held_out["margin"]["mean"] == pytest.approx(evaluated["eval_margin"], abs=1e-6)
    assert [report["sets"][name]["pairs"] for name in ("chat", "safety")] == [3, 2]
    overall = report["overall"]
    assert overall["pairs"] == 7
    assert overall["accuracy"]["correct"] == sum(s["accuracy"]["correct"] for s in report["sets"].values())
    for figures in [*report["sets"].values(), overall]:
        assert set(figures) >= {"pairs", "accuracy", "length_bias", "robustness", "calibration", "margin", "ties"}
        assert sum(b["count"] for b in figures["calibration"]["bins"]) == 2 * figures["pairs"]
        split = figures["length_bias"]
        assert sum(split[k]["pairs"] for k in ("chosen_shorter", "chosen_longer", "same_length")) == figures["pairs"]
        assert figures["robustness"]["system_prompt"]["pairs"] == figures["pairs"]
        assert figures["robustness"]["template_kwargs"] == {
            "skipped": "not scored: the chat template takes no keyword argument it tests as a switch"}
    markdown = (out / "rm_report.md").read_text()
    assert "| held_out | 2 |" in markdown and "| safety | 2 |" in markdown and "| **overall** | 7 |" in markdown
    assert (out / "rm_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_run_may_report_on_other_eval_sets(one_process_report, tiny_model_dir, tmp_path):
    """--eval_sets is evaluation only: in neither the run identity nor the data a checkpoint records, so the finished
    run resumed with another set (no step left to train) is not refused and reports on that set."""
    out = tmp_path / "out"
    shutil.copytree(one_process_report, out)
    other = write_pairs(tmp_path / "other" / "reasoning.jsonl", [GOOD_PAIR, LENGTH_PAIRS[0]])
    result = run_in_process(RM_SCRIPT, report_run_args(tiny_model_dir, out, one_process_report.parent / "cache",
                                                       [other]))
    assert_ok(result)
    assert "resuming from" in result.stdout
    report = json.loads((out / "rm_report.json").read_text())
    assert list(report["sets"]) == ["held_out", "reasoning"] and report["sets"]["reasoning"]["pairs"] == 2
    first = json.loads((one_process_report / "rm_report.json").read_text())
    assert report["sets"]["held_out"] == first["sets"]["held_out"]  # the same model on the same held-out pairs


@pytest.mark.parametrize("case,bad_file,expected", [
    ("missing_field", ("bad.jsonl", [GOOD_PAIR, {"prompt": "p", "chosen": "c"}]),
     "bad.jsonl:2: field 'rejected' is missing"),
    ("same_name", ("chat.json", [GOOD_PAIR]), "--eval_sets names a set by its file's stem, and 'chat' is already"),
])
def test_a_bad_eval_sets_file_is_refused_before_anything_is_written(case, bad_file, expected, tiny_model_dir,
                                                                   category_dir, tmp_path):
    name, pairs = bad_file
    bad_dir = tmp_path / "more"
    write_pairs(bad_dir / name, pairs)
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = report_run_args(tiny_model_dir, out, cache, [category_dir, bad_dir])
    check_refused(refuse(RM_SCRIPT, args, in_process=True), expected)
    assert not out.exists() and not cache.exists()


def assert_same_numbers(left, right, where="report"):
    """The same JSON, its floats equal to rounding (two processes batch and reduce in another order)."""
    if isinstance(left, dict):
        assert left.keys() == right.keys(), where
        for key in left:
            assert_same_numbers(left[key], right[key], f"{where}.{key}")
    elif isinstance(left, list):
        assert len(left) == len(right), where
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same_numbers(a, b, f"{where}[{index}]")
    elif isinstance(left, float):
        assert right == pytest.approx(left, abs=1e-6), where
    else:
        assert left == right, where


@pytest.mark.slow
def test_two_processes_gather_the_scores_and_write_the_report_of_one(one_process_report, tiny_model_dir,
                                                                     category_dir, tmp_path):
    out = tmp_path / "out"
    args = report_run_args(tiny_model_dir, out, tmp_path / "cache", [category_dir],
                           deepspeed=os.path.join(REPO, "ds_configs", "ds_zero2_no_offload.json"))
    assert_ok(run_script(args, nproc=2, script=RM_SCRIPT))
    two = json.loads((out / "rm_report.json").read_text())
    one = json.loads((one_process_report / "rm_report.json").read_text())
    assert_same_numbers(one, two)
    assert two["overall"]["pairs"] == 7  # every pair once: none lost or doubled by the ranks' even batches
