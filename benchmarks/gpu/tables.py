"""The printed report: one table per kind of run (throughput, memory, RL iterations, rollout engines), then the
ratios, the verdicts, the variants' winners, failing packing checks and notes."""

from __future__ import annotations

from collections.abc import Callable

from measure import print_table

from .report import judge
from .state import RunState


def gb(value: float | None) -> str:
    return f"{value / 1024:.2f}" if value is not None else "-"


def figure(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def not_done_line(name: str, r: dict, name_width: int) -> str:
    return f"{name:<{name_width}} {r['status']}" + (f": {r['message'][:110]}" if r.get("message") else "")


def group_lines(results: dict, group: str, name_width: int, row: Callable[[str, dict], str]) -> list:
    """One table line per run of the group: row(its name padded to name_width, result), or why it has no figures."""
    return [row(f"{name:<{name_width}}", r) if r["status"] == "done" else not_done_line(name, r, name_width)
            for name, r in results.items() if r["group"] == group]


def name_width(results: dict, group: str, least: int) -> int:
    return max([least] + [len(name) for name, r in results.items() if r["group"] == group])


def check_text(check: dict | None) -> str:
    if not isinstance(check, dict):
        return "-"
    control = "-" if check["control_max_abs_diff"] is None else f"{check['control_max_abs_diff']:.1e}"
    text = f"{'yes' if check['passes'] else 'NO'} ({check['packed_max_abs_diff']:.1e}; control {control})"
    return text if check["passes"] else f"{text}: {check['verdict']}"


def sft_row(name: str, r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "-"
    return (f"{name} {r['batch']:>5} {r['tokens_per_s']:>10.0f} {r['median_tokens_per_s']:>10.0f} "
            f"{r['padding_pct']:>8.1f} "
            f"{r['median_step_s']:>7.3f} {r['model_tflops_per_s']:>8.1f} {mfu:>6} "
            f"{gb(r['peak_memory_mb']):>8}  {check_text(r.get('packing_check'))}")


def memory_row(name: str, r: dict) -> str:
    return (f"{name} {r['length']:>7} {'chunked' if r['chunked'] else 'full':>9} {r['dropout']:>7g} "
            f"{gb(r['peak_memory_mb']):>8} {gb(r['memory_at_trainer_mb']):>10} {gb(r['growth_mb']):>9}")


def rl_row(name: str, r: dict) -> str:
    phases = " ".join(figure(r[f"{phase}_s"], ">10.2f") for phase in ("generation", "scoring", "training"))
    return (f"{name} {figure(r['iteration_s'], '>11.2f')} {phases} {figure(r['response_length'], '>10.1f')} "
            f"{figure(r['sampler_gap_kl'], '>10.2e')} {figure(r['sampler_gap_logprob_abs'], '>10.2e')} "
            f"{gb(r['peak_memory_mb']):>8}")


def rollout_lines(results: dict) -> list:
    """One table line per engine of each rollout measurement (or why it has none)."""
    lines = []
    for name, r in results.items():
        if r["group"] != "rollout":
            continue
        if r["status"] != "done":
            lines.append(not_done_line(name, r, 20))
            continue
        for label, e in r["engines"].items():
            lines.append(f"{name:<20} {label:<26} {e['ms_per_token']:>10.2f} {e['answer_len']:>10} "
                         f"{e['first_call_s']:>12.1f} {e['graphs']:>7}")
    return lines


def has_group(results: dict, group: str) -> bool:
    """Whether the plan ran any run of the group: a plan prints only its own tables."""
    return any(r["group"] == group for r in results.values())


def print_sft_tables(results: dict, settings: dict) -> None:
    if has_group(results, "throughput"):
        width = name_width(results, "throughput", 34)
        print(f"\nLoRA SFT, seq {settings['seq_len']}, {settings['steps'] - settings['warmup_steps']} measured "
              f"steps (after {settings['warmup_steps']} warm-up)")
        print_table(f"{'run':<{width}} {'batch':>5} {'tokens/s':>10} {'at median':>10} {'padding%':>8} "
                    f"{'step s':>7} {'TFLOP/s':>8} {'MFU%':>6} {'peak GB':>8}  packing check: packed = alone "
                    "(max |diff|; whole-row control)",
                    group_lines(results, "throughput", width, sft_row))
    if has_group(results, "memory"):
        print("\nPeak memory, one row, batch 1, activation checkpointing (loaded: the model as loaded; growth: the "
              "peak over it)")
        print_table(f"{'run':<34} {'tokens':>7} {'loss':>9} {'dropout':>7} {'peak GB':>8} {'loaded GB':>10} "
                    f"{'growth GB':>9}",
                    group_lines(results, "memory", 34, memory_row))


def print_rl_tables(results: dict, settings: dict) -> None:
    if has_group(results, "rl"):
        print(f"\nPPO ({settings['ppo_prompts']} prompts) and GRPO ({settings['ppo_prompts']} prompts x "
              f"{settings['grpo_generations']} answers), {settings['ppo_answer_len']} new tokens, shared base "
              "(seconds, median over the iterations after the first; sampler gap per answer token)")
        print_table(f"{'run':<26} {'iteration s':>11} {'generation':>10} {'scoring':>10} {'training':>10} "
                    f"{'answer len':>10} {'gap KL':>10} {'gap |dlp|':>10} {'peak GB':>8}",
                    group_lines(results, "rl", 26, rl_row))
    if has_group(results, "rollout"):
        print(f"\nRollout engines, {settings['ppo_prompts']} prompts of {settings['ppo_prompt_len']} tokens, up to "
              f"{settings['ppo_answer_len']} new tokens, the actor built once (ms per new token: median of 3 calls "
              "after a warm-up call, which pays any compile)")
        print_table(f"{'run':<20} {'engine':<26} {'ms/token':>10} {'answer len':>10} {'warm-up s':>12} {'graphs':>7}",
                    rollout_lines(results))


def print_verdicts(verdicts: list) -> None:
    """The verdicts the ratios' own print leaves out: MFU in percent, the others as values."""
    for verdict in verdicts:
        if "MFU" in verdict["target"]:
            print(f"{verdict['target']}: {100 * verdict['value']:.1f}% ({'meets' if verdict['meets'] else 'MISSES'})")
        elif not verdict.get("ratio"):
            print(f"{verdict['target']}: {verdict['value']:.2f} ({'meets' if verdict['meets'] else 'MISSES'})")


def print_report(state: RunState, report: dict) -> None:
    peak_flops = report["peak_bf16_flops"]
    print(f"\nDevice: {report['device']}; peak bf16 dense: "
          f"{f'{peak_flops / 1e12:.0f} TFLOP/s' if peak_flops else 'unknown (MFU not reported)'}; "
          f"trl {report['environment']['trl']}, liger_kernel {report['environment']['liger_kernel']}; "
          f"plan {report['plan']['name']}: {report['elapsed_s']:.0f} s of a {report['time_budget_s']:.0f} s budget")
    print_sft_tables(state.results, state.settings)
    print_rl_tables(state.results, state.settings)
    ratios, verdicts, notes = judge(state)
    ratios.print(56)
    print_verdicts(verdicts)
    for model, winner in report["winners"].items():
        print(f"{model}: best packed run {winner['best'] or '-'}; re-run: {winner['re_run'] or winner['why']}")
    for name, verdict in report["packing_checks_failing"].items():
        print(f"{name}: packing check FAILS ({verdict})")
    for line in notes:
        print(f"note: {line}")
    if state.settings["smoke"]:
        print("\n(--cpu_smoke: tiny shapes on the CPU, the runs of consecutive steps in one process: the figures only "
              "show that each code path runs; memory is the process's peak RSS so far)")
