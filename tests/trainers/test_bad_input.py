"""Bad input: one line naming the problem (file, line, field), exit 2, no traceback, nothing written."""

import json
import subprocess
import sys

import pytest

from helpers.commands import (
    PT_SCRIPT,
    REPO,
    SFT_SCRIPT,
    check_refused,
    free_port,
    options_to_argv,
    refuse,
    run_in_process,
    run_script,
    script_env,
)
from helpers.tiny_runs import tiny_pt_args, tiny_sft_args


def write(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def snapshot(directory):
    if not directory.exists():
        return None
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


GOOD_LINE = json.dumps({"text": "我们 今天 学习 模型 训练 the quick brown fox"}, ensure_ascii=False).encode() + b"\n"


def case_missing_dir(tmp_path, model_dir):
    return {"dataset_dir": tmp_path / "nope"}, "nope: --dataset_dir does not exist"


def case_no_text_files(tmp_path, model_dir):
    write(tmp_path / "data" / "notes.csv", b"a,b\n")
    return {"dataset_dir": tmp_path / "data"}, "no .txt or .jsonl files"


def case_broken_json(tmp_path, model_dir):
    write(tmp_path / "data" / "c.jsonl", GOOD_LINE + b'{"text": "unterminated\n' + GOOD_LINE)
    return {"dataset_dir": tmp_path / "data"}, "c.jsonl:2: not valid JSON"


def case_missing_text_field(tmp_path, model_dir):
    write(tmp_path / "data" / "c.jsonl", GOOD_LINE * 2 + b'{"content": "x"}\n')
    return {"dataset_dir": tmp_path / "data"}, "c.jsonl:3: field 'text' is missing"


def case_non_utf8(tmp_path, model_dir):
    write(tmp_path / "data" / "c.txt", "第一行\n".encode() + "第二行\n".encode("gbk"))
    return {"dataset_dir": tmp_path / "data"}, "c.txt:2: not valid UTF-8"


def case_empty_file(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    write(tmp_path / "data" / "b.txt", b"\n\n")
    return {"dataset_dir": tmp_path / "data"}, "b.txt: file holds no documents"


def case_block_size_too_large(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    return ({"dataset_dir": tmp_path / "data", "block_size": 512},
            "--block_size 512 exceeds the model's max_position_embeddings 256")


def case_peft_path_not_adapter(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    (tmp_path / "not_adapter").mkdir()
    return ({"dataset_dir": tmp_path / "data", "peft_path": tmp_path / "not_adapter"},
            "--peft_path is not a LoRA adapter (no adapter_config.json)")


def case_vocab_without_trainable_embeddings(tmp_path, model_dir, extended_tokenizer_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    return ({"dataset_dir": tmp_path / "data", "tokenizer_name_or_path": extended_tokenizer_dir},
            "the new rows would never be trained; add --modules_to_save embed_tokens,lm_head")


def lora_adapter(model, path, safe_serialization: bool = True, **config):
    """A LoRA adapter of model (a directory or a model) saved at path, as training would save one (or, without
    safe_serialization, as adapter_model.bin: peft's legacy format, that of many released adapters)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if isinstance(model, str):
        model = AutoModelForCausalLM.from_pretrained(model)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **config)
                   ).save_pretrained(str(path), safe_serialization=safe_serialization)
    return path


def narrow_llama():
    """Same architecture and vocabulary as the tiny base, half its width: every LoRA shape differs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def case_peft_path_for_another_base(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    adapter = lora_adapter(narrow_llama(), tmp_path / "narrow_adapter")
    return ({"dataset_dir": tmp_path / "data", "peft_path": adapter},
            f"the --peft_path adapter does not fit the base {model_dir}: model.layers.0.self_attn.")


def case_peft_path_of_another_model_type(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    adapter = lora_adapter(model_dir, tmp_path / "adapter")
    # The shapes fit; the base the adapter records is of another family.
    write(tmp_path / "qwen_base" / "config.json", json.dumps({"model_type": "qwen2"}).encode())
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path":
                                                             str(tmp_path / "qwen_base")}))
    return ({"dataset_dir": tmp_path / "data", "peft_path": adapter},
            "a qwen2 model, but the base is a llama model: an adapter for another model?")


def case_truncated_base_weights(tmp_path, model_dir):
    import shutil

    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    base = shutil.copytree(model_dir, tmp_path / "base")
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    return ({"dataset_dir": tmp_path / "data", "model_name_or_path": base},
            f"{weights}: tensor ")


def case_damaged_adapter_weights(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    adapter = lora_adapter(model_dir, tmp_path / "adapter")
    (adapter / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    return ({"dataset_dir": tmp_path / "data", "peft_path": adapter},
            "adapter_model.safetensors: not a safetensors file (header is not JSON")


def case_resume_from_a_non_checkpoint(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    write(tmp_path / "somewhere" / "notes.txt", b"not a checkpoint")
    return ({"dataset_dir": tmp_path / "data", "resume_from_checkpoint": tmp_path / "somewhere"},
            "somewhere: --resume_from_checkpoint is not a complete checkpoint (no trainer_state.json)")


def case_jsonl_line_not_an_object(tmp_path, model_dir):
    write(tmp_path / "data" / "c.jsonl", GOOD_LINE + b'["text", "a list"]\n')
    return {"dataset_dir": tmp_path / "data"}, "c.jsonl:2: a record must be a JSON object"


CASES = [case_missing_dir, case_no_text_files, case_broken_json, case_missing_text_field, case_non_utf8,
         case_empty_file, case_block_size_too_large, case_peft_path_not_adapter,
         case_vocab_without_trainable_embeddings, case_peft_path_for_another_base, case_peft_path_of_another_model_type,
         case_truncated_base_weights, case_damaged_adapter_weights, case_resume_from_a_non_checkpoint,
         case_jsonl_line_not_an_object]


@pytest.mark.parametrize("case", CASES, ids=[case.__name__[5:] for case in CASES])
def test_bad_input_is_refused_cleanly(case, tmp_path, tiny_model_dir, extended_tokenizer_dir):
    extra = (extended_tokenizer_dir,) if "vocab" in case.__name__ else ()
    overrides, expected = case(tmp_path, tiny_model_dir, *extra)
    out, cache = tmp_path / "out", tmp_path / "cache"
    options = {"dataset_dir": None, **overrides}
    args = tiny_pt_args(tiny_model_dir, options.pop("dataset_dir"), out, cache, **options)
    # The first case runs as a real process; the others in-process through the same run_cli.
    check_refused(refuse(PT_SCRIPT, args, in_process=case is not CASES[0]), expected)
    assert not out.exists()
    assert not cache.exists()  # not even created empty


def test_non_empty_output_dir_is_left_untouched(tmp_path, tiny_model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    out = tmp_path / "out"
    write(out / "precious.txt", b"keep me")
    before = snapshot(out)
    result = run_script(tiny_pt_args(tiny_model_dir, tmp_path / "data", out, tmp_path / "cache"))
    check_refused(result, "--output_dir is not empty and holds no complete checkpoint")
    assert snapshot(out) == before


# ----------------------------------------------------------------------------- every stage's record files

STAGE_RECORDS = {"sft": {"instruction": "q", "output": "a"},
                 "reward": {"prompt": "写一条好评", "chosen": "很好", "rejected": "不好"},
                 "ppo": {"instruction": "写一条好评"}}


def good_record(stage: str) -> bytes:
    return json.dumps(STAGE_RECORDS[stage], ensure_ascii=False).encode() + b"\n"


RECORD_CASES = {  # name: (file name, its content for a stage, expected)
    "empty_file": ("d.jsonl", lambda stage: b"", "d.jsonl: file holds no records (empty)"),
    "broken_json": ("d.jsonl", lambda stage: good_record(stage) + b'{"prompt": \n', "d.jsonl:2: not valid JSON"),
    "json_not_a_list": ("d.json", lambda stage: good_record(stage),
                        "d.json:1: a .json data file must hold a list of records"),
    "line_not_an_object": ("d.jsonl", lambda stage: good_record(stage) + b'["q", "a"]\n',
                           "d.jsonl:2: a record must be a JSON object"),
    # json's decoder is recursive: this was a RecursionError traceback.
    "deep_nesting": ("d.jsonl", lambda stage: good_record(stage) + b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n",
                     "d.jsonl:2: lists and objects nested more than 100 levels deep"),
}
STAGE_CASES = [("reward", case) for case in RECORD_CASES] + [("ppo", case) for case in RECORD_CASES] + \
    [("sft", "json_not_a_list"), ("sft", "line_not_an_object")]


@pytest.fixture(scope="module")
def tiny_reward_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny base as a sequence classifier with a (random) score head: what PPO accepts as a reward model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tmp_path_factory.mktemp("reward_model")
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(str(path))
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(str(path))
    return str(path)


def stage_args(stage: str, data, model_dir, reward_dir, out, cache, **overrides) -> tuple:
    """(script, arguments) of a short run of the stage on the data file (pretraining: directory), with overrides."""
    training = f"{REPO}/scripts/training"
    if stage == "pt":
        return PT_SCRIPT, tiny_pt_args(model_dir, data, out, cache, **overrides)
    if stage == "sft":
        return SFT_SCRIPT, tiny_sft_args(model_dir, out, cache, data_path=data, template="alpaca", **overrides)
    if stage in ("reward", "dpo"):
        script = f"{training}/run_reward.py" if stage == "reward" else f"{training}/run_dpo.py"
        return script, tiny_sft_args(model_dir, out, cache, data_path=data, template="human_assistant", **overrides)
    options = {"actor_model_name_or_path": model_dir, "reward_model_name_or_path": reward_dir, "data_path": data,
               "template": "human_assistant", "max_prompt_seq_len": 32, "max_answer_seq_len": 16,
               "torch_dtype": "float32", "report_to": "none", "output_dir": out, "data_cache_dir": cache,
               "max_steps": 2, **overrides}
    return f"{training}/run_ppo.py", ["--use_cpu"] + options_to_argv(options)


@pytest.mark.parametrize("stage,case", STAGE_CASES, ids=[f"{stage}-{case}" for stage, case in STAGE_CASES])
def test_bad_record_files_are_refused_in_every_stage(stage, case, tmp_path, tiny_model_dir, tiny_reward_model_dir):
    file_name, content, expected = RECORD_CASES[case]
    data = write(tmp_path / file_name, content(stage))
    out, cache = tmp_path / "out", tmp_path / "cache"
    script, args = stage_args(stage, data, tiny_model_dir, tiny_reward_model_dir, out, cache)
    check_refused(run_in_process(script, args), expected)
    assert not out.exists()
    assert not cache.exists()


# ----------------------------------------------------------------------------- refusals of the model's loading plan

ZERO3_CONFIG = f"{REPO}/ds_configs/ds_zero3_no_offload.json"

# name: (the stage's overrides, given tmp_path; the error expected). Each is decided from the arguments and the
# model's config (and the adapter's files) before any data is read: nothing is tokenized or cached.
MODEL_CASES = {
    "empty_trainable": (lambda tmp_path: {"trainable": ""}, "--trainable must name at least one module for LoRA"),
    # peft's own reason follows (its wording differs between a causal LM and a sequence classifier).
    "trainable_matches_no_module": (lambda tmp_path: {"trainable": "q_porj"}, "--trainable q_porj: "),
    "qlora_with_zero3": (lambda tmp_path: {"load_in_kbits": 4, "deepspeed": ZERO3_CONFIG},
                         "--load_in_kbits 4/8 cannot be combined with a ZeRO-3 DeepSpeed config"),
    # No safetensors header to compare shapes from: the adapter is loaded onto the model's empty skeleton.
    "legacy_adapter_for_another_base": (
        lambda tmp_path: {"peft_path": lora_adapter(narrow_llama(), tmp_path / "narrow_adapter",
                                                    safe_serialization=False)},
        "adapter does not fit this base model (size mismatch"),
    "eval_without_held_out": (lambda tmp_path: {"eval_strategy": "steps", "validation_split_percentage": 0},
                              "--eval_strategy steps needs held-out"),
}
MODEL_STAGES = ("pt", "sft", "reward", "dpo", "ppo")


def good_stage_data(stage: str, tmp_path, pretrain_dir):
    """Valid data for a run of the stage (pretraining: a directory of text): what it would tokenize and cache."""
    if stage == "pt":
        return pretrain_dir
    kind = {"dpo": "reward"}.get(stage, stage)
    first, value = next(iter(STAGE_RECORDS[kind].items()))
    lines = [json.dumps({**STAGE_RECORDS[kind], first: f"{value} {i}"}, ensure_ascii=False) for i in range(8)]
    return write(tmp_path / "data.jsonl", "\n".join(lines).encode() + b"\n")


def check_refused_before_caching(stage: str, overrides: dict, expected: str, tmp_path, model_dir, reward_dir,
                                 pretrain_dir) -> None:
    """A run of the stage on good data with overrides is refused with expected, writes no output, and leaves the
    data cache, holding an entry of an earlier run, as it was (PPO: its ptx blocks are what it caches)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    if stage == "ppo":
        overrides = {**overrides, "unsupervised_dataset_dir": pretrain_dir}
    out, cache = tmp_path / "out", tmp_path / "cache"
    write(cache / "pt-of-an-earlier-run" / "dataset_info.json", b"{}")
    before = snapshot(cache)
    script, args = stage_args(stage, good_stage_data(stage, tmp_path, pretrain_dir), model_dir, reward_dir, out,
                              cache, **overrides)
    try:
        result = run_in_process(script, args)
    finally:
        unset_hf_deepspeed_config()  # a ZeRO-3 config registers itself process-wide: not for the tests that follow
    check_refused(result, expected)
    assert not out.exists()
    assert snapshot(cache) == before


@pytest.mark.parametrize("stage", MODEL_STAGES)
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_refusals_come_before_the_data_is_cached(case, stage, tmp_path, tiny_model_dir, tiny_reward_model_dir,
                                                       pretrain_dir):
    """What the model's loading would refuse is refused before the data is tokenized."""
    make_overrides, expected = MODEL_CASES[case]
    check_refused_before_caching(stage, make_overrides(tmp_path), expected, tmp_path, tiny_model_dir,
                                 tiny_reward_model_dir, pretrain_dir)


@pytest.mark.parametrize("stage", ("pt", "sft", "reward", "dpo"))
def test_a_held_out_share_leaving_nothing_to_train_on_is_refused_before_the_data_is_cached(
        stage, tmp_path, tiny_model_dir, tiny_reward_model_dir, pretrain_dir):
    """Known only once the data is tokenized (how many blocks, samples or pairs there are), yet refused before the
    tokenized data is cached. (PPO splits its prompts before it caches anything.)"""
    check_refused_before_caching(stage, {"validation_split_percentage": 100}, "leaves no training or no validation",
                                 tmp_path, tiny_model_dir, tiny_reward_model_dir, pretrain_dir)


def test_a_refusal_through_a_wrapper_leaves_no_default_cache(tmp_path, tiny_model_dir, pretrain_dir):
    """run_pt.sh's default DATA_CACHE lies next to OUTPUT: a refusal (QLoRA under ZeRO-3) creates neither."""
    output = tmp_path / "out"
    env = {**script_env(), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "MODEL": tiny_model_dir,
           "DATA": pretrain_dir, "OUTPUT": str(output), "DS_CONFIG": ZERO3_CONFIG, "MASTER_PORT": str(free_port())}
    overrides = {"bf16": "False", "torch_dtype": "float32", "block_size": "32", "preprocessing_num_workers": "1",
                 "load_in_kbits": "4", "report_to": "none"}
    args = [token for name, value in overrides.items() for token in (f"--{name}", value)]
    result = subprocess.run(["bash", f"{REPO}/scripts/training/run_pt.sh", "--use_cpu", *args], env=env,
                            capture_output=True, text=True, timeout=300)
    check_refused(result, "--load_in_kbits 4/8 cannot be combined with a ZeRO-3 DeepSpeed config")
    assert not output.exists() and not (tmp_path / "data_cache").exists()


def test_serving_refuses_an_adapter_for_another_base(tmp_path, tiny_model_dir):
    """--lora_model (chat, batch generation and the server share its loader) gets the training side's check."""
    adapter = lora_adapter(narrow_llama(), tmp_path / "narrow_adapter")
    data = write(tmp_path / "q.jsonl", b'{"prompt": "hello"}\n')
    args = ["--base_model", tiny_model_dir, "--lora_model", adapter, "--template", "alpaca", "--data_file", data,
            "--predictions_file", tmp_path / "p.jsonl"]
    check_refused(run_in_process(f"{REPO}/scripts/inference/chat.py", args),
                  f"the --lora_model adapter does not fit the base {tiny_model_dir}: model.layers.0.self_attn.")
    assert not (tmp_path / "p.jsonl").exists()
