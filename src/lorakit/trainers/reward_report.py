"""What the reward model learned, written by run_reward.py at the end of training: OUT/rm_report.json, a markdown
table (rm_report.md) and a plot (rm_report.png), on the held-out pairs (the run's eval set) and on each file of
--eval_sets (a set named by its file's stem). The figures are lorakit.trainers.reward_figures'; the scores are the
Trainer's own (its evaluation loop: RewardTrainer.prediction_step, the stage's collator and pair layout, gathered
from every rank), so the held-out accuracy is the logged eval_accuracy.

Three changes that must not change a preference are scored on the same pairs: a neutral system prompt, the chat
template's switches toggled (Qwen3's enable_thinking), and a newline after each answer. Only the pairs whose token
ids a change alters are scored again; the others keep their scores."""

import io
import logging
import os
import re
from collections.abc import Callable
from glob import glob
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from datasets import Dataset
from jinja2 import Environment, TemplateSyntaxError, meta, nodes
from torch.utils.data import DataLoader
from tqdm import tqdm

from lorakit.core.atomic import write_atomically, write_json_atomically
from lorakit.core.cli import InputError
from lorakit.data.build_dataset import ROWS_PER_SHARD, map_shards, shards_of, tokenize_pair_shard
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.splits import held_out_indices, phase_part
from lorakit.records.readers import (
    RECORD_SUFFIXES,
    LocatedRecord,
    Message,
    find_record_files,
    preference_of,
    records_of,
)
from lorakit.trainers.checkpoints import output_dir_of
from lorakit.trainers.preference_pairs import PairRendering
from lorakit.trainers.reward_figures import TIE_TOLERANCE, SetScores, VariantScores, set_figures

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, Trainer

    from lorakit.trainers.arguments import PreferenceDataArguments

logger = logging.getLogger(__name__)

HELD_OUT = "held_out"
REPORT_FILES = ("rm_report.json", "rm_report.md", "rm_report.png")
NEUTRAL_SYSTEM_PROMPT = "You are a helpful assistant."
ANSWER_SUFFIX = "\n"
SYSTEM_PROMPT, TEMPLATE_SWITCHES, ANSWER_WHITESPACE = "system_prompt", "template_kwargs", "answer_whitespace"
CHANGES = {
    SYSTEM_PROMPT: f"a system turn {NEUTRAL_SYSTEM_PROMPT!r} first (before the text of a system turn the pair has)",
    TEMPLATE_SWITCHES: "the chat template's switches toggled",
    ANSWER_WHITESPACE: f"{ANSWER_SUFFIX!r} appended to both answers",
}


class PairIds(NamedTuple):
    """A pair's token ids as the reward stage tokenizes it, and each answer's length in tokens (through its turn
    end)."""

    chosen: list[int]
    rejected: list[int]
    chosen_length: int
    rejected_length: int


class ReportPair(NamedTuple):
    """A pair of a set: its token ids, and its record (None where it could not be found: no change is scored)."""

    ids: PairIds
    record: LocatedRecord | None


class ReportSet(NamedTuple):
    name: str
    source: str  # the file, or the flag that held the pairs out
    pairs: list[ReportPair]


class RenderedPair(NamedTuple):
    """A record tokenized: its ids, None where the reward stage drops it (identical answers), and the refusal where
    it cannot be tokenized."""

    ids: PairIds | None
    problem: str | None = None


class RenderedSet(NamedTuple):
    """A change applied to a set's pairs: each pair's ids with it (None: not rendered, for `problem`), or none at all
    when the change is not scored on this set (`problem` says why)."""

    ids: list[PairIds | None] | None
    problem: str | None


class ReportInputs(NamedTuple):
    """Everything the report scores, tokenized before training: the sets, and each change's rendering of each set."""

    sets: list[ReportSet]
    changes: dict[str, list[RenderedSet]]
    descriptions: dict[str, str]


# ----------------------------------------------------------------------------- reading pairs


def render_pairs_shard(conversation_tokenizer: ConversationTokenizer,
                       records: list[LocatedRecord]) -> list[RenderedPair]:
    """Each record tokenized by the reward stage's own tokenize_pair_shard (its drops and refusals included)."""
    rendered = []
    for record in records:
        try:
            rows = tokenize_pair_shard(conversation_tokenizer, [record]).rows
        except InputError as err:
            rendered.append(RenderedPair(None, str(err)))
            continue
        if not rows["margin"]:
            rendered.append(RenderedPair(None))
            continue
        chosen, rejected = rows["chosen_input_ids"][0], rows["rejected_input_ids"][0]
        rendered.append(RenderedPair(PairIds(chosen, rejected, len(chosen) - rows["chosen_answer_start"][0],
                                             len(rejected) - rows["rejected_answer_start"][0])))
    return rendered


