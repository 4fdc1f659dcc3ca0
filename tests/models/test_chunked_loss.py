"""The chunked loss (lorakit.models.chunked_loss) and PPO's step-by-step sampling statistics: the
same losses, log-probs, entropies and gradients as transformers' loss and the stacked output_logits,
and no float32 [batch, positions, vocabulary] tensor where the full-logits way makes one."""

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lorakit.models import chunked_loss

WIDTH = 20


class LargestVocabularyTensor(TorchDispatchMode):
    """The bytes of the largest tensor with the vocabulary as its last dimension that any operator
    allocates while active, in forward and backward passes alike (logits, their softmax, their
    gradients; views of a weight, which allocate nothing, do not count)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.bytes = vocab_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if any(output.alias_info is not None for output in func._schema.returns):
            return result
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[-1] == self.vocab_size:
                self.bytes = max(self.bytes, value.numel() * value.element_size())
        return result


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 5 positions, so that every batch here spans several."""

    def use(vocab_size: int) -> None:
        monkeypatch.setattr(chunked_loss, "LOGITS_PER_CHUNK", 5 * vocab_size)

    return use


def training_args(tmp_path, chunked: bool, **overrides):
    from lorakit.trainers.arguments import CausalLMTrainingArguments

    options = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none", "save_strategy": "no",
               "seed": 0, "disable_tqdm": True, "chunked_loss": chunked, **overrides}
    return CausalLMTrainingArguments(**options)


def lora_model(model_dir, args, **model_options):
    from transformers import AutoTokenizer, set_seed

    from lorakit.models.arguments import ModelArguments
    from lorakit.models.loader import load_model

    set_seed(0)  # the same new LoRA weights each time
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    options = {"model_name_or_path": model_dir, "torch_dtype": "float32", "trainable": "q_proj,v_proj",
               "lora_dropout": 0.0, **model_options}
    return load_model(ModelArguments(**options), args, tokenizer), tokenizer


