"""The family fixtures (helpers/families.py) are what they claim: each family's real tokenizer, a tiny model
whose vocabulary matches it, and the family's chat template byte for byte."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.families import FAMILIES, VENDORED

TEXT = "你好，世界! Hello"


# Module-scoped and indirect: pytest groups the tests by family, so each family loads once here.
by_family = pytest.mark.parametrize("family", sorted(FAMILIES), indirect=True, scope="module")


@pytest.fixture(scope="module")
def family(request, family_model_dir):
    """(spec, tokenizer, model) of one family."""
    directory = family_model_dir(request.param)
    model = AutoModelForCausalLM.from_pretrained(directory)
    return FAMILIES[request.param], AutoTokenizer.from_pretrained(directory), model


@by_family
def test_tokenizer_round_trips_mixed_text(family):
    _, tokenizer, _ = family
    assert tokenizer.decode(tokenizer.encode(TEXT, add_special_tokens=False)) == TEXT


@by_family
def test_model_vocabulary_is_the_tokenizer(family):
    _, tokenizer, model = family
    assert model.config.vocab_size == len(tokenizer)
    ids = torch.tensor([tokenizer.encode(TEXT, add_special_tokens=False)[:5]])
    assert ids.shape == (1, 5)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, len(tokenizer))


@by_family
def test_chat_template_is_the_vendored_file(family):
    spec, tokenizer, _ = family
    if spec.template is None:
        assert tokenizer.chat_template is None
        return
    with open(os.path.join(VENDORED, "templates", spec.template), "rb") as handle:
        assert tokenizer.chat_template.encode("utf-8") == handle.read()


@by_family
def test_special_tokens_are_the_tables(family):
    spec, tokenizer, model = family
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (spec.bos, spec.eos, spec.pad)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert (tokenizer("hi")["input_ids"][0] == tokenizer.bos_token_id) == spec.add_bos