def render_pairs(conversation_tokenizer: ConversationTokenizer, records: list[LocatedRecord],
                 num_proc: int) -> list[RenderedPair]:
    with tqdm(total=len(records), desc="Tokenizing the report's pairs", unit="pair") as progress:
        shards = map_shards(render_pairs_shard, conversation_tokenizer, shards_of(records, num_proc, ROWS_PER_SHARD),
                            num_proc, progress)
    return [pair for shard in shards for pair in shard]


def eval_set_files(paths: list[str], has_held_out: bool) -> dict[str, str]:
    """{set name: file} of --eval_sets: each file, and every .json/.jsonl file directly in each directory, a set
    named by its file's stem (RewardBench's subsets, one file each, keep their names)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(p for suffix in RECORD_SUFFIXES for p in glob(os.path.join(path, f"*{suffix}")))
            if not found:
                raise InputError(f"{path}: no .json or .jsonl files in this --eval_sets directory")
            files += found
        elif not os.path.isfile(path):
            raise InputError(f"{path}: --eval_sets file or directory does not exist")
        elif not path.endswith(RECORD_SUFFIXES):
            raise InputError(f"{path}: --eval_sets files must be .json (a list) or .jsonl (one record a line)")
        else:
            files.append(path)
    named: dict[str, str] = {}
    for path in files:
        name = os.path.splitext(os.path.basename(path))[0]
        if name in named or (has_held_out and name == HELD_OUT):
            taken = named.get(name, "the held-out pairs' name")
            raise InputError(f"{path}: --eval_sets names a set by its file's stem, and {name!r} is already {taken}: "
                             "rename one")
        named[name] = path
    return named


def read_eval_sets(paths: list[str] | None, has_held_out: bool, conversation_tokenizer: ConversationTokenizer,
                   num_proc: int) -> list[ReportSet]:
    """Every --eval_sets file read and tokenized as the reward stage reads pairs, so that a bad record is refused
    (file:line: field) before training; in memory, not in the data cache: the sets are evaluation only, changeable
    on a resume."""
    sets = []
    for name, path in eval_set_files(paths or [], has_held_out).items():
        records = records_of(path)
        rendered = render_pairs(conversation_tokenizer, records, num_proc)
        refused = next((pair.problem for pair in rendered if pair.problem), None)
        if refused:
            raise InputError(refused)
        pairs = [ReportPair(pair.ids, record) for pair, record in zip(rendered, records, strict=True) if pair.ids]
        if not pairs:
            raise InputError(f"{path}: no preference pair left in this --eval_sets file (identical answers)")
        if len(pairs) < len(records):
            logger.warning("%s: dropped %d of %d pairs whose answers are identical (or identical once cut to "
                           "--max_seq_length)", path, len(records) - len(pairs), len(records))
        sets.append(ReportSet(name, path, pairs))
    return sets


def same_answers(record: LocatedRecord) -> bool:
    _, chosen, rejected, _ = preference_of(*record)
    return chosen.strip() == rejected.strip()


def picked_if_matching(kept: list[LocatedRecord], pick: Callable[[int], np.ndarray], ids: list[PairIds],
                       conversation_tokenizer: ConversationTokenizer, num_proc: int) -> list[LocatedRecord] | None:
    """The records pick() chooses among the kept ones, if they tokenize to exactly the held-out rows."""
    indices = pick(len(kept))
    if len(indices) != len(ids) or (len(indices) and indices[-1] >= len(kept)):
        return None
    picked = [kept[i] for i in indices]
    rendered = render_pairs(conversation_tokenizer, picked, num_proc)
    same = all(pair.ids is not None and (pair.ids.chosen, pair.ids.rejected) == (row.chosen, row.rejected)
               for pair, row in zip(rendered, ids, strict=True))
    return picked if same else None


def held_out_records(data_args: "PreferenceDataArguments", seed: int, ids: list[PairIds],
                     conversation_tokenizer: ConversationTokenizer) -> list[LocatedRecord] | None:
    """The records of the held-out rows (which the changes need), found as the stage chose the rows: the
    --validation_file's first pairs, or the --validation_split_percentage share of the training pairs (build_datasets,
    data.splits.held_out_indices) cut to --max_eval_samples. The stage drops pairs with identical answers, cheap to
    find, and pairs identical once cut to --max_seq_length, rare and found only by tokenizing every record: the cheap
    guess is tried first and kept only if its records tokenize to the very rows. None if no guess matches."""
    num_proc = data_args.preprocessing_num_workers
    if data_args.validation_file:
        records = records_of(data_args.validation_file)

        def pick(count: int) -> np.ndarray:
            return np.arange(len(ids))
    else:
        files = find_record_files(data_args.dataset_dir, data_args.data_path)
        records = [item for path in files
                   for item in phase_part(records_of(path), data_args.data_split, data_args.data_phase, seed)]

        def pick(count: int) -> np.ndarray:
            return held_out_indices(count, data_args.validation_split_percentage, seed, "pairs").held_out[:len(ids)]
    found = picked_if_matching([r for r in records if not same_answers(r)], pick, ids, conversation_tokenizer,
                               num_proc)
    if found is None:
        rendered = render_pairs(conversation_tokenizer, records, num_proc)
        kept = [record for record, pair in zip(records, rendered, strict=True) if pair.ids]
        found = picked_if_matching(kept, pick, ids, conversation_tokenizer, num_proc)
    return found


def held_out_set(data_args: "PreferenceDataArguments", seed: int, eval_dataset: Dataset,
                 conversation_tokenizer: ConversationTokenizer) -> ReportSet:
    """The run's eval set: its rows as the Trainer evaluates them, with their records where they can be found."""
    ids = [PairIds(row["chosen_input_ids"], row["rejected_input_ids"],
                   len(row["chosen_input_ids"]) - row["chosen_answer_start"],
                   len(row["rejected_input_ids"]) - row["rejected_answer_start"]) for row in eval_dataset]
    records = held_out_records(data_args, seed, ids, conversation_tokenizer)
    if records is None:
        logger.warning("the held-out pairs could not be matched to their records: no change is scored on them")
    source = data_args.validation_file or f"--validation_split_percentage {data_args.validation_split_percentage}"
    matched: list[LocatedRecord | None] = [*records] if records else [None] * len(ids)
    return ReportSet(HELD_OUT, source, [ReportPair(pair, record) for pair, record in zip(ids, matched, strict=True)])


