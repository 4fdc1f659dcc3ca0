"""LoRA merge (scripts/merge/merge_llama_with_lora.py): the merged model's logits equal peft's
merge_and_unload (max abs diff <= 1e-4 in float32) for a plain LoRA, rsLoRA with rank/alpha
patterns, fan_in_fan_out, modules_to_save on resized embeddings (tied and untied), a score head,
two chained adapters on a sharded base, and a real adapter from our pretraining script with
--verify; peak memory on a base of 10 shards; bad input refused before anything is written."""

import dataclasses
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from helpers.commands import REPO, assert_ok, check_refused, refuse, run_in_process, run_script, script_env
from helpers.merge_tools import TOLERANCE, load_merged, logits_of, lora, merge, tiny_llama
from helpers.tiny_runs import tiny_pt_args
from lorakit.core.cli import InputError
from lorakit.core.model_files import TEMPLATE_KWARGS_FILE
from lorakit.merge.inputs import LoraModule
from lorakit.merge.safetensors_stream import file_tensors
from lorakit.records.chat_templates import saved_template_kwargs

MERGE_DIR = os.path.join(REPO, "scripts", "merge")
SCRIPT = os.path.join(MERGE_DIR, "merge_llama_with_lora.py")

# An intermediate interpreter runs the measured child: a child forked from pytest itself would
# count pytest's pages in its ru_maxrss until it execs.
MEASURE = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(child.pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""
# A crash at a known point, patched in from outside the product code: the merge SIGKILLs itself
# right after the first chunk of its second output file reaches the file.
KILL_IN_SECOND_SHARD = """
import os, signal, sys
from lorakit.commands.merge import main
from lorakit.merge.safetensors_stream import SafetensorsWriter

write_chunk, files_begun = SafetensorsWriter.write, []

def write_then_die_in_second_file(self, chunk):
    write_chunk(self, chunk)
    if self.path not in files_begun:
        files_begun.append(self.path)
    if len(files_begun) == 2:
        self.handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)

SafetensorsWriter.write = write_then_die_in_second_file
main(sys.argv[2:])
"""


# ----------------------------------------------------------------------------- helpers


def safetensors_names(directory) -> dict:
    from safetensors import safe_open

    names = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as handle:
                names.update({key: name for key in handle.keys()})
    return names


# ----------------------------------------------------------------------------- one adapter, many kinds
# Each case saves its base (before any resize) to base_dir and returns (peft model, expectations).


def case_plain(base_dir, extended_dir):
    model = tiny_llama(400)
    model.save_pretrained(base_dir)
    return lora(model, 1), {}


def case_rslora_patterns(base_dir, extended_dir):
    model = tiny_llama(400)
    model.save_pretrained(base_dir)
    return lora(model, 2, use_rslora=True, rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
                alpha_pattern={"v_proj": 3}), {}


def case_bf16_base(base_dir, extended_dir):
    model = tiny_llama(400, dtype=torch.bfloat16)
    model.save_pretrained(base_dir)
    return lora(model, 3), {"bf16": True}


def from_disk(model, base_dir):
    """Save the base and load it back, as training does: peft then knows the base's path and,
    seeing the vocabulary resized, also saves whole embedding layers (extra keys to handle)."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(base_dir)
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def case_resized_modules_to_save(base_dir, extended_dir):
    model = from_disk(tiny_llama(400), base_dir)
    model.resize_token_embeddings(404, mean_resizing=False)
    return lora(model, 4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]), \
        {"tokenizer": extended_dir, "vocab": 404}


def case_tied_resized_ensure_tying(base_dir, extended_dir):
    model = from_disk(tiny_llama(400, tied=True), base_dir)
    model.resize_token_embeddings(404, mean_resizing=False)
    return lora(model, 5, modules_to_save=["embed_tokens"], ensure_weight_tying=True), \
        {"tokenizer": extended_dir, "vocab": 404, "tied": True}


def case_tied_trained_apart(base_dir, extended_dir):
    model = tiny_llama(400, tied=True)
    model.save_pretrained(base_dir)
    return lora(model, 6, modules_to_save=["embed_tokens"]), {"tied": False}


def case_fan_in_fan_out(base_dir, extended_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=400, n_positions=64,
                                       bos_token_id=1, eos_token_id=2)).eval()
    model.save_pretrained(base_dir)
    return lora(model, 7, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True), {}


def case_score_head(base_dir, extended_dir):
    from transformers import LlamaForSequenceClassification

    tiny_llama(400).save_pretrained(base_dir)  # what users have: a causal LM; the head is new
    model = LlamaForSequenceClassification.from_pretrained(base_dir, num_labels=1, dtype=torch.float32).eval()
    return lora(model, 8, task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"]), {"score_head": True}


CASES = [case_plain, case_rslora_patterns, case_bf16_base, case_resized_modules_to_save,
         case_tied_resized_ensure_tying, case_tied_trained_apart, case_fan_in_fan_out, case_score_head]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[5:] for c in CASES])
def test_merged_logits_equal_peft(case, tmp_path, tiny_tokenizer_dir, extended_tokenizer_dir):
    from transformers import AutoTokenizer

    base_dir, adapter_dir, out = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    peft_model, expect = case(str(base_dir), extended_tokenizer_dir)
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(str(base_dir))
    peft_model.save_pretrained(str(adapter_dir))
    if "tokenizer" in expect:  # as training saves it: the adapter carries the extended tokenizer
        AutoTokenizer.from_pretrained(expect["tokenizer"]).save_pretrained(str(adapter_dir))

    vocab = expect.get("vocab", 400)
    input_ids = torch.tensor([[1, 5, 17, 42, 99, 250, 399, vocab - 1, vocab - 2, 3]])
    merged_by_peft = peft_model.merge_and_unload()
    reference = logits_of(merged_by_peft, input_ids)

    merge(base_dir, [adapter_dir], out)
    config = json.loads((out / "config.json").read_text())
    names = safetensors_names(out)
    if expect.get("bf16"):
        # 16-bit weights: ours rounds W + delta once, peft rounds delta then the sum: compare the
        # written tensors to one bfloat16 step.
        ours = file_tensors(str(out / "model.safetensors"))
        for name, tensor in merged_by_peft.state_dict().items():
            if name in ours:
                assert ours[name].dtype == torch.bfloat16
                assert torch.allclose(ours[name].read().float(), tensor.float(), rtol=2**-7, atol=1e-6), name
    else:
        merged = load_merged(out, expect.get("score_head", False))
        difference = (logits_of(merged, input_ids) - reference).abs().max().item()
        assert difference <= TOLERANCE, difference

    if "vocab" in expect:
        assert config["vocab_size"] == vocab
        assert len(AutoTokenizer.from_pretrained(str(out))) == vocab  # the adapter's tokenizer came along
    if expect.get("tied") is True:  # trained as one matrix: stays one
        assert config["tie_word_embeddings"] is True and "lm_head.weight" not in names
    if expect.get("tied") is False:  # trained apart: untied, as the trained peft model computes
        assert config["tie_word_embeddings"] is False and "lm_head.weight" in names
    if expect.get("score_head"):
        assert config["architectures"] == ["LlamaForSequenceClassification"] and "score.weight" in names
        assert "lm_head.weight" not in names


# ----------------------------------------------------------------------------- chained adapters, shards


def test_chained_adapters_on_sharded_base(tmp_path, tiny_tokenizer_dir, extended_tokenizer_dir):
    """pt -> sft: the first adapter resizes the vocabulary (modules_to_save), the second was
    trained on the first merged (LoRA on the resized embedding among others); the base has >= 8
    shards. Merged in one command, chunk by chunk, then re-sharded."""
    from transformers import AutoTokenizer

    base_dir, first, second = tmp_path / "base", tmp_path / "pt_lora", tmp_path / "sft_lora"
    model = tiny_llama(400)
    model.save_pretrained(str(base_dir), max_shard_size="40KB")
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(str(base_dir))
    base_files = [name for name in os.listdir(base_dir) if name.endswith(".safetensors")]
    assert len(base_files) >= 8

    model.resize_token_embeddings(404, mean_resizing=False)
    pt = lora(model, 11, target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["embed_tokens", "lm_head"])
    pt.save_pretrained(str(first))
    AutoTokenizer.from_pretrained(extended_tokenizer_dir).save_pretrained(str(first))
    sft = lora(pt.merge_and_unload(), 12, target_modules=["embed_tokens", "o_proj", "gate_proj"], r=2,
               lora_alpha=16, use_rslora=True)
    sft.save_pretrained(str(second))
    AutoTokenizer.from_pretrained(extended_tokenizer_dir).save_pretrained(str(second))
    (second / TEMPLATE_KWARGS_FILE).write_text('{"enable_thinking": false}')  # as SFT saves --enable_thinking false
    input_ids = torch.tensor([[1, 7, 99, 400, 401, 402, 403, 250, 2]])
    reference = logits_of(sft.merge_and_unload(), input_ids)

    mirrored, resharded = tmp_path / "merged", tmp_path / "merged_resharded"
    merge(base_dir, [first, second], mirrored, "--chunk_mb", 0.01)  # many row chunks per tensor
    merge(base_dir, [first, second], resharded, "--max_shard_size", "100KB")
    for out in (mirrored, resharded):
        difference = (logits_of(load_merged(out), input_ids) - reference).abs().max().item()
        assert difference <= TOLERANCE, (out, difference)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        names = safetensors_names(out)
        assert index["weight_map"] == names  # every tensor listed, in the file that holds it
        data_bytes = sum(entry.dtype.itemsize * math.prod(entry.shape)
                         for name in set(names.values())
                         for entry in file_tensors(str(out / name)).values())
        assert index["metadata"]["total_size"] == data_bytes
        assert json.loads((out / "config.json").read_text())["vocab_size"] == 404
        assert saved_template_kwargs(str(out)) == {"enable_thinking": False}  # chat renders as training did
    assert sorted(n for n in os.listdir(mirrored) if n.endswith(".safetensors")) == sorted(base_files)
    sizes = [os.path.getsize(resharded / n) for n in os.listdir(resharded) if n.endswith(".safetensors")]
    assert len(sizes) >= 3 and max(sizes) <= 100_000 + 64 * 1024  # a tensor larger than the limit gets its own file


@pytest.mark.slow
def test_trained_adapter_with_verify(tmp_path, tiny_tokenizer_dir, extended_tokenizer_dir, pretrain_dir):
    """A real adapter from run_clm_pt_with_peft.py (extended vocabulary, trainable embeddings),
    merged by the script as users run it, with --verify against peft."""
    from transformers import AutoTokenizer

    base_dir = tmp_path / "base"  # random weights will do: only the merge's fidelity is measured
    tiny_llama(400).save_pretrained(str(base_dir))
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(str(base_dir))
    train_out = tmp_path / "pt"
    result = run_script(tiny_pt_args(str(base_dir), pretrain_dir, str(train_out), str(tmp_path / "cache"),
                                     tokenizer_name_or_path=extended_tokenizer_dir,
                                     modules_to_save="embed_tokens,lm_head",
                                     max_steps=3, save_steps=100, validation_split_percentage=0))
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = train_out / "pt_lora_model"
    out = tmp_path / "merged"
    result = subprocess.run([sys.executable, SCRIPT, "--base_model", str(base_dir), "--lora_model", str(adapter),
                             "--output_dir", str(out), "--verify"], cwd=REPO, env=script_env(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"verify: max abs logit difference, peft base\+adapters vs merged: (\S+)", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) <= TOLERANCE
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 404
    assert len(AutoTokenizer.from_pretrained(str(out))) == 404


def test_merge_imports_neither_transformers_nor_peft(tmp_path, tiny_tokenizer_dir):
    """The merge path needs torch only (transformers + peft cost seconds and memory to import)."""
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    model = tiny_llama(400)
    model.save_pretrained(str(base_dir))
    lora(model, 13).save_pretrained(str(adapter_dir))
    code = ("import sys; from lorakit.commands.merge import main; "
            "main(sys.argv[2:]); print('heavy imports:', sorted({'transformers', 'peft'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code, MERGE_DIR, "--base_model", str(base_dir), "--lora_model",
                             str(adapter_dir), "--output_dir", str(tmp_path / "merged")],
                            cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "heavy imports: []" in result.stdout


# ----------------------------------------------------------------------------- memory


def write_random_llama(directory, layers=10, hidden=1024, intermediate=2816, vocab=16000, shards=10) -> int:
    """A float32 Llama checkpoint of random weights in `shards` files, written directly (no
    transformers model is built); returns its size in bytes."""
    from safetensors.torch import save_file

    directory.mkdir()
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        shapes.update({prefix + "input_layernorm.weight": (hidden,),
                       prefix + "post_attention_layernorm.weight": (hidden,)})
        shapes.update({f"{prefix}self_attn.{p}_proj.weight": (hidden, hidden) for p in "qkvo"})
        shapes.update({prefix + "mlp.gate_proj.weight": (intermediate, hidden),
                       prefix + "mlp.up_proj.weight": (intermediate, hidden),
                       prefix + "mlp.down_proj.weight": (hidden, intermediate)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    total = sum(math.prod(shape) * 4 for shape in shapes.values())
    generator = torch.Generator().manual_seed(0)
    weight_map, current, size, files = {}, {}, 0, []

    def flush():
        name = f"model-{len(files) + 1:05d}-of-{shards:05d}.safetensors"
        save_file(current, str(directory / name), metadata={"format": "pt"})
        weight_map.update({tensor: name for tensor in current})
        files.append(name)

    for name, shape in shapes.items():
        current[name] = torch.randn(shape, generator=generator) * 0.02
        size += math.prod(shape) * 4
        if size >= total / shards * (len(files) + 1) and len(files) < shards - 1:
            flush()
            current = {}
    flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                        "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": 16,
              "num_key_value_heads": 16, "vocab_size": vocab, "tie_word_embeddings": False,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "dtype": "float32"}
    (directory / "config.json").write_text(json.dumps(config))
    return total


def write_random_adapter(directory, base_dir, rank=16, alpha=32) -> int:
    """An adapter in peft's saved format (r=16 on every linear layer), written directly."""
    from safetensors.torch import save_file

    directory.mkdir()
    headers = {}
    for name in os.listdir(base_dir):
        if name.endswith(".safetensors"):
            headers.update(file_tensors(str(base_dir / name)))
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, entry in headers.items():
        if name.endswith("_proj.weight"):
            module = "base_model.model." + name[: -len(".weight")]
            out_features, in_features = entry.shape
            tensors[module + ".lora_A.weight"] = torch.randn((rank, in_features), generator=generator) * 0.02
            tensors[module + ".lora_B.weight"] = torch.randn((out_features, rank), generator=generator) * 0.02
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "fan_in_fan_out": False,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "modules_to_save": None, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}}))
    return os.path.getsize(directory / "adapter_model.safetensors")


