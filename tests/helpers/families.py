"""Tiny models of real model families, each with its family's real tokenizer and chat template, built with
no hub.

Why: conftest's tokenizer is trained on the fly and has no chat template, so it shows none of what differs
between families: byte-level BPE or SentencePiece, a BOS added or not, an end-of-turn token that is or is not
EOS, a pad token or none, templates that drop earlier reasoning or move the system prompt. llama.cpp vendors
the real vocabularies as vocabulary-only GGUF files and the published chat templates as .jinja files, and
both ship in the llama-cpp-python sdist: `make test` extracts them into .cache/vendor/llama.cpp-models/ (see
the Makefile). transformers builds a fast tokenizer from a GGUF; we set each family's special tokens as its
real tokenizer_config does, attach the template byte for byte, and pair it with a tiny, randomly initialised
model of the family's own architecture.

Converting a GGUF vocabulary and checking the saved result takes 1-13 s (about 35 s for all eight on a fresh
clone), so each tokenizer is converted once and kept under .cache/fixtures/tokenizers/, keyed by a hash of
everything it is built from; the models are tiny and built fresh.

    FAMILIES                         name -> FamilySpec (dense)
    MOE_FAMILIES                     name -> FamilySpec (mixtures of experts)
    family_tokenizer_dir(name)       the cached tokenizer directory (built on first use)
    build_family_model(name, out)    tokenizer + tiny model saved into `out`; returns `out`
"""

import copy
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENDORED = os.path.join(REPO, ".cache", "vendor", "llama.cpp-models")
TOKENIZER_CACHE = os.path.join(REPO, ".cache", "fixtures", "tokenizers")
# Bump when the way a tokenizer is built changes, so cached directories built the old way are not reused.
BUILD_VERSION = 1
_IDS_FILE = "family_ids.json"

# One tiny size for every family (built in well under a second); each keeps its architecture's own features.
_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 512}


@dataclass(frozen=True)
class FamilySpec:
    """One family: where its vocabulary and template come from, its special tokens as its real
    tokenizer_config sets them, and a tiny config of its architecture."""

    name: str
    vocab: str  # ggml-vocab-*.gguf in VENDORED
    template: str | None  # templates/*.jinja in VENDORED; None for a base model with no template
    config_class: str  # a transformers config class, by name: importing transformers here would slow collection
    config: dict
    bos: str | None
    eos: str
    pad: str | None
    add_bos: bool  # whether encoding text prepends BOS, as the real tokenizer does
    # The transformers class that reads the GGUF: the one AutoTokenizer picks for the family, named here because
    # AutoTokenizer first reads the model config through the gguf package, 3-30 s per file (Llama-3's 128k-token
    # vocabulary: 35 s), while the class itself reads only the tokenizer's arrays.
    tokenizer_class: str
    special_tokens: tuple = ()  # tokens the template uses that the GGUF lacks, added as special tokens
    added_tokens: tuple = ()  # the same, added as plain (non-special) tokens, as the real tokenizer has them


_DEEPSEEK_TOKENS = tuple(f"<｜{name}｜>" for name in (
    "begin▁of▁sentence", "end▁of▁sentence", "User", "Assistant", "tool▁calls▁begin", "tool▁calls▁end",
    "tool▁call▁begin", "tool▁call▁end", "tool▁sep", "tool▁outputs▁begin", "tool▁outputs▁end",
    "tool▁output▁begin", "tool▁output▁end"))

