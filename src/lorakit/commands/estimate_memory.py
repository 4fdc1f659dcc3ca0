"""How much GPU and CPU memory a LoRA or QLoRA run needs under each ZeRO config we ship, from
DeepSpeed's own estimators, for the user's model and GPU count; reads only config.json.

    python scripts/training/estimate_memory.py --model_name_or_path /models/llama-2-13b-hf \
        --num_gpus 8 --lora_rank 64 --modules_to_save embed_tokens,lm_head --load_in_kbits 16
    python scripts/training/estimate_memory.py --model_shape llama2-70b --load_in_kbits 4
    python scripts/training/estimate_memory.py --fit_table     # the table in docs/nodes-and-memory.md

The figures and their rules: lorakit.models.memory.
"""

import io
from collections.abc import Sequence
from contextlib import redirect_stderr
from dataclasses import replace
from typing import TYPE_CHECKING

from lorakit.core.cli import InputError, parse_args, run_cli
from lorakit.models.memory import (
    GIB,
    GPUS_PER_NODE,
    PUBLIC_SHAPES,
    USABLE_CARD_FRACTION,
    EstimateArguments,
    ParameterCounts,
    ZeroConfig,
    activation_bytes,
    batch_tokens,
    build_meta_model,
    count_parameters,
    expert_lora_bytes,
    expert_shape,
    fits,
    kv_cache_bytes,
    lora_dropout,
    model_state_bytes,
    read_model_config,
    shipped_zero_configs,
    smallest_fit,
)

if TYPE_CHECKING:  # transformers loads only inside the functions that build the model
    from transformers import PreTrainedConfig

# The card sizes (GB) the report and the fit table answer for.
CARDS_GIB = (24, 40, 80)
SHAPE_NAMES = {"llama2-7b": "Llama-2-7B", "llama2-13b": "Llama-2-13B", "codellama-34b": "CodeLlama-34B",
               "llama2-70b": "Llama-2-70B"}


def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def check_numbers(args: EstimateArguments) -> None:
    for flag in ("num_gpus", "num_nodes", "lora_rank", "per_device_train_batch_size", "max_seq_length"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag} must be a positive whole number, not {getattr(args, flag)}")
    if args.max_tokens_per_batch is not None and args.max_tokens_per_batch < args.max_seq_length:
        raise InputError(f"--max_tokens_per_batch {args.max_tokens_per_batch} is below --max_seq_length "
                         f"{args.max_seq_length}: training refuses a budget a full row does not fit in")


def batch_label(args: EstimateArguments) -> str:
    if args.max_tokens_per_batch:
        return f"a budget of {args.max_tokens_per_batch} tokens (--max_tokens_per_batch)"
    return f"{args.per_device_train_batch_size} x {args.max_seq_length} tokens"


def describe_model(config: "PreTrainedConfig", args: EstimateArguments, counts: ParameterCounts) -> list[str]:
    source = args.model_shape or args.model_name_or_path
    saved = f", modules_to_save {args.modules_to_save}" if args.modules_to_save else ""
    base = f"QLoRA {args.load_in_kbits}-bit" if args.load_in_kbits < 16 else f"LoRA, {args.torch_dtype} base"
    return [
        f"model: {source} ({config.model_type}, {counts.frozen / 1e9:.2f} B parameters in the base)",
        f"{base}: rank {args.lora_rank} on {args.trainable}{saved}",
        f"trainable: {counts.trainable:,} parameters (largest layer {counts.largest_trainable_layer:,}); "
        f"frozen base: {gib(counts.frozen_bytes)} GiB",
        f"hardware: {args.num_nodes} node(s) x {args.num_gpus} GPU(s)",
    ] + expert_lines(config, args)


def expert_lines(config: "PreTrainedConfig", args: EstimateArguments) -> list[str]:
    shape = expert_shape(config)
    if not shape.experts:
        return []
    lines = [f"mixture of experts: {shape.experts} experts a layer, {shape.top_k} per token"
             + (f", a shared expert of width {shape.shared_width}" if shape.shared_width else "")
             + ("; LoRA on the experts keeps their effective weights for backward: "
                f"{gib(expert_lora_bytes(config, args.lora_rank))} GiB a layer" if args.lora_experts != "no" else "")]
    if args.load_in_kbits < 16:
        lines.append("QLoRA: bitsandbytes quantizes nn.Linear layers only; the fused experts stay 16-bit")
    return lines


