"""The arguments of `lorakit merge-tokenizers` (scripts/merge/merge_tokenizers.py): its parser, which the command and
the pipeline's flag checks both read. Imports none of the tokenizer libraries, so the pipeline checks a stage's flags
at once."""

import argparse
import os

from lorakit.core.cli import ArgumentParser

# The command's one-line description (lorakit.merge.tokenizers holds the full one: how pieces are merged into each
# kind of base, the report and the guarantees).
DESCRIPTION = "Extend a tokenizer's vocabulary with pieces learned on a corpus (Chinese, or any language)."


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_tokenizer", required=True, help="Tokenizer directory to extend.")
    parser.add_argument("--output_dir", required=True, help="New directory for the merged tokenizer.")
    parser.add_argument("--train_corpus", default=None,
                        help="Text file(s), comma-separated, one document a line: train the extra pieces on them.")
    parser.add_argument("--extra_sp_model", default=None,
                        help="Or: a trained SentencePiece .model whose pieces to add.")
    parser.add_argument("--vocab_size", type=int, default=20000, help="Vocabulary size of the trained extra model.")
    parser.add_argument("--model_type", default=None, choices=["bpe", "unigram"],
                        help="Extra model type (default: the base's for a SentencePiece base, else bpe).")
    parser.add_argument("--character_coverage", type=float, default=0.9995,
                        help="Share of the corpus' characters the extra model covers (0.9995 suits Chinese).")
    parser.add_argument("--input_sentence_size", type=int, default=2_000_000,
                        help="Lines sampled from the corpus to train on (0: all).")
    parser.add_argument("--max_sentence_length", type=int, default=16384, help="Longer lines are skipped in training.")
    parser.add_argument("--num_threads", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--eval_corpus", default=None,
                        help="Text file(s) for the report (default: every 20th line of --train_corpus, held out).")
    parser.add_argument("--heldout_every", type=int, default=20,
                        help="Without --eval_corpus, every N-th training line is held out for the report.")
    parser.add_argument("--max_eval_lines", type=int, default=10000, help="Lines of the eval text used in the report.")
    parser.add_argument("--num_samples", type=int, default=3, help="Sample tokenizations shown in the report.")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="Run the Python code the tokenizer directory ships (tokenizer_config.json auto_map) to "
                             "load it; the merged tokenizer keeps a copy of that code. Only for directories you trust.")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)
