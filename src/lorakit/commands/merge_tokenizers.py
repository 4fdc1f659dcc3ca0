"""Extend a tokenizer's vocabulary with pieces learned on a corpus (Chinese, or any language): the command
`lorakit merge-tokenizers` (scripts/merge/merge_tokenizers.py). Its usage, how the pieces are merged into each kind
of base, the report and the guarantees checked before the output is renamed into place: lorakit.merge.tokenizers,
whose steps main() runs in order."""

import argparse
import json
import logging
import os
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from lorakit.core.atomic import atomic_output_dir
from lorakit.merge.common import InputError, check_output_dir, code_files, copy_files, run_cli, setup_tool_logging
from lorakit.merge.tokenizers import (
    PIECES_FILE,
    REPORT_FILE,
    BaseTokenizer,
    GuaranteeError,
    build_report,
    check_compatible,
    inspect_base,
    load_proto,
    merge_bpe_json,
    merge_sentencepiece,
    print_report,
    read_tokenizer_dir,
    split_corpus,
    train_extra_model,
    unreachable_tokens,
    write_bpe_tokenizer,
    write_sentencepiece_tokenizer,
)
from lorakit.merge.tokenizers_config import parse_args

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("merge_tokenizers")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_arguments(args)
    check_output_dir(args.output_dir, {"--base_tokenizer": args.base_tokenizer})
    base = inspect_base(args.base_tokenizer)
    check_model_type(args, base)

    # Loaded before the extra pieces are trained, so a base that cannot load is refused at once.
    if args.trust_remote_code:
        logger.warning("--trust_remote_code: running the tokenizer's own code from %s", args.base_tokenizer)
    base_tokenizer = read_tokenizer_dir(args.base_tokenizer, args.trust_remote_code)

    with tempfile.TemporaryDirectory(prefix="merge_tokenizers-") as work:
        train_path = os.path.join(work, "train.txt") if args.train_corpus else None
        eval_lines = split_corpus(args, train_path)
        if not eval_lines:
            raise InputError("no eval lines for the report: give a longer --train_corpus or an --eval_corpus")
        if train_path is None:  # no --train_corpus: --extra_sp_model instead (exactly one given, checked above)
            extra, extra_name = load_proto(args.extra_sp_model), args.extra_sp_model
        else:
            extra, extra_name = train_extra_model(args, base, train_path, work), "the trained model"
        check_compatible(base, extra, extra_name)
        with atomic_output_dir(args.output_dir) as out:
            report = write_merged(args, base, base_tokenizer, extra, eval_lines, out)
    print_report(report)
    print(f"wrote {args.output_dir} (load it with AutoTokenizer.from_pretrained; report in {REPORT_FILE})")


def check_arguments(args: argparse.Namespace) -> None:
    """The flags' own refusals, before anything is read."""
    if bool(args.train_corpus) == bool(args.extra_sp_model):
        raise InputError("give exactly one of --train_corpus (train the new pieces) or --extra_sp_model")
    if args.extra_sp_model and not args.eval_corpus:
        raise InputError("--extra_sp_model needs --eval_corpus: the report measures tokens per character on it")
    if args.extra_sp_model and not os.path.isfile(args.extra_sp_model):
        raise InputError(f"{args.extra_sp_model}: --extra_sp_model does not exist")
    if args.vocab_size < 2 or args.heldout_every < 2 or args.max_eval_lines < 1:
        raise InputError("--vocab_size and --heldout_every must be at least 2, --max_eval_lines at least 1")


def check_model_type(args: argparse.Namespace, base: BaseTokenizer) -> None:
    """--model_type of the pieces to train must be the base's own kind: unigram or BPE."""
    if not (args.train_corpus and args.model_type):
        return
    spec = base.proto.trainer_spec if base.kind == "sentencepiece" and base.proto is not None else None
    needed = ("unigram" if spec.model_type == spec.UNIGRAM else "bpe") if spec is not None else "bpe"
    if args.model_type != needed:
        raise InputError(f"--model_type {args.model_type}: this base needs a {needed} extra model "
                         "(a BPE tokenizer.json base, or a SentencePiece base of that type)")


def write_merged(args: argparse.Namespace, base: BaseTokenizer, base_tokenizer: "PreTrainedTokenizerBase",
                 extra: Any, eval_lines: list[str], out: str) -> dict[str, Any]:
    """The merged tokenizer, the extra pieces and the report into out; a broken guarantee writes nothing (exit 1)."""
    unreachable: list[str] = []
    if base.kind == "sentencepiece":
        merged_proto, stats = merge_sentencepiece(base, extra)
        write_sentencepiece_tokenizer(base, merged_proto, out, base_tokenizer, args.trust_remote_code)
    else:
        data, stats, new_tokens = merge_bpe_json(base, extra)
        write_bpe_tokenizer(base, data, out)
        unreachable = unreachable_tokens(out, new_tokens)
    copy_files(base.path, code_files(base.path), out)  # the merged tokenizer loads with the same code
    merged = read_tokenizer_dir(out, args.trust_remote_code)
    try:
        merged_model = os.path.join(out, "tokenizer.model") if base.kind == "sentencepiece" else None
        report = build_report(args, base, base_tokenizer, merged, stats, eval_lines, unreachable, merged_model)
    except GuaranteeError as err:
        print(f"error: guarantee violated, nothing written: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
    with open(os.path.join(out, PIECES_FILE), "wb") as handle:
        handle.write(extra.SerializeToString())
    with open(os.path.join(out, REPORT_FILE), "w", encoding="utf-8") as handle:
        json.dump(report, handle, ensure_ascii=False, indent=2)
        handle.write("\n")
    return report


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    setup_tool_logging()
    run_cli(main)


if __name__ == "__main__":
    entry_point()
