"""Session fixtures built on the fly, with no hub: a SentencePiece BPE tokenizer with byte
fallback (like LLaMA's) trained on a generated Chinese+English corpus, a tiny GQA Llama, an
extended-vocabulary tokenizer, tiny models of real families with their real tokenizers and chat
templates (helpers/families.py), and small corpora. Plain helpers live in helpers/: commands.py (running the
scripts, their exit contract), tiny_runs.py, corpora.py, run_outputs.py, merge_tools.py, run_in_sequence.py;
the resume probes step_probe.py (installed by run_and_kill.py), kill_points.py and forked_runs.py."""

import json
import os

import pytest

from helpers.corpora import NEW_WORDS, generated_corpus, repetitive_corpus, write_lines


@pytest.fixture(scope="session", autouse=True)
def fingerprint_memo_of_the_session(tmp_path_factory):
    """Merge and serving memoize weight fingerprints user-wide (core.fingerprints.user_memo_root): the tests keep
    theirs in the session's temporary directory (a subprocess inherits the variable)."""
    os.environ.setdefault("LORAKIT_FINGERPRINT_CACHE", str(tmp_path_factory.mktemp("fingerprint_memo")))


@pytest.fixture(autouse=True)
def no_run_recorded_yet():
    """A process runs one training run (data.run_record.current_run); the tests run many in this process
    (run_in_process) and call the data layer directly: each test starts with none recorded, so a run resumed by an
    earlier test does not refuse this test's data."""
    from lorakit.data import run_record

    run_record.begin_run({})


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


@pytest.fixture(scope="session")
def zero2_two_process_pretraining(tiny_model_dir, varied_pretrain_dir, tmp_path_factory):
    """A ZeRO-2 pretraining job of two processes on one node, 6 steps saved every 3 (as test_pretraining's other
    ZeRO configs run), each rank's blocks recorded (helpers/run_and_kill.py --record_batches): test_pretraining
    checks it, and test_multinode compares the same job on two nodes with it (the same world size, ranks and
    data, so the same weights)."""
    from helpers.commands import KILL_WRAPPER, REPO, run_script
    from helpers.tiny_runs import tiny_pt_args

    root = tmp_path_factory.mktemp("zero2_two_process_pretraining")
    out, record = root / "out", root / "batches"
    args = tiny_pt_args(tiny_model_dir, varied_pretrain_dir, out, root / "cache", max_steps=6, save_steps=3,
                        deepspeed=f"{REPO}/ds_configs/ds_zero2_no_offload.json")
    result = run_script(args, nproc=2, wrapper=[KILL_WRAPPER, "--record_batches", str(record)])
    return {"out": out, "record": record, "result": result}
