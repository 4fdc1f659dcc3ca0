"""Benchmark: the toolkit on a GPU (`make gpu-check`, benchmarks/bench_gpu.py), one plan per call of at most 8
minutes (--plan rl|sft|moe), each run measured in a child process with the toolkit's own scripts, within the plan's
time budget.

On 7B- and 1B-shaped Llama and Qwen models and a Qwen3-MoE shape built from their configs (random seeded weights,
nothing downloaded; shapes.py): LoRA SFT tokens/s and model FLOPs utilisation against TRL's SFTTrainer (with and
without Liger's kernels) in the same run, our SFT's speed variants, QLoRA, peak memory with and without the chunked
loss, PPO's and GRPO's iteration split and sampler gap, and the rollout engines' milliseconds per new token.

The package, along its seams (each module's docstring has its details):
  plan.py           the plans: which measurements each runs, in priority order (rl, sft, moe; full: the earlier
                    single plan, every measurement, more than one call)
  settings.py       the command line and the run's settings (sizes, models, the smoke run's tiny ones)
  shapes.py         the model shapes; inputs.py the tokenizer, data and reward function every run reads
  specs.py          one run's spec: our script's flags or TRL's options, its needs, its time limits
  budget.py         the time budget: the runs in child processes with time limits, the results recorded as they come
  child.py          inside a child: the runs of its specs; probes.py the Trainer probe, packing_check.py the packed =
                    alone check, rollout_probe.py the rollout engines' timing
  report.py         each run's figures, ratios, the targets' verdicts, the JSON; flops.py the MFU formula;
                    tables.py the printed report
  state.py          what a run knows as it goes (settings, paths, results): the plan, the budget and the report
                    share it

Without a CUDA device the benchmark says so in one line and exits 2. --cpu_smoke runs the chosen plan's steps on tiny
shapes (2 layers, seq 64, 3 steps) on the CPU, to check the code paths: llama-tiny plays the 1B role, qwen-tiny the 7B
one and qwen3-moe-tiny the MoE one; TRL runs there unpacked, Liger, torch_varlen, flex_attention and QLoRA are
recorded not available. Its figures mean nothing (memory there is the child's peak RSS so far) and go to
outputs/bench/gpu_cpu_smoke-PLAN.json. Results: a table, and outputs/bench/gpu-PLAN.json (--output; the device, the
versions, the plan, every run's status and the variants' winners). benchmarks/README.md has the recipe for a GPU
machine without network.
"""
