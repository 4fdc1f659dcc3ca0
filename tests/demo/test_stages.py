"""The demo's second DPO seed (the spread DPO's verdict needs, docs/demo.md "Verdict rules"): the DPO stage's own
command, into dpo_seed7/ with --seed 7, its answers scored as the first seed's. The commands are captured, nothing
trains."""

from pathlib import Path

from lorakit.demo import stages
from lorakit.demo.plan import FULL, Demo
from lorakit.pipeline.config import StageConfig
from lorakit.pipeline.stages import PlannedStage


def test_the_second_dpo_seed_runs_the_dpo_command_with_seed_7_into_its_own_directory(tmp_path, monkeypatch):
    demo = Demo(plan=FULL, cache_dir=tmp_path / "cache", output_dir=tmp_path / "out")
    command = ["python", "run_dpo.py", "--output_dir", str(demo.path("dpo")), "--beta", "0.5"]
    planned = PlannedStage(StageConfig(kind="dpo", name="dpo", flags={}), str(demo.path("dpo")), command, "", False)
    ran, scored = [], []
    monkeypatch.setattr(stages, "dpo_stage", lambda _: planned)
    monkeypatch.setattr(stages, "run_beside_the_chain", lambda cmd, out, what: ran.append((cmd, out, what)))
    monkeypatch.setattr(stages, "heldout_reward", lambda _, *policy: scored.append(policy) or {"reward_mean": 0.5})

    figures = stages.dpo_second_seed(demo)

    out = demo.path("dpo_seed7")
    assert ran == [(["python", "run_dpo.py", "--output_dir", str(out), "--beta", "0.5", "--seed", "7"], out,
                    "DPO with --seed 7")]
    assert scored == [(demo.path("sft", "sft_lora_model"), Path(out, "dpo_lora_model"))]  # SFT, then DPO, folded in
    assert figures == {"seed": 7, "reward_mean": 0.5}
    names = [name for name, _ in stages.STAGES]
    assert names.index("DPO, second seed") == names.index("reward after DPO") + 1
