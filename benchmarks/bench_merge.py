"""Benchmark: LoRA merge, ours (scripts/merge/merge_llama_with_lora.py) against peft (`make bench`).

The base is SmolLM2-135M-Instruct (from lorakit.demo.prepare_default: a PyPI wheel, converted
once and cached under --cache_dir; nothing comes from a model hub), re-saved in --dtype as
--shard_mb MB safetensors shards. Adapters are made with peft on it, r=16 on every linear layer
(random non-zero A and B, so every update is real work), in two variants:

* lora       - the LoRA alone (what an SFT stage saves);
* lora+embed - the LoRA plus embed_tokens in modules_to_save with ensure_weight_tying (what
               continued pretraining with trainable embeddings saves; SmolLM2 is tied).

Each side runs as its own child process, timed from start to exit, with its peak resident
memory read from os.wait4 (ru_maxrss of that child alone):

* ours - `python scripts/merge/merge_llama_with_lora.py --base_model B --lora_model A --output_dir O`
* peft - `AutoModelForCausalLM.from_pretrained(B, dtype=<base dtype>)`, `PeftModel.from_pretrained`,
         `merge_and_unload()`, `save_pretrained(O, max_shard_size=<same>)`: the usual recipe.

Runs alternate (ours, peft, ours, peft, ...) --repeats times; best and worst are reported. Both
outputs are then compared tensor by tensor (what each wrote for the same name), to show the
figures are for the same result. Targets (issue 6): peak RSS <= 0.5x peft's, wall time <= 1.0x.

Results are printed and written to outputs/bench/merge.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from measure import REPO, environment, print_table, scratch_dir, timed, write_json

MERGE_SCRIPT = REPO / "scripts" / "merge" / "merge_llama_with_lora.py"
RSS_TARGET = 0.5
WALL_TARGET = 1.0

PEFT_MERGE = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base, adapter, out, dtype, shard = sys.argv[1:6]
model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
model = PeftModel.from_pretrained(model, adapter)
model = model.merge_and_unload()
model.save_pretrained(out, max_shard_size=shard)
"""
IMPORT_TORCH = "import torch, safetensors"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo",
                        help="prepare_default.py cache holding the converted model (relative to the repo root)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="dtype of the re-saved base (checkpoints are usually bfloat16)")
    parser.add_argument("--shard_mb", type=int, default=50, help="shard size of the re-saved base, MB")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="outputs/bench/merge.json",
                        help="JSON results (relative to the repo root)")
    return parser.parse_args(argv)


def child_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    return env


# Runs in a small intermediate interpreter: a child forked from this (large) process would
# count the parent's pages in its own ru_maxrss until it execs.
MEASURE = """
import os, subprocess, sys, time
start = time.perf_counter()
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
with open(sys.argv[1], "w") as out:
    out.write(f"{time.perf_counter() - start} {usage.ru_maxrss * 1024}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(command: list, log_path: Path) -> tuple:
    """(wall seconds, peak RSS bytes) of one child process alone; raises if it fails."""
    figures = log_path.with_suffix(".figures")
    with open(log_path, "w") as log:
        result = subprocess.run([sys.executable, "-c", MEASURE, str(figures), *map(str, command)], cwd=REPO,
                                env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command[:3]))} ... failed ({result.returncode}):\n"
                         f"{log_path.read_text()[-3000:]}")
    wall, rss = figures.read_text().split()
    return float(wall), int(rss)  # Linux reports ru_maxrss in KiB; converted above


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors"))


def make_base(model_dir: str, out: Path, dtype: str, shard_mb: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.save_pretrained(out, max_shard_size=f"{shard_mb}MB")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


def make_adapter(base_dir: Path, out: Path, rank: int, embed: bool) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear", r=rank, lora_alpha=2 * rank,
                        init_lora_weights=False, modules_to_save=["embed_tokens"] if embed else None,
                        ensure_weight_tying=embed)
    model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
            elif parameter.requires_grad:  # the trained embedding: base + a visible change
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
    model.save_pretrained(out)


def compare_outputs(ours: Path, theirs: Path) -> dict:
    """Tensor by tensor: largest |difference| (in float32) and share of differing elements."""
    from safetensors import safe_open

    def tensors(directory: Path) -> dict:
        found = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), "pt") as handle:
                found.update({name: path for name in handle.keys()})
        return found

    mine, peft = tensors(ours), tensors(theirs)
    worst, differing, total = 0.0, 0, 0
    for name, path in mine.items():
        if name not in peft:
            continue
        with safe_open(str(path), "pt") as a, safe_open(str(peft[name]), "pt") as b:
            x, y = a.get_tensor(name).float(), b.get_tensor(name).float()
        worst = max(worst, (x - y).abs().max().item())
        differing += int((x != y).sum())
        total += x.numel()
    return {"tensors_ours": len(mine), "tensors_peft": len(peft), "only_in_peft": sorted(set(peft) - set(mine)),
            "max_abs_diff": worst, "differing_fraction": differing / max(total, 1)}


def side_figures(walls: list, peaks: list) -> dict:
    """One side's repeats: best and worst wall seconds, best and worst peak RSS in MiB."""
    return {"wall_best_s": min(walls), "wall_worst_s": max(walls), "wall_all_s": walls,
            "peak_rss_best_mib": min(peaks) / 2**20, "peak_rss_worst_mib": max(peaks) / 2**20}