def report_lines(config: "PreTrainedConfig", args: EstimateArguments, counts: ParameterCounts) -> list[str]:
    """The per-config table for this model and GPU count."""
    tokens = batch_tokens(args)
    dropout, experts = lora_dropout(config, args), args.lora_experts != "no"
    with_ckpt = activation_bytes(config, args.lora_rank, tokens, True, args.chunked_loss, dropout, experts)
    without = activation_bytes(config, args.lora_rank, tokens, False, args.chunked_loss, dropout, experts)
    cards = " ".join(f"{card:>3}G" for card in CARDS_GIB)
    lines = describe_model(config, args, counts) + [
        "",
        "GiB; 'trained' = DeepSpeed's estimator on the trainable parameters, 'frozen' = the base on top;",
        f"'fits' adds activations with --activation_checkpointing and keeps {1 - USABLE_CARD_FRACTION:.0%} "
        "of the card free",
        f"{'config':<26} {'trained':>8} {'frozen':>8} {'per GPU':>8} {'CPU/node':>9}  fits {cards}",
    ]
    for zero in shipped_zero_configs():
        estimate = model_state_bytes(counts, zero, args.num_gpus, args.num_nodes, args.load_in_kbits < 16)
        if estimate is None:
            lines.append(f"{zero.name:<26} refused: --load_in_kbits {args.load_in_kbits} runs under ZeRO-2 only")
            continue
        verdicts = " ".join(f"{'yes' if fits(estimate.gpu + with_ckpt, card) else 'no':>4}" for card in CARDS_GIB)
        lines.append(f"{zero.name:<26} {gib(estimate.trained_gpu):>8} {gib(estimate.frozen_gpu):>8} "
                     f"{gib(estimate.gpu):>8} {gib(estimate.cpu):>9}       {verdicts}")
    lines += [
        "",
        f"activations per GPU come on top: {gib(with_ckpt)} GiB with --activation_checkpointing, {gib(without)} "
        f"GiB without, for {batch_label(args)}",
        "(rule: 2 x layers x tokens x hidden bytes of checkpoints + one layer recomputed + the loss over the "
        "vocabulary; see activation_bytes)",
        f"PPO with --enable_hybrid_engine adds {gib(counts.lora_targeted_bytes)} GiB per GPU during each rollout: "
        "a copy of the LoRA-targeted base weights (none under ZeRO-3 or a quantized base, which decode unmerged)",
        rollout_line(config, args),
    ]
    return lines


def rollout_line(config: "PreTrainedConfig", args: EstimateArguments) -> str:
    """What a PPO / GRPO rollout holds beside the model: the KV cache of one generation batch."""
    batch, group = args.per_device_generation_batch_size, args.num_generations
    kv = kv_cache_bytes(config, batch, args.max_seq_length, 2)
    prompts = f"{batch // group} prompts x {group}" if batch % group == 0 else f"--num_generations {group}"
    return (f"PPO / GRPO rollouts hold a {gib(kv)} GiB KV cache per GPU while they sample: a generation batch of "
            f"{batch} answers (GRPO: {prompts}) of {args.max_seq_length} tokens")


def config_label(zero: ZeroConfig) -> str:
    offload = " offload" if zero.offload_optimizer or zero.offload_param else ""
    return f"ZeRO-{zero.stage}{offload}"


def fit_cell(counts: ParameterCounts, config: "PreTrainedConfig", args: EstimateArguments, card_gib: int) -> str:
    """The fewest GPUs without offload; also the offload config where it needs fewer GPUs."""
    plain = smallest_fit(counts, config, args, card_gib, offload=False)
    offloaded = smallest_fit(counts, config, args, card_gib, offload=True)
    cell = f"{config_label(plain.zero)} x{plain.gpus} ({gib(plain.gpu_bytes)})" if plain else "no fit"
    if offloaded and (plain is None or offloaded.gpus < plain.gpus):
        cell += (f"; {config_label(offloaded.zero)} x{offloaded.gpus} ({gib(offloaded.gpu_bytes)}, "
                 f"CPU {gib(offloaded.cpu_bytes)} per node)")
    return cell


def fit_table_lines(args: EstimateArguments) -> list[str]:
    """The markdown table of docs/nodes-and-memory.md: every public shape, LoRA on a 16-bit base and QLoRA 4-bit."""
    cards = " | ".join(f"{card} GB cards" for card in CARDS_GIB)
    lines = [f"| Model | Method | Trainable | Frozen base | {cards} |", "|---|---|---|---|" + "---|" * len(CARDS_GIB)]
    for shape in PUBLIC_SHAPES:
        for kbits in (16, 4):
            case = replace(args, model_shape=shape, model_name_or_path=None, load_in_kbits=kbits)
            config = read_model_config(None, shape)
            counts = count_parameters(build_meta_model(config, case))
            method = f"LoRA {case.torch_dtype}" if kbits == 16 else "QLoRA 4-bit"
            cells = " | ".join(fit_cell(counts, config, case, card) for card in CARDS_GIB)
            lines.append(f"| {SHAPE_NAMES[shape]} | {method} | {counts.trainable / 1e6:.0f} M | "
                         f"{gib(counts.frozen_bytes)} GiB | {cells} |")
    files = ", ".join(f"{config_label(zero)} = ds_configs/{zero.name}" for zero in shipped_zero_configs())
    return lines + [
        "",
        f"xN: GPUs (nodes of {GPUS_PER_NODE}); in brackets GiB per GPU: model states + activations of "
        f"{batch_label(args)} with --activation_checkpointing, "
        f"within {USABLE_CARD_FRACTION:.0%} of the card. {files}.",
    ]


def parse_estimate_args(argv: Sequence[str] | None = None) -> EstimateArguments:
    """The arguments; a value argparse rejects (--num_gpus eight) becomes one InputError line, not usage text."""
    captured = io.StringIO()
    try:
        with redirect_stderr(captured):
            (args,) = parse_args([EstimateArguments], argv)
    except SystemExit as exit_:
        if exit_.code == 0:  # --help
            raise
        errors = [line for line in captured.getvalue().splitlines() if "error:" in line]
        raise InputError(errors[-1].split("error:", 1)[1].strip() if errors else "bad arguments") from None
    return args


def main() -> None:
    import warnings

    # peft asks models an attribute that transformers 5 renamed; the warning says nothing about this estimate.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    args = parse_estimate_args()
    check_numbers(args)
    if args.fit_table:
        print("\n".join(fit_table_lines(args)))
        return
    config = read_model_config(args.model_name_or_path, args.model_shape)
    counts = count_parameters(build_meta_model(config, args))
    print("\n".join(report_lines(config, args, counts)))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