# ----------------------------------------------------------------------------- changes that must not matter

# What every template is rendered with (transformers' apply_chat_template), not a keyword argument of its own.
RENDERING_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                       "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now"}


def boolean_names(test: nodes.Node) -> set[str]:
    """Variables a condition reads as booleans: alone, negated, joined by and/or, or tested `is true/false`."""
    if isinstance(test, nodes.Name):
        return {test.name}
    if isinstance(test, nodes.Not):
        return boolean_names(test.node)
    if isinstance(test, (nodes.And, nodes.Or)):
        return boolean_names(test.left) | boolean_names(test.right)
    if isinstance(test, nodes.Test) and test.name in ("true", "false", "boolean") and isinstance(test.node,
                                                                                               nodes.Name):
        return {test.node.name}
    return set()


def template_switches(template: str) -> list[str]:
    """The keyword arguments a chat template tests as switches (Qwen3's enable_thinking), read from its syntax tree:
    variables it does not define itself, or defaults when undefined (Llama 3.1's tools_in_user_message), that a
    condition reads as booleans. A variable the template assigns is its own (a loop's state), not an argument."""
    source = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", template)  # transformers' own tag, not jinja's
    tree = Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    # One find_all per node class: given both, jinja2 types what it finds as a bare Node, which has no test.
    conditions = [node.test for node in tree.find_all(nodes.If)] + [node.test for node in tree.find_all(nodes.CondExpr)]
    tested = set().union(*(boolean_names(condition) for condition in conditions))
    assigned = {name.name for name in tree.find_all(nodes.Name) if name.ctx in ("store", "param")}
    defaulted = {test.node.name for test in tree.find_all(nodes.Test)
                 if test.name in ("defined", "undefined") and isinstance(test.node, nodes.Name)}
    arguments = (meta.find_undeclared_variables(tree) | defaulted) - (assigned - defaulted)
    return sorted((tested & arguments) - RENDERING_VARIABLES)


