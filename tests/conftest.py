"""Session fixtures built on the fly, with no hub: a SentencePiece BPE tokenizer with byte
fallback (like LLaMA's) trained on a generated Chinese+English corpus, a tiny GQA Llama, an
extended-vocabulary tokenizer, tiny models of real families with their real tokenizers and chat
templates (helpers/families.py), and small corpora; plus helpers to run the scripts as users do."""

import json
import logging
import os
import random
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING = os.path.join(REPO, "scripts", "training")
PT_SCRIPT = os.path.join(TRAINING, "run_clm_pt_with_peft.py")
SFT_SCRIPT = os.path.join(TRAINING, "run_sft_with_peft.py")
KILL_WRAPPER = os.path.join(REPO, "tests", "helpers", "run_and_kill.py")

ENGLISH = "the quick brown fox jumps over lazy dog model data train learn token block river mountain city".split()
CHINESE = ["我们", "今天", "学习", "模型", "数据", "训练", "中文", "词表", "扩展", "北京", "上海", "天气", "很好", "人民", "日报",
           "经济", "发展", "科学", "技术", "语言"]
NEW_WORDS = ["预训练", "低秩适配", "强化学习", "奖励模型"]


def generated_corpus(num_lines: int, seed: int) -> list:
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(ENGLISH) if rng.random() < 0.5 else rng.choice(CHINESE) for _ in range(rng.randint(5, 14))]
        lines.append(" ".join(words))
    return lines


def repetitive_corpus(num_lines: int) -> list:
    """Text a model can learn within a few dozen steps: a few sentences, repeated."""
    sentences = [
        "the quick brown fox jumps over the lazy dog",
        "我们 今天 学习 中文 模型 训练",
        "one two three four five six seven eight",
        "北京 上海 天气 很好 人民 日报",
    ]
    return [sentences[i % len(sentences)] for i in range(num_lines)]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    work = tmp_path_factory.mktemp("tokenizer")
    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(generated_corpus(2000, seed=0)) + "\n", encoding="utf-8")
    spm_dir = work / "spm"
    spm_dir.mkdir()
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(spm_dir / "tokenizer"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        num_threads=1,
        minloglevel=2,
    )
    # LlamaTokenizer(vocab_file=...) silently yields a 3-token tokenizer in transformers 5;
    # from_pretrained on the directory converts the .model properly.
    tokenizer = LlamaTokenizer.from_pretrained(str(spm_dir))
    out = work / "hf"
    tokenizer.save_pretrained(str(out))
    return str(out)


def pretrain_briefly(model, tokenizer, steps: int = 200, block: int = 32, batch: int = 8) -> None:
    """A few seconds of full training on the generated corpus, so the fixture behaves like a
    base model (a trained lm_head that LoRA can steer) rather than random weights, behind
    whose near-uniform head LoRA alone learns almost nothing."""
    import torch

    ids = []
    for line in generated_corpus(2000, seed=0):
        ids += tokenizer(line)["input_ids"] + [tokenizer.eos_token_id]
    data = torch.tensor(ids[: len(ids) // block * block]).view(-1, block)
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        rows = data[torch.randint(len(data), (batch,), generator=generator)]
        model(input_ids=rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    pretrain_briefly(model, tokenizer)
    out = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def extended_tokenizer_dir(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    added = tokenizer.add_tokens(NEW_WORDS)
    assert added == len(NEW_WORDS)
    out = tmp_path_factory.mktemp("extended_tokenizer")
    tokenizer.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory):
    """family_model_dir(name): a directory with a tiny model of that family (helpers/families.py) and its
    real tokenizer and chat template, built once per session."""
    from helpers.families import build_family_model

    built = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = build_family_model(name, str(tmp_path_factory.mktemp(f"family_{name}")))
        return built[name]

    return get


def write_lines(path, lines) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def pretrain_dir(tmp_path_factory):
    """A .txt and a .jsonl file of learnable text."""
    root = tmp_path_factory.mktemp("pt_data")
    lines = repetitive_corpus(240)
    write_lines(root / "part1.txt", lines[:160])
    write_lines(root / "part2.jsonl", [json.dumps({"text": line}, ensure_ascii=False) for line in lines[160:]])
    return str(root)


@pytest.fixture(scope="session")
def varied_pretrain_dir(tmp_path_factory):
    """Random sentences: every block is distinct, so blocks identify the data a rank saw."""
    root = tmp_path_factory.mktemp("pt_varied")
    write_lines(root / "corpus.txt", generated_corpus(400, seed=5))
    return str(root)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def script_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def run_script(args, nproc: int = 1, script: str = PT_SCRIPT, wrapper: list = None, timeout: int = 600):
    """Run a training script the way users do: python, or torchrun with nproc processes."""
    command = [sys.executable]
    if nproc > 1:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    command += (wrapper or []) + [script] + [str(a) for a in args]
    return subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=timeout)


def options_to_argv(options: dict) -> list:
    args = []
    for key, value in options.items():
        if value is None:
            continue
        if value is True:
            args.append(f"--{key}")
        else:
            args += [f"--{key}", str(value)]
    return args


TINY_TRAINING_OPTIONS = {
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 8,
    "learning_rate": 3e-3,
    "max_steps": 10,
    "warmup_steps": 0,
    "lr_scheduler_type": "constant",
    "logging_steps": 1,
    "save_steps": 5,
    "seed": 42,
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "torch_dtype": "float32",
    "report_to": "none",
    "dataloader_num_workers": 0,
}


def refuse_in_process(script: str, args: list, capsys) -> tuple:
    """Run a script's main() through run_cli in this process (no interpreter start-up): returns
    (exit code, stdout, stderr). The subprocess tests prove the same contract end to end."""
    import importlib
    import sys as _sys

    from training_utils import run_cli

    module = importlib.import_module(os.path.splitext(os.path.basename(script))[0])
    saved_argv = _sys.argv
    # A script's logging set-up binds the root logger to this test's captured stdout, which is
    # closed after the test: restore the root logger so later tests do not write to it.
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    _sys.argv = [script] + [str(a) for a in args]
    capsys.readouterr()
    try:
        run_cli(module.main)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        _sys.argv = saved_argv
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tiny_pt_args(model_dir, data_dir, output_dir, cache_dir, **overrides) -> list:
    """Arguments of a short LoRA pretraining run on the tiny model."""
    options = {"model_name_or_path": model_dir, "dataset_dir": data_dir, "data_cache_dir": cache_dir,
               "output_dir": output_dir, "block_size": 32, "validation_split_percentage": 10,
               **TINY_TRAINING_OPTIONS, **overrides}
    return ["--do_train", "--use_cpu"] + options_to_argv(options)


def tiny_sft_args(model_dir, output_dir, cache_dir, **overrides) -> list:
    """Arguments of a short LoRA SFT run on the tiny model."""
    options = {"model_name_or_path": model_dir, "data_cache_dir": cache_dir, "output_dir": output_dir,
               "max_seq_length": 256, **TINY_TRAINING_OPTIONS, **overrides}
    return ["--do_train", "--use_cpu"] + options_to_argv(options)
