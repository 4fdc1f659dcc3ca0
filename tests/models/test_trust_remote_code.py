"""--trust_remote_code: off by default, and when given it reaches every transformers loader of
the training stages, the merge tools and the inference scripts. A tiny model directory that
ships its own Python code (config.json auto_map, as on the hub) loads only with the flag."""

import json
import logging
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainingArguments

from lorakit.core.cli import InputError, parse_args
from lorakit.models import loader
from lorakit.models.arguments import ModelArguments
from lorakit.models.heads import reward_model_class
from lorakit.models.loader import load_model, load_model_config, load_tokenizer
from lorakit.rl.ppo_config import PPOModelArguments
from lorakit.rl.ppo_policy import actor_model_args, load_frozen

CONFIG_CODE = '''from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
'''
MODEL_CODE = '''from transformers import LlamaForCausalLM

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
'''
TOKENIZER_CODE = '''from transformers import PreTrainedTokenizerFast


class TinyRemoteTokenizer(PreTrainedTokenizerFast):
    pass
'''


def update_json(path, **values):
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    data.update(values)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle)


def add_tokenizer_code(directory) -> None:
    """Make a saved fast tokenizer one that names its own class in its own code."""
    (directory / "tokenization_tiny_remote.py").write_text(TOKENIZER_CODE)
    update_json(directory / "tokenizer_config.json", tokenizer_class="TinyRemoteTokenizer",
                auto_map={"AutoTokenizer": [None, "tokenization_tiny_remote.TinyRemoteTokenizer"]})