def switched_kwargs(kwargs: dict[str, Any], switches: list[str]) -> dict[str, Any]:
    """The switches toggled: one given true or false is negated; one not given is set false (templates treat a missing
    switch as on, as Qwen3's enable_thinking; where it was off, no pair changes and the report shows it); one given
    another value is left alone."""
    return {name: not kwargs[name] if name in kwargs else False for name in switches
            if name not in kwargs or isinstance(kwargs[name], bool)}


class ChangeRendering(NamedTuple):
    """What a change does (or why it is not scored), and the tokenizer that renders the changed pairs (None: not
    scored)."""

    description: str
    conversation_tokenizer: ConversationTokenizer | None


def pair_tokenizer(tokenizer: "PreTrainedTokenizerBase", rendering: PairRendering,
                   kwargs: dict[str, Any] | None = None) -> ConversationTokenizer:
    """The ConversationTokenizer build_preference_dataset tokenizes pairs with (other template kwargs: a change)."""
    return ConversationTokenizer(tokenizer, rendering.chat_template.text, rendering.max_length,
                                 keep_after_turn_end=True,
                                 template_kwargs=rendering.chat_template.kwargs if kwargs is None else kwargs)


def switched_rendering(tokenizer: "PreTrainedTokenizerBase", rendering: PairRendering) -> ChangeRendering:
    template = rendering.chat_template
    try:
        switches = template_switches(template.text)
    except TemplateSyntaxError as err:
        return ChangeRendering(f"not scored: the chat template's keyword arguments could not be read ({err})", None)
    toggled = switched_kwargs(template.kwargs, switches)
    if not toggled:
        return ChangeRendering("not scored: the chat template takes no keyword argument it tests as a switch"
                               if not switches else f"not scored: the template's switches ({', '.join(switches)}) "
                               "are given values other than true or false", None)
    described = ", ".join(f"{name} {str(value).lower()}" for name, value in toggled.items())
    try:
        changed = pair_tokenizer(tokenizer, rendering, {**template.kwargs, **toggled})
    except InputError as err:
        return ChangeRendering(f"not scored: the chat template with {described} fails ({err})", None)
    return ChangeRendering(f"{CHANGES[TEMPLATE_SWITCHES]}: {described}", changed)


def change_renderings(tokenizer: "PreTrainedTokenizerBase", rendering: PairRendering) -> dict[str, ChangeRendering]:
    as_trained = pair_tokenizer(tokenizer, rendering)
    return {SYSTEM_PROMPT: ChangeRendering(CHANGES[SYSTEM_PROMPT], as_trained),
            TEMPLATE_SWITCHES: switched_rendering(tokenizer, rendering),
            ANSWER_WHITESPACE: ChangeRendering(CHANGES[ANSWER_WHITESPACE], as_trained)}


def with_neutral_system_prompt(context: list[Message]) -> list[Message]:
    if context and context[0]["role"] == "system":
        return [{**context[0], "content": f"{NEUTRAL_SYSTEM_PROMPT} {context[0]['content']}"}, *context[1:]]
    return [{"role": "system", "content": NEUTRAL_SYSTEM_PROMPT}, *context]


def changed_record(record: LocatedRecord, change: str) -> LocatedRecord:
    """A pair's record with a change applied (the template switches change the rendering, not the record)."""
    if change == TEMPLATE_SWITCHES:
        return record
    context, chosen, rejected, margin = preference_of(*record)
    if change == SYSTEM_PROMPT:
        context = with_neutral_system_prompt(context)
    elif change == ANSWER_WHITESPACE:
        chosen, rejected = chosen + ANSWER_SUFFIX, rejected + ANSWER_SUFFIX
    # As two conversations sharing every turn but the last answer: a shape the stage reads as it is.
    return LocatedRecord(record.where, {"chosen": [*context, {"role": "assistant", "content": chosen}],
                                        "rejected": [*context, {"role": "assistant", "content": rejected}],
                                        "margin": margin})


def render_change(report_set: ReportSet, change: str, conversation_tokenizer: ConversationTokenizer,
                  num_proc: int) -> RenderedSet:
    records = [pair.record for pair in report_set.pairs if pair.record is not None]
    if len(records) < len(report_set.pairs):
        return RenderedSet(None, "its pairs could not be matched to their records")
    rendered = render_pairs(conversation_tokenizer, [changed_record(record, change) for record in records], num_proc)
    return RenderedSet([pair.ids for pair in rendered], next((p.problem for p in rendered if p.problem), None))