def peak_rss(arguments, tmp_path) -> tuple:
    """(peak RSS in bytes, CompletedProcess) of `python arguments...`, measured alone."""
    figures = tmp_path / "rss.txt"
    result = subprocess.run([sys.executable, "-c", MEASURE, str(figures), sys.executable, *map(str, arguments)],
                            cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return int(figures.read_text()), result


def test_peak_memory_on_ten_shards(tmp_path):
    """The merge's own share of peak RSS on a 645 MB base of 10 shards (peak minus a bare
    `import torch`, whose 225-280 MB depend on the machine) stays below a tenth of the model's
    size plus the adapter's, and the whole process below the model's size: the model is never
    held whole. The merged weights are exact."""
    base_dir, adapter_dir, out = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    model_bytes = write_random_llama(base_dir)
    adapter_bytes = write_random_adapter(adapter_dir, base_dir)
    assert len([n for n in os.listdir(base_dir) if n.endswith(".safetensors")]) == 10
    peak, result = peak_rss([SCRIPT, "--base_model", base_dir, "--lora_model", adapter_dir, "--output_dir", out],
                            tmp_path)
    runtime, _ = peak_rss(["-c", "import torch"], tmp_path)  # what any torch process costs
    print(f"model {model_bytes / 2**20:.0f} MiB + adapter {adapter_bytes / 2**20:.0f} MiB: merge peak RSS "
          f"{peak / 2**20:.0f} MiB, of which torch runtime {runtime / 2**20:.0f} MiB")
    assert peak < model_bytes, result.stdout
    assert peak - runtime < 0.1 * (model_bytes + adapter_bytes)  # the merge itself: a few row chunks

    # Spot-check merged weights against W + (alpha / r) * B @ A (embed_tokens: copied through).
    base_index = json.loads((base_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out_index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    from safetensors import safe_open

    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.9.mlp.down_proj.weight", "model.layers.5.mlp.up_proj.weight"):
        with safe_open(str(base_dir / base_index[name]), "pt") as handle:
            expected = handle.get_tensor(name)
        if name.endswith("_proj.weight"):
            with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as handle:
                module = "base_model.model." + name[: -len(".weight")]
                expected = expected + 2.0 * handle.get_tensor(module + ".lora_B.weight") @ \
                    handle.get_tensor(module + ".lora_A.weight")
        with safe_open(str(out / out_index[name]), "pt") as handle:
            assert (handle.get_tensor(name) - expected).abs().max().item() <= 1e-6, name


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def small_base(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("bad_input_base")
    model = tiny_llama(400)
    model.save_pretrained(str(root / "base"))
    AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(str(root / "base"))
    lora(tiny_llama(400), 21).save_pretrained(str(root / "adapter"))
    # Same architecture and vocabulary, another width: every LoRA shape differs from the base's.
    other = LlamaForCausalLM(LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    lora(other, 22).save_pretrained(str(root / "other_adapter"))
    (root / "no_config").mkdir()
    return root


def snapshot(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


BAD_INPUT_CASES = ["another_base", "no_adapter_config", "output_exists", "output_is_base", "tokenizer_too_large"]


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input(case, small_base, tmp_path, extended_tokenizer_dir):
    base, adapter, out = small_base / "base", small_base / "adapter", tmp_path / "out"
    if case == "another_base":
        adapter, expected = small_base / "other_adapter", "an adapter for another model"
    elif case == "no_adapter_config":
        adapter, expected = small_base / "no_config", "is not a LoRA adapter (no adapter_config.json)"
    elif case == "output_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expected = "--output_dir exists and is not empty"
    elif case == "output_is_base":
        out, expected = base, "--output_dir is the same directory as --base_model"
    else:  # an adapter whose tokenizer is larger than the embeddings it trained
        adapter = with_tokenizer(small_base / "adapter", extended_tokenizer_dir, tmp_path)
        expected = "the tokenizer has 404 tokens but the merged embeddings have 400 rows"
    before = snapshot(small_base)
    # The first case runs as a real process; the others in-process through the same run_cli.
    result = refuse(SCRIPT, ["--base_model", base, "--lora_model", adapter, "--output_dir", out],
                    in_process=case != BAD_INPUT_CASES[0])
    check_refused(result, expected)
    assert snapshot(small_base) == before  # inputs untouched
    if case == "output_exists":
        assert os.listdir(out) == ["keep.txt"]
    elif case != "output_is_base":
        assert not out.exists()
    assert not [name for name in os.listdir(out.parent) if ".tmp-" in name]


# A safetensors header that is valid JSON but not what the format says: not an object, or an entry that is not one.
MALFORMED_HEADERS = {
    "not_an_object": (["model.embed_tokens.weight"], "not a safetensors file (header is not a JSON object)"),
    "entry_not_an_object": ({"model.embed_tokens.weight": "F32"},
                            "tensor model.embed_tokens.weight: no shape or data offsets in the header"),
}


@pytest.mark.parametrize("where", ["base", "adapter"])
@pytest.mark.parametrize("case", list(MALFORMED_HEADERS))
def test_malformed_safetensors_header_refused(case, where, small_base, tmp_path):
    """The merge reads headers with core.model_files.safetensors_header: a malformed one, in the base's weights or
    the adapter's, is the one-line refusal naming the file (exit 2), never an AttributeError's traceback."""
    import shutil

    header, message = MALFORMED_HEADERS[case]
    base, adapter, out = small_base / "base", small_base / "adapter", tmp_path / "out"
    copy = tmp_path / where
    copy.mkdir()
    if where == "base":
        shutil.copy(base / "config.json", copy)
        damaged, base = copy / "model.safetensors", copy
    else:
        shutil.copy(adapter / "adapter_config.json", copy)
        damaged, adapter = copy / "adapter_model.safetensors", copy
    encoded = json.dumps(header).encode("utf-8")
    damaged.write_bytes(len(encoded).to_bytes(8, "little") + encoded)
    result = refuse(SCRIPT, ["--base_model", base, "--lora_model", adapter, "--output_dir", out], in_process=True)
    check_refused(result, f"{damaged}: {message}")
    assert not out.exists()


# ----------------------------------------------------------------------------- failures publish nothing


def test_verify_catches_a_wrong_merge(small_base, tmp_path, monkeypatch):
    """A merge that scales one module's delta 5% too much (patched in from outside the product code)
    fails --verify: exit 1, one error line naming the largest logit difference and the tolerance,
    nothing published, no temporary directory left, inputs untouched. The same wrong merge passes
    with a tolerance above the difference it reported: the flag decides, not a constant."""
    exact_add_to = LoraModule.add_to

    def add_to_with_wrong_scaling(self, rows, start, stop, loaded):
        if self.module.endswith("layers.1.mlp.down_proj"):
            self = dataclasses.replace(self, scaling=self.scaling * 1.05)
        exact_add_to(self, rows, start, stop, loaded)

    monkeypatch.setattr(LoraModule, "add_to", add_to_with_wrong_scaling)
    before, out = snapshot(small_base), tmp_path / "merged"
    arguments = ["--base_model", small_base / "base", "--lora_model", small_base / "adapter", "--output_dir", out,
                 "--verify"]
    result = run_in_process(SCRIPT, arguments)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    reported = float(re.search(r"peft base\+adapters vs merged: (\S+) ", result.stdout).group(1))
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, result.stderr
    match = re.search(r"differ from peft's merge by up to (\S+), above --verify_tolerance (\S+);", error_lines[0])
    assert match, error_lines[0]
    assert float(match.group(1)) == reported and float(match.group(2)) == 1e-3
    assert reported > 1e-3
    assert os.listdir(tmp_path) == []  # neither the output nor the temporary directory
    assert snapshot(small_base) == before

    assert_ok(run_in_process(SCRIPT, arguments + ["--verify_tolerance", 2 * reported]))
    assert (out / "model.safetensors").is_file()


def test_inputs_byte_identical_after_merge_and_verify(small_base, tmp_path):
    before = snapshot(small_base)  # every file of the base and the adapters, byte for byte
    merge(small_base / "base", [small_base / "adapter"], tmp_path / "merged")
    assert snapshot(small_base) == before
    merge(small_base / "base", [small_base / "adapter"], tmp_path / "verified", "--verify")
    assert snapshot(small_base) == before


def test_output_synced_before_the_rename(small_base, tmp_path, monkeypatch):
    """Every published file and the directory holding them are fsynced before the rename that
    publishes them, and the parent directory after it (the rename itself is then durable)."""
    events, real_fsync, real_rename = [], os.fsync, os.rename

    def recording_fsync(descriptor):
        status = os.fstat(descriptor)
        events.append(("fsync", (status.st_dev, status.st_ino)))
        real_fsync(descriptor)

    def recording_rename(source, target, *args, **kwargs):
        real_rename(source, target, *args, **kwargs)
        events.append(("rename", str(target)))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "rename", recording_rename)
    out = tmp_path / "merged"
    merge(small_base / "base", [small_base / "adapter"], out, "--max_shard_size", "100KB")
    renames = [i for i, event in enumerate(events) if event[0] == "rename"]
    assert [events[i][1] for i in renames] == [str(out)]
    synced_before = {key for kind, key in events[: renames[0]] if kind == "fsync"}
    synced_after = {key for kind, key in events[renames[0]:] if kind == "fsync"}

    def identity(path):
        status = os.stat(path)
        return status.st_dev, status.st_ino

    published = [out / name for name in os.listdir(out)]
    assert len(published) >= 8  # 6 shards, the index, config.json, the tokenizer
    assert [path.name for path in published if identity(path) not in synced_before] == []
    assert identity(out) in synced_before and identity(tmp_path) in synced_after


def test_merge_killed_mid_write_publishes_nothing(small_base, tmp_path, caplog):
    """SIGKILL while the second of six output files is being written: no output directory. The
    temporary one stays behind, recognisable (.merged.tmp-*) with one whole and one torn file; the
    next run ignores it (neither uses nor removes it), names it in a warning, and publishes the
    same bytes as a merge that never crashed."""
    base, adapter, out = small_base / "base", small_base / "adapter", tmp_path / "merged"
    layout = ["--max_shard_size", "100KB", "--chunk_mb", 0.01]  # several files, several chunks per tensor
    arguments = ["--base_model", base, "--lora_model", adapter, "--output_dir", out, *layout]
    result = subprocess.run([sys.executable, "-c", KILL_IN_SECOND_SHARD, MERGE_DIR, *map(str, arguments)],
                            cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert not out.exists()
    leftovers = os.listdir(tmp_path)
    assert len(leftovers) == 1 and leftovers[0].startswith(".merged.tmp-"), leftovers
    leftover = tmp_path / leftovers[0]
    whole, torn = sorted(os.listdir(leftover))
    assert set(file_tensors(str(leftover / whole))) == {"lm_head.weight"}
    with pytest.raises(InputError, match="lies beyond the end of the file"):
        file_tensors(str(leftover / torn))

    with caplog.at_level(logging.WARNING, logger="merge_llama_with_lora"):
        merge(base, [adapter], out, *layout)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any(str(leftover) in message and "interrupted merge" in message for message in warnings), warnings
    assert sorted(os.listdir(leftover)) == [whole, torn]
    never_crashed = tmp_path / "clean" / "merged"
    merge(base, [adapter], never_crashed, *layout)
    assert snapshot(out) == snapshot(never_crashed)


def with_tokenizer(adapter, tokenizer_dir, tmp_path):
    """A copy of the adapter carrying the files of another tokenizer (a larger one: the refusal cases)."""
    import shutil

    copy = tmp_path / "adapter_with_big_tokenizer"
    shutil.copytree(adapter, copy)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), copy)
    return copy