def measure_variant(args, work: Path, base: Path, variant: str, embed: bool) -> dict:
    """An adapter of this variant, merged by ours and by peft in turn --repeats times; the figures
    of both and the comparison of the last two outputs."""
    adapter = work / f"adapter-{variant}"
    make_adapter(base, adapter, args.rank, embed)
    walls, peaks = {"ours": [], "peft": []}, {"ours": [], "peft": []}
    for rep in range(args.repeats):
        out = work / f"ours-{variant}-{rep}"
        theirs = work / f"peft-{variant}-{rep}"
        commands = {"ours": [sys.executable, str(MERGE_SCRIPT), "--base_model", str(base), "--lora_model",
                             str(adapter), "--output_dir", str(out)],
                    "peft": [sys.executable, "-c", PEFT_MERGE, str(base), str(adapter), str(theirs),
                             args.dtype, f"{args.shard_mb}MB"]}
        for side, command in commands.items():
            wall, rss = run_measured(command, work / f"{side}.log")
            walls[side].append(wall)
            peaks[side].append(rss)
        print(f"  {variant} repeat {rep + 1}: ours {walls['ours'][-1]:.2f}s {peaks['ours'][-1] / 2**20:.0f} MiB, "
              f"peft {walls['peft'][-1]:.2f}s {peaks['peft'][-1] / 2**20:.0f} MiB", flush=True)
        if rep < args.repeats - 1:
            shutil.rmtree(out)
            shutil.rmtree(theirs)
    row = {"variant": variant, "adapter_bytes": dir_bytes(adapter), "output_bytes_ours": dir_bytes(out),
           "output_bytes_peft": dir_bytes(theirs), "ours": side_figures(walls["ours"], peaks["ours"]),
           "peft": side_figures(walls["peft"], peaks["peft"]), "comparison": compare_outputs(out, theirs)}
    # Worst of ours against best of peft: the ratios hold however the shared machine behaved.
    row["rss_ratio_ours_to_peft"] = max(peaks["ours"]) / min(peaks["peft"])
    row["wall_ratio_ours_to_peft"] = max(walls["ours"]) / min(walls["peft"])
    row["meets_rss_target"] = row["rss_ratio_ours_to_peft"] <= RSS_TARGET
    row["meets_wall_target"] = row["wall_ratio_ours_to_peft"] <= WALL_TARGET
    shutil.rmtree(out)
    shutil.rmtree(theirs)
    return row


def print_results(results: list) -> None:
    print()
    header = f"{'variant':<11} {'side':<5} {'wall best':>9} {'worst':>6} {'RSS MiB':>8} {'output MB':>9}"
    print_table(header, (
        f"{row['variant']:<11} {side:<5} {row[side]['wall_best_s']:>8.2f}s {row[side]['wall_worst_s']:>5.2f}s "
        f"{row[side]['peak_rss_worst_mib']:>8.0f} {row[f'output_bytes_{side}'] / 1e6:>9.0f}"
        for row in results for side in ("ours", "peft")))
    print()
    for row in results:
        c = row["comparison"]
        print(f"{row['variant']}: ours/peft peak RSS {row['rss_ratio_ours_to_peft']:.2f} "
              f"({'meets' if row['meets_rss_target'] else 'MISSES'} <= {RSS_TARGET}), "
              f"wall {row['wall_ratio_ours_to_peft']:.2f} "
              f"({'meets' if row['meets_wall_target'] else 'MISSES'} <= {WALL_TARGET}); same tensors differ by at "
              f"most {c['max_abs_diff']:.3g} ({100 * c['differing_fraction']:.3f}% of elements)"
              + (f"; only peft writes {', '.join(c['only_in_peft'])}" if c["only_in_peft"] else ""))
    print("(ratios: our worst run against peft's best)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO)
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    from lorakit.demo.prepare_default import prepare_model

    transformers.logging.set_verbosity_error()
    with scratch_dir("bench_merge-") as work:
        model_dir = prepare_model(args.cache_dir)
        base = work / "base"
        _, seconds = timed(make_base, model_dir, base, args.dtype, args.shard_mb)
        shards = sorted(base.glob("model-*.safetensors"))
        base_bytes = dir_bytes(base)
        print(f"base: SmolLM2-135M-Instruct, {args.dtype}, {len(shards)} shards of <= {args.shard_mb} MB, "
              f"{base_bytes / 1e6:.0f} MB (prepared in {seconds:.1f}s); {os.cpu_count()} CPUs; "
              f"best of {args.repeats}", flush=True)
        baseline_wall, baseline_rss = run_measured([sys.executable, "-c", IMPORT_TORCH], work / "import.log")
        print(f"python + import torch, safetensors alone: {baseline_wall:.2f}s, {baseline_rss / 2**20:.0f} MiB",
              flush=True)
        results = [measure_variant(args, work, base, variant, embed)
                   for variant, embed in (("lora", False), ("lora+embed", True))]
    print_results(results)
    report = {
        "benchmark": "merge",
        "base": {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "shard_mb": args.shard_mb,
                 "shards": len(shards), "bytes": base_bytes},
        "adapter": {"rank": args.rank, "alpha": 2 * args.rank, "target_modules": "all-linear"},
        "baseline_import_torch": {"wall_s": baseline_wall, "peak_rss_mib": baseline_rss / 2**20},
        "repeats": args.repeats,
        "targets": {"rss_ratio_max": RSS_TARGET, "wall_ratio_max": WALL_TARGET},
        "environment": environment("torch", "transformers", "peft"),
        "results": results,
    }
    print(f"\nwrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
