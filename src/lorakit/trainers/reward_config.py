"""The reward stage's arguments (`lorakit reward`, lorakit.commands.reward): its training flags beside the shared
model and preference-pair data arguments; the pipeline reads their flag names."""

from dataclasses import dataclass, field

from lorakit.models.arguments import ModelArguments
from lorakit.trainers.arguments import PreferenceDataArguments, ToolkitTrainingArguments


@dataclass
class RewardArguments(ToolkitTrainingArguments):
    reward_center_coef: float = field(
        default=0.0, metadata={"help": "Weight of mean((r_chosen + r_rejected)^2): keeps rewards centred on 0."}
    )
    merge_on_save: bool = field(
        default=False, metadata={"help": "Also write OUT/rm_merged_model: base + adapter merged, for PPO."}
    )
    share_pair_prefix: bool = field(
        default=True,
        metadata={"help": "One row per pair: the tokens chosen and rejected share (system prompt, question) run "
                          "once, the same scores for fewer tokens. Needs sdpa or eager attention; off otherwise."},
    )
    eval_sets: list[str] | None = field(
        default=None,
        metadata={"help": "Pair files, or directories of them, the end-of-training report (rm_report.*) also scores: "
                          "each file a set named by its stem (RewardBench's subsets as they are). Evaluation only.",
                  "nargs": "+"},
    )


# (model, data, training) arguments: main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (ModelArguments, PreferenceDataArguments, RewardArguments)