def prepare_report(data_args: "PreferenceDataArguments", seed: int, tokenizer: "PreTrainedTokenizerBase",
                   rendering: PairRendering, eval_dataset: Dataset | None,
                   eval_sets: list[ReportSet]) -> ReportInputs | None:
    """The held-out set (if any) and the --eval_sets, each with every change's rendering; None: nothing to report."""
    held_out = [held_out_set(data_args, seed, eval_dataset, pair_tokenizer(tokenizer, rendering))
                if eval_dataset is not None and len(eval_dataset) else None]
    sets = [report_set for report_set in held_out + eval_sets if report_set is not None]
    if not sets:
        return None
    renderings = change_renderings(tokenizer, rendering)
    changes = {change: [render_change(report_set, change, changing.conversation_tokenizer,
                                      data_args.preprocessing_num_workers) for report_set in sets]
               for change, changing in renderings.items() if changing.conversation_tokenizer is not None}
    return ReportInputs(sets, changes, {change: changing.description for change, changing in renderings.items()})


# ----------------------------------------------------------------------------- scoring


class PairScoreArrays(NamedTuple):
    chosen: np.ndarray
    rejected: np.ndarray


# Pairs' token ids -> their scores, in order.
Scorer = Callable[[list[PairIds]], PairScoreArrays]


def trainer_scorer(trainer: "Trainer") -> Scorer:
    """Scores from the Trainer's evaluation loop: RewardTrainer.prediction_step on the stage's collator (its pair
    layout), --per_device_eval_batch_size pairs a batch on every rank, gathered in order on every rank. Every rank
    calls it (under ZeRO-3 each forward gathers the weights from all of them)."""
    def score(rows: list[PairIds]) -> PairScoreArrays:
        dataset = Dataset.from_dict({"chosen_input_ids": [row.chosen for row in rows],
                                     "rejected_input_ids": [row.rejected for row in rows],
                                     "margin": [0.0] * len(rows)})
        output = trainer.evaluation_loop(report_loader(trainer, dataset), "Scoring the report's pairs",
                                         prediction_loss_only=False, metric_key_prefix="report")
        predictions = np.asarray(output.predictions, dtype=np.float64)
        return PairScoreArrays(predictions[:, 0], predictions[:, 1])

    return score


def report_loader(trainer: "Trainer", dataset: Dataset) -> DataLoader:
    """Every pair, in order, sharded over the processes by accelerate: not the Trainer's test loader, whose sampler
    follows --group_by_length (it cannot read lengths from pair rows) and which --dataloader_drop_last would cut."""
    loader = DataLoader(dataset, batch_size=trainer.args.eval_batch_size, collate_fn=trainer.data_collator,
                        shuffle=False, drop_last=False, num_workers=trainer.args.dataloader_num_workers)
    return trainer.accelerator.prepare(loader)


class Rescored(NamedTuple):
    """The pairs of a set whose token ids a change alters, and where their rows start among those scored."""

    pairs: list[int]
    offset: int


class ScoredSet(NamedTuple):
    scores: SetScores
    variants: dict[str, VariantScores]


def altered_pairs(report_set: ReportSet, rendered: RenderedSet) -> dict[int, PairIds]:
    """{index in the set: its ids with the change} of the pairs the change alters, in the set's order."""
    return {index: ids for index, (pair, ids) in enumerate(zip(report_set.pairs, rendered.ids or [], strict=False))
            if ids is not None and (ids.chosen, ids.rejected) != (pair.ids.chosen, pair.ids.rejected)}


def variant_scores(base: np.ndarray, rendered: RenderedSet, rescored: Rescored,
                   scored_differences: np.ndarray) -> VariantScores:
    """A change's differences on a set: those of the pairs it alters as scored again, the others' as they were
    (the same token ids: the same score); the pairs it could not render are left out."""
    if rendered.ids is None:
        return VariantScores(np.empty(0), np.empty(0), 0, skipped=rendered.problem)
    changed = base.copy()
    changed[rescored.pairs] = scored_differences[rescored.offset:rescored.offset + len(rescored.pairs)]
    compared = np.array([ids is not None for ids in rendered.ids], dtype=bool)
    return VariantScores(base[compared], changed[compared], len(rescored.pairs), int((~compared).sum()),
                         problem=rendered.problem)