def word_tokenizer(size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0", eos_token="w1", pad_token="w1")


@pytest.fixture(scope="module")
def remote_model_dir(tmp_path_factory):
    """A tiny Llama whose config, model class and tokenizer class come from the directory's own .py files."""
    directory = tmp_path_factory.mktemp("remote") / "tiny_remote_model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64)).save_pretrained(directory)
    word_tokenizer(100).save_pretrained(directory)
    (directory / "configuration_tiny_remote.py").write_text(CONFIG_CODE)
    (directory / "modeling_tiny_remote.py").write_text(MODEL_CODE)
    update_json(directory / "config.json", model_type="tiny_remote", architectures=["TinyRemoteForCausalLM"],
                auto_map={"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
                          "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"})
    add_tokenizer_code(directory)
    return str(directory)


@pytest.fixture
def recorded_loads(monkeypatch):
    """The keyword arguments each transformers loader of models.loader is called with (nothing is loaded)."""
    calls = []

    def recorder(kind):
        return lambda path, **kwargs: calls.append((kind, kwargs)) or object()

    monkeypatch.setattr(loader.AutoConfig, "from_pretrained", recorder("config"))
    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", recorder("tokenizer"))
    return calls


@pytest.mark.parametrize("argv, expected", [([], False), (["--trust_remote_code"], True)], ids=["default", "given"])
def test_the_parsed_flag_reaches_the_config_and_tokenizer_loaders(argv, expected, remote_model_dir, recorded_loads):
    (model_args,) = parse_args((ModelArguments,), ["--model_name_or_path", remote_model_dir, *argv])
    assert model_args.trust_remote_code is expected
    load_model_config(model_args)
    load_tokenizer(model_args)
    assert recorded_loads == [("config", {"trust_remote_code": expected}),
                              ("tokenizer", {"trust_remote_code": expected})]


def test_every_stage_parser_defaults_to_off():
    from lorakit.serve.chat_config import ChatArguments
    from lorakit.serve.inference import InferenceModelArguments
    from lorakit.serve.server_config import ServerArguments

    (ppo_args,) = parse_args((PPOModelArguments,),
                             ["--actor_model_name_or_path", "a", "--reward_model_name_or_path", "r"])
    assert ppo_args.trust_remote_code is False
    for arguments in (ChatArguments, ServerArguments):
        _, defaults = parse_args((InferenceModelArguments, arguments), ["--base_model", "m"])
        _, given = parse_args((InferenceModelArguments, arguments), ["--base_model", "m", "--trust_remote_code"])
        assert (defaults.trust_remote_code, given.trust_remote_code) == (False, True)


def test_own_code_is_refused_without_the_flag(remote_model_dir):
    args = ModelArguments(model_name_or_path=remote_model_dir)
    for load in (load_model_config, load_tokenizer):
        with pytest.raises(InputError, match="rerun with --trust_remote_code"):
            load(args)


def test_own_code_runs_with_the_flag_and_says_so_once(remote_model_dir, tmp_path, caplog):
    loader.warn_remote_code.cache_clear()
    args = ModelArguments(model_name_or_path=remote_model_dir, trust_remote_code=True)
    with caplog.at_level(logging.INFO, logger="lorakit.models"):
        tokenizer = load_tokenizer(args)
        model = load_model(args, TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"), tokenizer)
    assert type(tokenizer).__name__ == "TinyRemoteTokenizer"
    assert type(model.get_base_model()).__name__ == "TinyRemoteForCausalLM"
    assert model.peft_config["default"].target_modules == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"}
    # Ours only: bitsandbytes' CPU backend logs its own "trust_remote_code" warning when the `kernels` package will not
    # fetch its kernel from the hub (seen with bitsandbytes 0.50.2 and kernels 0.19.1).
    warnings = [record.getMessage() for record in caplog.records if record.name.startswith("lorakit.")
                and record.levelno == logging.WARNING and "trust_remote_code" in record.getMessage()]
    assert warnings == [f"--trust_remote_code: running the model's own code from {os.path.abspath(remote_model_dir)}"]


def test_ppo_roles_carry_the_flag(remote_model_dir):
    ppo_args = PPOModelArguments(actor_model_name_or_path=remote_model_dir, reward_model_name_or_path=remote_model_dir,
                                 torch_dtype="float32", trust_remote_code=True)
    assert actor_model_args(ppo_args).trust_remote_code is True
    reference = load_frozen(remote_model_dir, None, "causal_lm", ppo_args)
    assert type(reference).__name__ == "TinyRemoteForCausalLM"
    ppo_args.trust_remote_code = False
    with pytest.raises(InputError, match="--trust_remote_code"):
        load_frozen(remote_model_dir, None, "causal_lm", ppo_args)


def test_reward_stage_refuses_a_config_without_a_known_classifier(remote_model_dir):
    config = load_model_config(ModelArguments(model_name_or_path=remote_model_dir, trust_remote_code=True))
    with pytest.raises(InputError, match="sequence classifier"):
        reward_model_class(config)


# ----------------------------------------------------------------------------- merge tools


@pytest.fixture(scope="module")
def remote_adapter_dir(remote_model_dir, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(remote_model_dir, trust_remote_code=True, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "down_proj"], r=4, init_lora_weights=False))
    directory = tmp_path_factory.mktemp("remote_adapter")
    peft_model.save_pretrained(directory)
    return str(directory)


def test_merge_verify_needs_the_flag_and_the_merged_model_keeps_its_code(remote_model_dir, remote_adapter_dir,
                                                                          tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from lorakit.commands import merge as merge_llama_with_lora

    merged = tmp_path / "tiny_remote_merged"
    arguments = ["--base_model", remote_model_dir, "--lora_model", remote_adapter_dir, "--output_dir", str(merged),
                 "--verify"]
    with pytest.raises(InputError, match="--trust_remote_code"):
        merge_llama_with_lora.main(arguments)
    assert not merged.exists()
    merge_llama_with_lora.main(arguments + ["--trust_remote_code"])
    assert "verify: max abs logit difference" in capsys.readouterr().out
    for name in ("configuration_tiny_remote.py", "modeling_tiny_remote.py", "tokenization_tiny_remote.py"):
        assert (merged / name).is_file()
    model = AutoModelForCausalLM.from_pretrained(str(merged), trust_remote_code=True)
    assert type(model).__name__ == "TinyRemoteForCausalLM"


@pytest.fixture(scope="module")
def remote_bpe_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer (the kind vocabulary extension accepts) with its own tokenizer class."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from helpers.corpora import generated_corpus

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(generated_corpus(500, seed=0), trainer)
    directory = tmp_path_factory.mktemp("remote_tokenizer") / "tiny_remote_bpe"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(directory)
    add_tokenizer_code(directory)
    return directory


def test_vocabulary_extension_of_a_tokenizer_with_its_own_code(remote_bpe_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from helpers.corpora import generated_corpus
    from lorakit.commands import merge_tokenizers

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(generated_corpus(400, seed=1)) + "\n", encoding="utf-8")
    merged = tmp_path / "tiny_remote_bpe_merged"
    arguments = ["--base_tokenizer", str(remote_bpe_tokenizer_dir), "--output_dir", str(merged),
                 "--train_corpus", str(corpus), "--vocab_size", "500", "--num_threads", "1"]
    with pytest.raises(InputError, match="--trust_remote_code"):
        merge_tokenizers.main(arguments)
    assert not merged.exists()
    merge_tokenizers.main(arguments + ["--trust_remote_code"])
    assert (merged / "tokenization_tiny_remote.py").is_file()
    tokenizer = AutoTokenizer.from_pretrained(str(merged), trust_remote_code=True)
    assert type(tokenizer).__name__ == "TinyRemoteTokenizer"
    assert len(tokenizer) > len(AutoTokenizer.from_pretrained(str(remote_bpe_tokenizer_dir), trust_remote_code=True))
