"""The chat's arguments (`lorakit chat`, lorakit.commands.chat): sampling, the conversation and batch mode, beside
the inference model's flags; the pipeline reads their flag names."""

from dataclasses import dataclass, field

from lorakit.core.cli import InputError
from lorakit.models.arguments import note_accepted_flags, trust_remote_code_field
from lorakit.serve.inference import InferenceModelArguments


@dataclass
class ChatArguments:
    """Sampling (Chinese-LLaMA-Alpaca-2's defaults), the conversation and batch mode."""

    max_new_tokens: int = field(default=400, metadata={"help": "Most tokens of one answer."})
    temperature: float = field(default=0.2, metadata={"help": "Sampling temperature; 0 = greedy."})
    top_p: float = field(default=0.9, metadata={"help": "Nucleus sampling mass."})
    top_k: int = field(default=40, metadata={"help": "Sample among the k likeliest tokens (0 = all)."})
    repetition_penalty: float = field(default=1.1, metadata={"help": "1.0 = none."})
    seed: int | None = field(default=None, metadata={"help": "Seed for reproducible sampling."})
    system_prompt: str | None = field(default=None, metadata={"help": "System turn before the conversation."})
    show_prompt: bool = field(default=False, metadata={"help": "Print each rendered prompt (to check the template)."})
    data_file: str | None = field(
        default=None,
        metadata={"help": "Batch mode: .jsonl/.json of {\"prompt\": ...} or {\"messages\": [...]} records."},
    )
    predictions_file: str | None = field(default=None, metadata={"help": "Batch mode: where answers go (.jsonl)."})
    batch_size: int = field(default=8, metadata={"help": "Batch mode: prompts generated together."})
    trust_remote_code: bool = trust_remote_code_field()
    with_prompt: bool = field(
        default=False, metadata={"help": "Chinese-LLaMA-Alpaca-2's: accepted; the chat template is always applied."}
    )
    interactive: bool = field(
        default=False, metadata={"help": "Chinese-LLaMA-Alpaca-2's: accepted; without --data_file the chat is "
                                         "interactive."}
    )

    def __post_init__(self) -> None:
        if self.interactive and self.data_file:
            raise InputError("--interactive and --data_file both given: the chat is interactive without --data_file "
                             "and answers the file with it; give only one")
        # Logged by log_mapped_flags once main() has configured logging.
        self.mapped_flags: list[str] = []
        note_accepted_flags(self, ACCEPTED_CHAT_FLAGS, self.mapped_flags)


# Chinese-LLaMA-Alpaca-2's inference_hf.py switches that need nothing here, and why.
ACCEPTED_CHAT_FLAGS = {
    "with_prompt": "every prompt is rendered with the chat template saved with the tokenizer at training time",
    "interactive": "without --data_file the chat is interactive (multi-turn; /clear forgets the history)",
}


# The command's main() (lorakit.commands.chat) parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (InferenceModelArguments, ChatArguments)