def score_report(inputs: ReportInputs, scorer: Scorer) -> list[ScoredSet]:
    """Every set's pairs and every change's altered pairs scored in one call (batched by the scorer)."""
    rows = [pair.ids for report_set in inputs.sets for pair in report_set.pairs]
    rescored = {}
    for change, rendered_sets in inputs.changes.items():
        for index, (report_set, rendered) in enumerate(zip(inputs.sets, rendered_sets, strict=True)):
            altered = altered_pairs(report_set, rendered)
            rescored[change, index] = Rescored(list(altered), len(rows))
            rows.extend(altered.values())
    scores = scorer(rows)
    differences = scores.chosen - scores.rejected
    scored, offset = [], 0
    for index, report_set in enumerate(inputs.sets):
        span = slice(offset, offset + len(report_set.pairs))
        offset = span.stop
        lengths = np.array([(pair.ids.chosen_length, pair.ids.rejected_length) for pair in report_set.pairs],
                           dtype=int).reshape(-1, 2)
        set_scores = SetScores(scores.chosen[span], scores.rejected[span], lengths[:, 0], lengths[:, 1])
        scored.append(ScoredSet(set_scores, {
            change: variant_scores(differences[span], rendered_sets[index], rescored[change, index], differences)
            for change, rendered_sets in inputs.changes.items()}))
    return scored


def pooled(scored: list[ScoredSet], changes: list[str]) -> ScoredSet:
    """All sets as one, for the overall figures; a change skipped on some sets is pooled over the others."""
    scores = SetScores(*(np.concatenate([s.scores[field] for s in scored]) for field in range(len(SetScores._fields))))
    variants = {}
    for change in changes:
        parts = [s.variants[change] for s in scored if not s.variants[change].skipped]
        variants[change] = VariantScores(
            np.concatenate([p.base for p in parts]), np.concatenate([p.changed for p in parts]),
            sum(p.pairs_changed for p in parts), sum(p.not_rendered for p in parts),
            problem=next((p.problem for p in parts if p.problem), None)) if parts else scored[0].variants[change]
    return ScoredSet(scores, variants)


def report_figures(inputs: ReportInputs, scored: list[ScoredSet], step: int) -> dict[str, Any]:
    """The whole report as JSON values: each set's figures and all sets' together."""
    not_scored = {change: VariantScores(np.empty(0), np.empty(0), 0, skipped=description)
                  for change, description in inputs.descriptions.items() if change not in inputs.changes}

    def figures(scored_set: ScoredSet) -> dict[str, Any]:
        variants = scored_set.variants | not_scored
        return set_figures(scored_set.scores, {change: variants[change] for change in CHANGES})

    return {"step": step, "tie_tolerance": TIE_TOLERANCE, "changes": inputs.descriptions,
            "sets": {report_set.name: {"source": report_set.source, **figures(scored_set)}
                     for report_set, scored_set in zip(inputs.sets, scored, strict=True)},
            "overall": figures(pooled(scored, list(inputs.changes)))}


# ----------------------------------------------------------------------------- writing

TABLE_HEADER = ["set", "pairs", "accuracy [95% CI]", "chosen shorter", "chosen longer", "same length",
                "corr(score, length)", "flips: system prompt", "flips: template switches", "flips: answer whitespace",
                "ECE", "margin mean ± std", "ties"]