def sft_batch(vocab_size: int, packed: bool) -> dict:
    """Answers after prompts (labels -100 on prompts and padding): 3 right-padded rows, or 2 packed rows
    of several samples each, told apart by position_ids restarting at 0 (no attention mask)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(5, vocab_size, (2 if packed else 3, WIDTH), generator=generator)
    labels = ids.clone()
    if packed:
        starts = ([0, 7, 15], [0, 11])
        positions = torch.zeros_like(ids)
        for row, row_starts in enumerate(starts):
            for start, end in zip(row_starts, list(row_starts[1:]) + [WIDTH], strict=True):
                positions[row, start:end] = torch.arange(end - start)
                labels[row, start : start + 3] = -100  # each sample's prompt
        return {"input_ids": ids, "position_ids": positions, "labels": labels}
    mask = torch.ones_like(ids)
    for row, (prompt, length) in enumerate([(4, WIDTH), (9, 14), (2, 6)]):
        labels[row, :prompt] = -100
        labels[row, length:], mask[row, length:] = -100, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_gradients(trainer, batch: dict, num_items_in_batch):
    model = trainer.model
    model.train()
    model.zero_grad()
    tracker = LargestVocabularyTensor(model.config.vocab_size)
    with tracker:
        loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=num_items_in_batch)
        loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), gradients, tracker.bytes


@pytest.mark.parametrize("adapter", [{}, {"modules_to_save": "embed_tokens,lm_head"},
                                     {"trainable": "q_proj,v_proj,lm_head"}],
                         ids=["lora", "trained_embeddings_and_head", "lora_on_head"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_chunked_loss_equals_transformers_loss_without_full_logits(adapter, packed, tiny_model_dir, tmp_path,
                                                                   small_chunks):
    """CausalLMTrainer's loss and every gradient with --chunked_loss equal transformers' own (fp32,
    <= 1e-5), with the Trainer's token count (num_items_in_batch) and with a per-batch mean; the
    full-logits way makes a [B, T, V] float32 tensor, the chunked one nothing vocabulary-wide over
    one chunk of 5 positions."""
    from lorakit.trainers.causal_lm import build_trainer

    results = {}
    for chunked in (False, True):
        args = training_args(tmp_path, chunked)
        model, tokenizer = lora_model(tiny_model_dir, args, **adapter)
        vocab_size = model.config.vocab_size
        small_chunks(vocab_size)
        # A trained head's copy that differs from the frozen original: its gradient must reach the copy.
        for name, param in model.named_parameters():
            if "lm_head.modules_to_save" in name or "lm_head.lora_B" in name:
                torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(1))
        trainer = build_trainer(model, args, tokenizer, None, None, None, [])
        batch = sft_batch(vocab_size, packed)
        counted = (batch["labels"][:, 1:] != -100).sum()
        results[chunked] = [loss_and_gradients(trainer, batch, items) for items in (counted + 7, None)]
        assert trainer.chunked_loss_exact is (True if chunked else None)
    full_logits_bytes = batch["input_ids"].numel() * vocab_size * 4
    for (loss, gradients, largest), (chunked_loss_value, chunked_gradients, chunked_largest) in zip(
            *results.values(), strict=True):
        torch.testing.assert_close(chunked_loss_value, loss, atol=1e-5, rtol=1e-5)
        assert chunked_gradients.keys() == gradients.keys() and len(gradients) >= 4
        for name, gradient in gradients.items():
            torch.testing.assert_close(chunked_gradients[name], gradient, atol=1e-5, rtol=1e-4)
        assert largest >= full_logits_bytes
        assert chunked_largest <= 5 * vocab_size * 4 < full_logits_bytes


def test_gradient_accumulation_trains_the_same_weights(tiny_model_dir, tmp_path, small_chunks):
    """Two optimizer steps of 2 accumulated micro-batches whose label counts differ (the loss is the sum
    over the accumulated batch's tokens divided by their count), LoRA dropout on and the embeddings and
    head trained: the same losses and weights with and without --chunked_loss."""
    from transformers import default_data_collator

    from lorakit.trainers.causal_lm import build_trainer

    rows = []
    for index in range(8):
        generator = torch.Generator().manual_seed(index)
        ids = torch.randint(5, 300, (WIDTH,), generator=generator)
        labels = ids.clone()
        labels[: 2 + 2 * index] = -100
        rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    trained, initial = {}, None
    for chunked in (False, True):
        args = training_args(tmp_path / str(chunked), chunked, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=2, learning_rate=1e-2, warmup_steps=0,
                             lr_scheduler_type="constant", logging_steps=1)
        model, tokenizer = lora_model(tiny_model_dir, args, lora_dropout=0.1, modules_to_save="embed_tokens,lm_head")
        small_chunks(model.config.vocab_size)
        initial = initial or {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        trainer = build_trainer(model, args, tokenizer, rows, None, default_data_collator, [])
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        weights = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        trained[chunked] = (losses, weights)
    (losses, weights), (chunked_losses, chunked_weights) = trained[False], trained[True]
    assert len(losses) == 2 and chunked_losses == pytest.approx(losses, rel=1e-5)
    for name, weight in weights.items():
        # Adam moves a weight up to lr per step (0.02 over these two) whatever its gradient's size, so an embedding row
        # whose gradient is a rounding error apart moves apart by more than its gradients do: measured 1.17e-5 at
        # most (2026-12-07, one row of the trained embeddings; transformers 5.23 and 5.25 alike), 2e-7 elsewhere.
        # 5e-5 is 4x that and 0.25% of the step.
        torch.testing.assert_close(chunked_weights[name], weight, atol=5e-5, rtol=1e-5)
    assert all(not torch.equal(weight, initial[name]) for name, weight in weights.items())  # every one trained


def test_a_head_that_does_not_give_the_logits_keeps_transformers_loss(tmp_path):
    """Gemma-2 soft-caps its logits after the head: the chunked loss would differ, so the first batch's
    check turns it off and the loss stays transformers' own."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from lorakit.trainers.causal_lm import build_trainer

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=3.0)
    model = Gemma2ForCausalLM(config)
    batch = sft_batch(300, packed=False)
    expected = model(**batch).loss
    trainer = build_trainer(model, training_args(tmp_path, True), None, None, None, None, [])
    loss = trainer.compute_loss(model, dict(batch))
    assert trainer.chunked_loss_exact is False
    torch.testing.assert_close(loss, expected)


