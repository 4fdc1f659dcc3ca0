"""The demo's second DPO seed (the spread DPO's verdict needs, docs/demo.md "Verdict rules"): the DPO stage's own
command, into dpo_seed7/ with --seed 7, its answers scored as the first seed's. The commands are captured, nothing
trains."""

from pathlib import Path

from lorakit.demo import stages
from lorakit.demo.plan import FULL, SFT_HELDOUT_SEED, SFT_MAX_OPERAND, SFT_TRAIN_SEED, Demo
from lorakit.demo.sft_tasks import QUESTION, arithmetic_records, question_key
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


def commuted(question: str) -> str:
    """ "What is a + b?" -> "What is b + a?"; any other question as it is."""
    match = QUESTION.fullmatch(question)
    if match is None or match.group(2) != "+":
        return question
    return f"What is {match.group(3)} + {match.group(1)}?"


def test_a_commuted_addition_is_the_same_question():
    assert question_key("What is 47 + 89?") == question_key("What is 89 + 47?") == "47 + 89"
    assert question_key("What is 89 - 47?") != question_key("What is 47 - 89?")
    assert question_key("Write a review.") == "Write a review."


def test_no_held_out_question_has_its_commuted_twin_in_training():
    """The full demo's SFT sets: the seeds draw held-out and GRPO questions whose commuted twin is a training
    question (a string comparison let 19 of 200 through); unseen_records skips them."""
    train = {record["instruction"]
             for record in arithmetic_records(FULL.sft_train_records, SFT_TRAIN_SEED, SFT_MAX_OPERAND)}
    drawn = arithmetic_records(2 * FULL.sft_heldout_records, SFT_HELDOUT_SEED, SFT_MAX_OPERAND)
    assert sum(commuted(record["instruction"]) in train and record["instruction"] not in train
               for record in drawn) >= 10
    heldout, skipped = stages.unseen_records(FULL.sft_heldout_records, SFT_HELDOUT_SEED,
                                             {question_key(question) for question in train})
    assert len(heldout) == FULL.sft_heldout_records and skipped >= 10
    assert not [record for record in heldout if commuted(record["instruction"]) in train]
    assert not [record for record in heldout if record["instruction"] in train]
