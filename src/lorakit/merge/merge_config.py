"""The arguments of `lorakit merge` (scripts/merge/merge_llama_with_lora.py): its parser, which the command and the
pipeline's flag checks both read, and the one argument refusal argparse cannot make. Imports neither torch nor
transformers, so the pipeline checks a stage's flags at once."""

import argparse

from lorakit.core.cli import ArgumentParser, InputError

# The command's one-line description (lorakit.commands.merge holds the full one).
DESCRIPTION = "Fold one or more LoRA adapters into their base model, tensor by tensor, in bounded memory."


def build_parser() -> argparse.ArgumentParser:
    # argparse, not HfArgumentParser: transformers must stay out of the merge's imports.
    parser = ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base_model", required=True, help="Base model directory (config.json + safetensors).")
    parser.add_argument("--lora_model", required=True,
                        help="Adapter directory, or several separated by commas, applied in that order.")
    parser.add_argument("--output_dir", required=True, help="New directory for the merged model.")
    # No argparse choices: Chinese-LLaMA-Alpaca-2's "pth" gets our one-line refusal (parse_args), not a usage dump.
    parser.add_argument("--output_type", default="huggingface",
                        help="Only huggingface (safetensors); llama.cpp and vLLM read it directly.")
    parser.add_argument("--max_shard_size", default=None,
                        help="Largest output file, e.g. 2GB or 500MiB (default: one output file per base file).")
    parser.add_argument("--chunk_mb", type=float, default=16,
                        help="Rows computed at a time, in MiB of float32: bounds the merge's memory.")
    parser.add_argument("--verify", action="store_true",
                        help="Compare the merged model's logits with base+adapters in peft (needs both models in RAM).")
    parser.add_argument("--verify_tolerance", type=float, default=1e-3,
                        help="Largest accepted logit difference against peft's merge (rounded to the written dtype).")
    parser.add_argument("--allow_other_base", action="store_true",
                        help="Merge an adapter whose recorded base (lorakit_base.json) has other weights than "
                             "--base_model's (refused otherwise).")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="--verify: run the Python code the model directories ship (config.json auto_map) to "
                             "load them. The merge itself only copies that code; trust the directories first.")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.output_type != "huggingface":
        raise InputError(f"--output_type {args.output_type}: the merge writes the huggingface layout only "
                         "(config.json + *.safetensors + tokenizer, no consolidated.*.pth), which llama.cpp's "
                         "converter and vLLM read; drop --output_type or give huggingface")
    return args