# ----------------------------------------------------------------------------- PPO


def experience_maker(model_dir, chunked: bool, temperature: float, top_k: int, top_p: float):
    from transformers import AutoModelForCausalLM

    from lorakit.rl.experience import ExperienceMaker

    causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    args = types.SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, world_size=1, chunked_loss=chunked,
                                 enable_hybrid_engine=False, rollout_engine="eager")
    policy = types.SimpleNamespace(generator=lambda: causal_lm)
    eos = causal_lm.config.eos_token_id
    return ExperienceMaker(policy, args, pad_id=0, answer_end_id=eos, after_turn_end_ids=[], max_answer_len=16)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_ppo_sampling_records_what_the_stacked_logits_give(temperature, top_k, top_p, tiny_model_dir):
    """The same answers, log-probs (<= 1e-6) and entropies as generate(output_logits=True)'s stack of
    raw logits over the temperature (top-k/top-p and the first step's blocked end only shape sampling),
    answers ending at different steps; the stack is [B, A, V] float32, the recorder holds one step
    (generation itself never more than one step's [B, V])."""
    from lorakit.rl.experience import answer_mask, left_pad

    prompts = [[5, 17, 42, 9], [33, 8], [101, 7, 64, 12, 88, 3], [21]]
    prompt_ids, prompt_mask = left_pad(prompts, 6, 0)
    results = {}
    for chunked in (False, True):
        maker = experience_maker(tiny_model_dir, chunked, temperature, top_k, top_p)
        tracker = LargestVocabularyTensor(maker.model.generator().config.vocab_size)
        torch.manual_seed(11)
        with torch.no_grad(), tracker:
            results[chunked] = (*maker.sample(prompt_ids, prompt_mask), tracker.bytes)
    (tokens, logprobs, entropy, largest), (chunked_tokens, chunked_logprobs, chunked_entropy, chunked_largest) = (
        results[False], results[True])
    assert torch.equal(chunked_tokens, tokens)
    lengths = answer_mask(tokens, maker.answer_end_id)[0].sum(-1).tolist()
    assert min(lengths) < max(lengths), lengths  # rows padded after their end: scored as before too
    torch.testing.assert_close(chunked_logprobs, logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked_entropy, entropy, atol=1e-6, rtol=0)
    vocab_size = maker.model.generator().config.vocab_size
    assert largest >= tokens.numel() * vocab_size * 4
    # One step's [B, V]: the logits, or top-p's sorted token ids (int64).
    assert chunked_largest <= len(prompts) * vocab_size * 8 < tokens.numel() * vocab_size * 4