_SPECS = [
    # Llama 3.2 1B/3B tie their embeddings; the real tokenizer prepends <|begin_of_text|> and has no pad.
    FamilySpec("llama3", "ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct.jinja", "LlamaConfig",
               {**_TINY, "tie_word_embeddings": True}, bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
               add_bos=True, tokenizer_class="TokenizersBackend"),
    # Qwen2Config's default q/k/v biases are Qwen2's; small Qwen2.5 models tie embeddings; no BOS at all.
    FamilySpec("qwen2.5", "ggml-vocab-qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen2Config",
               {**_TINY, "tie_word_embeddings": True}, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
               add_bos=False, added_tokens=("<tool_call>", "</tool_call>"), tokenizer_class="Qwen2Tokenizer"),
    # Qwen3: q/k norms, and a head_dim that is not hidden_size / heads (as Qwen3-0.6B: 128 vs 1024 / 16).
    FamilySpec("qwen3", "ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B.jinja", "Qwen3Config",
               {**_TINY, "head_dim": 16, "tie_word_embeddings": True}, bos=None, eos="<|im_end|>",
               pad="<|endoftext|>", add_bos=False,
               added_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                             "</think>"), tokenizer_class="Qwen2Tokenizer"),
    # Llama-2 SentencePiece vocabulary (Mistral 7B's is the same kind); [INST] is plain text in it.
    FamilySpec("mistral", "ggml-vocab-llama-spm.gguf", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "MistralConfig",
               {**_TINY, "tie_word_embeddings": False}, bos="<s>", eos="</s>", pad=None, add_bos=True,
               tokenizer_class="TokenizersBackend"),
    # Phi-3's fused qkv_proj / gate_up_proj come with Phi3Config; eos and pad as the GGUF and the real
    # Phi-3.5-mini-instruct tokenizer_config have them; that tokenizer_config does not add BOS.
    FamilySpec("phi3.5", "ggml-vocab-phi-3.gguf", "microsoft-Phi-3.5-mini-instruct.jinja", "Phi3Config",
               {**_TINY, "tie_word_embeddings": False}, bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>",
               add_bos=False, tokenizer_class="TokenizersBackend"),
    # A base model with no chat template; Conv1D layers; no pad token.
    FamilySpec("gpt2", "ggml-vocab-gpt-2.gguf", None, "GPT2Config",
               {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_inner": 64, "n_positions": 512,
                "tie_word_embeddings": True}, bos="<|endoftext|>", eos="<|endoftext|>", pad=None, add_bos=False,
               tokenizer_class="GPT2Tokenizer"),
    # The real distill renames Qwen's special tokens; here they are added after the Qwen2 vocabulary instead.
    # R1-Distill-Qwen-1.5B does not tie embeddings; its tokenizer prepends BOS and pads with EOS.
    FamilySpec("deepseek-r1-qwen", "ggml-vocab-qwen2.gguf", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
               "Qwen2Config", {**_TINY, "tie_word_embeddings": False}, bos="<｜begin▁of▁sentence｜>",
               eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>", add_bos=True,
               tokenizer_class="Qwen2Tokenizer", special_tokens=_DEEPSEEK_TOKENS, added_tokens=("<think>", "</think>")),
    # Gemma's SentencePiece-style vocabulary comes from the Gemma-4 GGUF (the only Gemma one vendored): it has
    # <|turn> / <turn|> where Gemma 2 has <start_of_turn> / <end_of_turn>, so those two are added. AutoTokenizer
    # cannot read that file (it parses the Gemma-4 model config and fails on a per-layer num_key_value_heads
    # list), so GemmaTokenizer reads it directly. Gemma 2 ends a turn with <end_of_turn> but its EOS is <eos>.
    # head_dim is independent of hidden_size / heads and query_pre_attn_scalar equals it, as in gemma-2-2b.
    FamilySpec("gemma2", "ggml-vocab-gemma-4.gguf", "google-gemma-2-2b-it.jinja", "Gemma2Config",
               {**_TINY, "head_dim": 16, "query_pre_attn_scalar": 16, "tie_word_embeddings": True},
               bos="<bos>", eos="<eos>", pad="<pad>", add_bos=True,
               special_tokens=("<start_of_turn>", "<end_of_turn>"), tokenizer_class="GemmaTokenizer"),
]
FAMILIES = {spec.name: spec for spec in _SPECS}