def number(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def accuracy_cell(figures: dict[str, Any], interval: bool = False) -> str:
    """'0.750 [0.301, 0.954]' (with its interval) or '0.750 (4)' (with its pairs)."""
    if interval and figures["ci95"]:
        return f"{number(figures['accuracy'])} [{number(figures['ci95'][0])}, {number(figures['ci95'][1])}]"
    return f"{number(figures['accuracy'])} ({figures['pairs']})"


def flip_cell(figures: dict[str, Any]) -> str:
    if "skipped" in figures:
        return "not scored"
    share = "—" if figures["flip_share"] is None else f"{100 * figures['flip_share']:.1f}%"
    return f"{figures['flipped']}/{figures['pairs']} ({share})"


def table_row(name: str, figures: dict[str, Any]) -> str:
    bias, margin, ties = figures["length_bias"], figures["margin"], figures["ties"]
    cells = [name, str(figures["pairs"]), accuracy_cell(figures["accuracy"], interval=True),
             *(accuracy_cell(bias[split]) for split in ("chosen_shorter", "chosen_longer", "same_length")),
             number(bias["score_length_correlation"]),
             *(flip_cell(figures["robustness"][change]) for change in CHANGES),
             number(figures["calibration"]["ece"]), f"{number(margin['mean'])} ± {number(margin['std'])}",
             f"{ties['count']} ({number(None if ties['share'] is None else 100 * ties['share'], 1)}%)"]
    return "| " + " | ".join(cells) + " |"


def report_markdown(figures: dict[str, Any]) -> str:
    """The report as one short table, what each change did, and the plot."""
    lines = [f"# What the reward model learned (step {figures['step']})", "",
             "| " + " | ".join(TABLE_HEADER) + " |", "|" + "---|" * len(TABLE_HEADER)]
    lines += [table_row(name, of_set) for name, of_set in figures["sets"].items()]
    lines += [table_row("**overall**", figures["overall"]), "",
              "Accuracy: the chosen answer scored above the rejected one; chosen shorter/longer/same length: the "
              "accuracy (pairs) by answer length in tokens; flips: pairs whose preference changes under a change "
              f"that must not matter; ties: |difference| <= {figures['tie_tolerance']:g}. The changes:", ""]
    lines += [f"- {change}: {description}" for change, description in figures["changes"].items()]
    lines += ["", "![training curves and calibration](rm_report.png)", ""]
    return "\n".join(lines)


def plot_history(axis: Any, log_history: list[dict[str, Any]], styles: dict[str, str], label: str) -> None:
    """The logged values of each key by step on one panel."""
    for key, style in styles.items():
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
        if points:
            axis.plot(*zip(*points, strict=True), style, markersize=3, label=key.replace("_", " "))
    axis.set_xlabel("step")
    axis.set_ylabel(label)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)


def plot_calibration(axis: Any, figures: dict[str, Any]) -> None:
    """The reliability diagram: observed frequency against mean predicted probability, bin by bin, per set."""
    axis.plot([0, 1], [0, 1], ":", color="grey", label="calibrated")
    for name, of_set in [*figures["sets"].items(), ("overall", figures["overall"])]:
        bins = [b for b in of_set["calibration"]["bins"] if b["count"]]
        axis.plot([b["mean_predicted"] for b in bins], [b["observed"] for b in bins], "o-", markersize=3,
                  label=f"{name} (ECE {number(of_set['calibration']['ece'])})")
    axis.set_xlabel("predicted P(chosen preferred)")
    axis.set_ylabel("observed frequency")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)


def report_plot(log_history: list[dict[str, Any]], figures: dict[str, Any]) -> bytes:
    """A PNG of three panels: the training and eval loss, the eval accuracy and margin by step, and calibration."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    figure, (losses, accuracy, reliability) = plt.subplots(1, 3, figsize=(13, 3.6))
    plot_history(losses, log_history, {"loss": "-o", "eval_loss": "s-"}, "loss")
    plot_history(accuracy, log_history, {"eval_accuracy": "s-", "eval_margin": "^-"}, "eval accuracy, margin")
    plot_calibration(reliability, figures)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()


def write_report(output_dir: str, figures: dict[str, Any], log_history: list[dict[str, Any]]) -> None:
    json_path, markdown_path, plot_path = (os.path.join(output_dir, name) for name in REPORT_FILES)
    write_json_atomically(json_path, figures)
    write_atomically(markdown_path, report_markdown(figures))
    write_atomically(plot_path, report_plot(log_history, figures))


def write_reward_report(trainer: "Trainer", inputs: ReportInputs | None) -> None:
    """Score the report's pairs on every rank (the evaluation loop is collective), then compute and write the report
    on the main process."""
    if inputs is None:
        logger.info("no held-out pairs and no --eval_sets: no reward report")
        return
    scored = score_report(inputs, trainer_scorer(trainer))
    if not trainer.args.should_save:
        return
    figures = report_figures(inputs, scored, trainer.state.global_step)
    output_dir = output_dir_of(trainer.args)
    write_report(output_dir, figures, trainer.state.log_history)
    summary = ", ".join(f"{name} {accuracy_cell(of_set['accuracy'], interval=True)}"
                        for name, of_set in figures["sets"].items())
    logger.info("reward report (accuracy [95%% CI]): %s; written to %s", summary,
                ", ".join(os.path.join(output_dir, name) for name in REPORT_FILES))
