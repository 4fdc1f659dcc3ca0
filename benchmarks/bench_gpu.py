"""Benchmark: the toolkit on a GPU (`make gpu-check`): the entry of the benchmarks/gpu package, whose docstring and
plan.py say what each plan (--plan rl|sft|moe) measures; `--help` lists the plans and their time budgets. Also the
command each measured child process runs (--child run)."""

from gpu.main import main

if __name__ == "__main__":
    main()