# Mixtures of experts: transformers 5 fuses each layer's experts into 3-D weights (mlp.experts.gate_up_proj and
# down_proj) behind a top-k router (mlp.gate). Kept apart from FAMILIES, whose tests run every dense family through
# every check; tests/test_moe.py runs these through what differs for experts.
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16, "router_aux_loss_coef": 0.001}
_MOE_SPECS = [
    # Qwen3-30B-A3B's kind: Qwen3's vocabulary and template, q/k norms, head_dim apart from hidden / heads, no
    # shared expert, untied embeddings.
    FamilySpec("qwen3-moe", "ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B.jinja", "Qwen3MoeConfig",
               {**_TINY, **_MOE, "num_experts": 4, "head_dim": 16, "tie_word_embeddings": False}, bos=None,
               eos="<|im_end|>", pad="<|endoftext|>", add_bos=False,
               added_tokens=("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                             "</think>"), tokenizer_class="Qwen2Tokenizer"),
    # Mixtral's kind: Llama-2's SentencePiece vocabulary (Mixtral-8x7B's), the Mistral family's template, experts as
    # wide as the dense MLP (intermediate_size), no moe_intermediate_size.
    FamilySpec("mixtral", "ggml-vocab-llama-spm.gguf", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "MixtralConfig",
               {**_TINY, "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
                "tie_word_embeddings": False}, bos="<s>", eos="</s>", pad=None, add_bos=True,
               tokenizer_class="TokenizersBackend"),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B's kind): a shared expert (plain Linear layers) beside the routed ones, gated by
    # its own one-unit Linear.
    FamilySpec("qwen2-moe", "ggml-vocab-qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen2MoeConfig",
               {**_TINY, **_MOE, "num_experts": 4, "shared_expert_intermediate_size": 32,
                "tie_word_embeddings": False}, bos=None, eos="<|im_end|>", pad="<|endoftext|>", add_bos=False,
               added_tokens=("<tool_call>", "</tool_call>"), tokenizer_class="Qwen2Tokenizer"),
]
MOE_FAMILIES = {spec.name: spec for spec in _MOE_SPECS}
_ALL_FAMILIES = {**FAMILIES, **MOE_FAMILIES}


def _vendored(*parts) -> str:
    path = os.path.join(VENDORED, *parts)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} is missing: the vendored llama.cpp vocabularies and chat templates are fetched by `make test` "
            f"(or `make vendor-models`), which downloads the llama-cpp-python sdist and extracts them into {VENDORED}.")
    return path


def _read_template(spec: FamilySpec) -> str | None:
    if spec.template is None:
        return None
    # newline="" keeps the file's text exactly as it is (no newline translation).
    with open(_vendored("templates", spec.template), encoding="utf-8", newline="") as handle:
        return handle.read()


def _cache_key(spec: FamilySpec) -> str:
    """A short hash of everything the tokenizer is built from: the GGUF, the template, transformers' version
    (its GGUF conversion changes between releases) and the spec's tokenizer fields."""
    import transformers

    digest = hashlib.sha256()
    for path in [_vendored(spec.vocab)] + ([_vendored("templates", spec.template)] if spec.template else []):
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("config", "config_class")}
    digest.update(json.dumps([fields, transformers.__version__, BUILD_VERSION], sort_keys=True).encode())
    return digest.hexdigest()[:12]