def shared_policy(model_dir):
    """A SharedBasePolicy whose actor trains its own copy of lm_head (modules_to_save), perturbed from the
    frozen head the critic role sees: a head recomputed under the wrong role gives other gradients."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lorakit.rl.role_policy import SharedBasePolicy

    torch.manual_seed(0)
    causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(causal_lm, LoraConfig(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                                                      init_lora_weights=False))
    for name in ("critic", "reward"):
        peft_model.add_adapter(name, LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    for name, param in peft_model.named_parameters():
        param.requires_grad = ".default." in name or ".critic." in name
    with torch.no_grad():
        copy = peft_model.base_model.model.lm_head.modules_to_save["default"].weight
        copy.add_(0.05 * torch.randn_like(copy))
    hidden = causal_lm.config.hidden_size
    return SharedBasePolicy(peft_model, torch.nn.Linear(hidden, 1), torch.nn.Linear(hidden, 1), None, "unused")


def test_ppo_training_pass_equals_the_full_logits(tiny_model_dir, small_chunks):
    """The PPO training pass on one shared base (actor log-probs over the temperature, critic values,
    ptx loss): the same outputs and gradients with the chunked head, which the backward pass recomputes
    under the actor's adapters although the critic ran after it, as with the full [B, A, V] logits."""
    from lorakit.rl.experience import left_pad

    policy = shared_policy(tiny_model_dir)
    policy.temperature = 0.8
    vocab_size = policy.config.vocab_size
    small_chunks(vocab_size)
    generator = torch.Generator().manual_seed(5)
    prompt_ids, prompt_mask = left_pad([[5, 6, 7], [8, 9, 10, 11, 12], [13]], 5, 0)
    answers = torch.randint(5, vocab_size, (3, 8), generator=generator)
    answer_mask = torch.ones_like(answers)
    answer_mask[1, 5:] = 0
    ids, mask = torch.cat([prompt_ids, answers], 1), torch.cat([prompt_mask, answer_mask], 1)
    ptx_ids = torch.randint(5, vocab_size, (2, 12), generator=generator)
    results = {}
    for chunked in (False, True):
        policy.chunked_loss = chunked
        policy.zero_grad()
        tracker = LargestVocabularyTensor(vocab_size)
        with tracker:
            # The ptx pass first: the training pass then ends with the critic's adapters active.
            ptx_loss = policy.ptx_loss(ptx_ids)
            outputs = {**policy(ids, mask, 5), "ptx_loss": ptx_loss}
            ((outputs["logprobs"] * answer_mask).sum() + outputs["values"].sum() + ptx_loss).backward()
        gradients = {name: p.grad.clone() for name, p in policy.named_parameters() if p.grad is not None}
        results[chunked] = ({name: value.detach() for name, value in outputs.items()}, gradients, tracker.bytes)
    (outputs, gradients, largest), (chunked_outputs, chunked_gradients, chunked_largest) = results[False], results[True]
    for name, value in outputs.items():
        torch.testing.assert_close(chunked_outputs[name], value, atol=1e-5, rtol=1e-5)
    assert any("lm_head.modules_to_save.default" in name for name in gradients)
    assert chunked_gradients.keys() == gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(chunked_gradients[name], gradient, atol=1e-5, rtol=1e-4)
    assert largest >= answers.numel() * vocab_size * 4
    assert chunked_largest <= 5 * vocab_size * 4


# ----------------------------------------------------------------------------- a real family's head


# As test_family_stages' learnable Qwen3 copy: the final norm scaled so that the logits span a trained model's range
# (hundreds), where float32 rounding in a loss over 151k logits shows.
QWEN3_NORM_SCALE = 32


def float64_loss_and_gradients(model, batch: dict, num_items_in_batch):
    """The causal-LM loss and gradients computed in float64 throughout: the reference both float32 paths are
    measured against (transformers' own loss upcasts half-precision logits to float32, and so casts float64 down)."""
    from lorakit.trainers.causal_lm import without_labels

    model.double()
    model.zero_grad()
    logits = model(**without_labels(batch)).logits
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    (loss / num_items_in_batch).backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.float()
    return (loss / num_items_in_batch).detach(), gradients


# How much farther from float64 the chunked gradients may be than transformers' own (measured: at most 1.16x).
CHUNKED_ERROR_FACTOR = 2


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("adapter", [{}, {"modules_to_save": "embed_tokens,lm_head"}],
                         ids=["lora", "trained_tied_embeddings"])