def _without_stray_tokens(tokenizer):
    """Drop added tokens that are not in the GGUF's vocabulary. GPT2Tokenizer's default special token
    <|endoftext|> is added as one more token to a byte-level vocabulary that lacks it (Llama 3: 128257
    tokens instead of 128256); the rebuilt tokenizer is the plain fast tokenizer that Llama 3 ships."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    size = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False)
    data = json.loads(tokenizer.backend_tokenizer.to_str())
    kept = [token for token in data["added_tokens"] if token["id"] < size]
    if len(kept) == len(data["added_tokens"]):
        return tokenizer
    data["added_tokens"] = kept
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)))


@functools.cache
def _gguf_tokenizer(vocab: str, tokenizer_class: str):
    """The GGUF's vocabulary as a fast tokenizer, read once per process: Qwen2.5, Qwen3 and the R1
    distill share one vocabulary, and reading a 152k-token GGUF takes about 3 s (a copy, under a second)."""
    import transformers

    loader = getattr(transformers, tokenizer_class)
    return _without_stray_tokens(loader.from_pretrained(VENDORED, gguf_file=_vendored(vocab)))


def _convert(spec: FamilySpec):
    """The family's tokenizer: the GGUF's vocabulary, then the spec's tokens, special tokens and template."""
    from tokenizers import AddedToken

    tokenizer = copy.deepcopy(_gguf_tokenizer(spec.vocab, spec.tokenizer_class))
    if spec.special_tokens:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": [AddedToken(t, normalized=False, special=True) for t in spec.special_tokens]},
            replace_extra_special_tokens=False)
    if spec.added_tokens:
        tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in spec.added_tokens])
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = spec.bos, spec.eos, spec.pad
    # Set after the special tokens: the setter rebuilds the post-processor from the current BOS.
    tokenizer.add_bos_token = spec.add_bos
    tokenizer.chat_template = _read_template(spec)
    return tokenizer


def _probe_ids(tokenizer) -> list:
    """Ids of text that exercises the vocabulary, the special tokens and (where there is one) the template."""
    texts = ["你好，世界! Hello  world\n\n  indented\tcode 12345 ünïcödé 🙂"]
    texts += [token for token in tokenizer.all_special_tokens]
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
        texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
    return [tokenizer(text)["input_ids"] for text in texts]


def _save_checked(tokenizer, directory: str) -> None:
    """Save, and check that the saved tokenizer loads back as the same tokenizer: some tokenizer classes
    rebuild parts of themselves on load, and a fixture that differs from what was built would mislead."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(directory)
    reloaded = AutoTokenizer.from_pretrained(directory)
    expected = (len(tokenizer), tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, _probe_ids(tokenizer))
    actual = (len(reloaded), reloaded.bos_token, reloaded.eos_token, reloaded.pad_token, _probe_ids(reloaded))
    if actual != expected:
        raise RuntimeError(f"{directory}: the saved tokenizer does not load back as built")
    # What a model config needs, so that building a model does not load the tokenizer again (up to ~8 s for
    # Gemma's 262k-token vocabulary); build_family_model copies the tokenizer files but not this one.
    ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    with open(os.path.join(directory, _IDS_FILE), "w", encoding="utf-8") as handle:
        json.dump(ids, handle)


def family_tokenizer_dir(name: str) -> str:
    """The directory of `name`'s tokenizer, converted from its GGUF on first use and cached across runs."""
    spec = _ALL_FAMILIES[name]
    final = os.path.join(TOKENIZER_CACHE, f"{name}-{_cache_key(spec)}")
    if os.path.isdir(final):
        return final
    os.makedirs(TOKENIZER_CACHE, exist_ok=True)
    # Build in a temporary directory beside the final one and rename it into place, so that a concurrent
    # test process sees either no directory or a complete one.
    staging = tempfile.mkdtemp(prefix=f".{name}-", dir=TOKENIZER_CACHE)
    try:
        _save_checked(_convert(spec), staging)
        os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        os.rename(staging, final)
    except OSError:
        if not os.path.isdir(final):  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def build_family_model(name: str, out_dir: str) -> str:
    """`name`'s tokenizer and a tiny, randomly initialised model of its architecture, saved into out_dir."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    spec = _ALL_FAMILIES[name]
    tokenizer_dir = family_tokenizer_dir(name)
    with open(os.path.join(tokenizer_dir, _IDS_FILE), encoding="utf-8") as handle:
        ids = json.load(handle)
    config = getattr(transformers, spec.config_class)(**spec.config, **ids)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir)
    # The cached files as they are (checked to load back as built when they were made), not a re-save.
    shutil.copytree(tokenizer_dir, out_dir, ignore=shutil.ignore_patterns(_IDS_FILE), dirs_exist_ok=True)
    return out_dir