def test_chunked_loss_on_qwen3s_tied_head(adapter, family_model_dir, tmp_path, small_chunks):
    """Qwen3 (tied embeddings, a 151k vocabulary; with --modules_to_save one trained copy shared by both ends) at
    a trained model's logit range, the fixture on which test_family_stages' SFT runs: the chunked loss and every
    gradient equal transformers' own, and are at least as close as transformers' own to the float64 loss."""
    from lorakit.trainers.causal_lm import build_trainer

    args = training_args(tmp_path, True)
    model, tokenizer = lora_model(family_model_dir("qwen3"), args, **adapter)
    with torch.no_grad():
        model.get_base_model().get_decoder().norm.weight.mul_(QWEN3_NORM_SCALE)
        for name, param in model.named_parameters():  # LoRA A gets a gradient only where B is not zero
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.02, generator=torch.Generator().manual_seed(1))
    vocab_size = model.config.vocab_size
    small_chunks(vocab_size)
    trainer = build_trainer(model, args, tokenizer, None, None, None, [])
    batch = sft_batch(vocab_size, packed=False)
    counted = (batch["labels"][:, 1:] != -100).sum()
    reference_loss, reference = float64_loss_and_gradients(model, batch, counted)
    results = {}
    for chunked in (False, True):
        trainer.args.chunked_loss, trainer.chunked_loss_exact = chunked, None
        results[chunked] = loss_and_gradients(trainer, batch, counted)
    assert trainer.chunked_loss_exact is True
    (loss, gradients, largest), (chunked_loss_value, chunked_gradients, chunked_largest) = results[False], results[True]
    # Chunks of 5 positions with the tied trained copy too (whose peft wrapper reports the hidden size as its
    # out_features): never the whole batch's logits.
    assert chunked_largest <= 5 * vocab_size * 4 < largest
    torch.testing.assert_close(chunked_loss_value, loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_loss_value.double(), reference_loss, atol=0, rtol=1e-6)
    assert chunked_gradients.keys() == gradients.keys() == reference.keys() and len(gradients) >= 8
    for name, gradient in gradients.items():
        # Measured: transformers' own 2.9e-6..9e-6 from float64 (its float32 cross-entropy over 151k logits of
        # magnitude ~100), the chunked one 6e-7..5e-6; the chunked one's error over transformers' own at most 1.16
        # (2026-12-07, on transformers 5.23 + peft 0.21 and 5.25 + peft 0.22 alike, torch 2.13 CPU). Two rounding
        # errors of the same size order either way from one machine's kernels to another's: a factor of 2 over
        # transformers' own is "as accurate", and the absolute bound says neither drifted.
        chunked_error = relative_error(chunked_gradients[name], reference[name])
        own_error = relative_error(gradient, reference[name])
        assert relative_error(chunked_gradients[name], gradient.double()) < 5e-5, name
        assert chunked_error < 1e-5 and chunked_error <= CHUNKED_ERROR_FACTOR * own_error, (name, chunked_error)


def test_head_width_is_the_vocabulary_for_every_kind_of_head():
    """A plain head, peft's trained copy of a tied lm_head (whose out_features is the hidden size) and of an untied
    one, and a ZeRO-3-partitioned weight (empty, its shape in ds_shape): each chunk is sized by the vocabulary."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    widths = {}
    for tied in (True, False):
        config = LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
        model = get_peft_model(LlamaForCausalLM(config), LoraConfig(
            target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"], ensure_weight_tying=tied))
        widths["tied copy" if tied else "untied copy"] = chunked_loss.head_width(model.get_output_embeddings())
    plain = torch.nn.Linear(32, 1000, bias=False)
    widths["plain"] = chunked_loss.head_width(plain)
    plain.weight.data, plain.weight.ds_shape = torch.empty(0), torch.Size([1000, 32])
    widths["partitioned"] = chunked_loss.head_width(plain)
    assert widths == {"tied copy": 1000, "untied copy": 1000, "plain": 1000, "partitioned": 1000}
    assert chunked_loss.chunk_positions(plain) == chunked_loss.LOGITS_PER_CHUNK // 1000
