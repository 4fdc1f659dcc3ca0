"""The rollout engine: prompt ids in; the answers sampled by the actor, with the sampler's log-prob
of each answer token and the entropy of the distribution it came from, out (SampledBatch). PPO's
ExperienceMaker samples through it, and so will every later RL method; RolloutEngine is the seam a
backend that samples outside this process (vLLM) implements.

EagerEngine samples with the actor's own generate(): on the peft model as it trains (each LoRA
layer adds its B @ A on the fly), or, with --enable_hybrid_engine, on the active adapter merged into
the base weights for the rollout (merged_adapters): peft's merge then unmerge is not bit-identical
(W + BA - BA != W in floating point), so the targeted base weights are copied before the merge and
restored by copy after it, bit for bit. The copy costs the targeted base weights' bytes once more
on the device for the length of the rollout (logged once; models.memory counts it).
ZeRO-3 (partitioned base weights), a quantized base and DoRA adapters decode unmerged, said once in
the log.

Rows that repeat a prompt (the group-relative methods' G answers to one prompt) share its prefill: the
distinct prompts run once and their KV cache is repeated to every row (EagerEngine.shared_prompt_cache),
so a rollout pays for 1/G of the prompt tokens generate() would run.

The sampler's log-probs are what the sampler saw; PPO's old policy comes from a training-shaped
forward instead (rl.experience), and the gap between the two is measured (rl.rl_math.sampler_gap)."""

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.integrations import is_deepspeed_zero3_enabled

from lorakit.models.positions import positions_from_mask
from lorakit.models.zero3 import (
    free_memory_bytes,
    full_size_bytes,
    gathered_for_generation,
    is_zero3_partitioned,
    on_every_rank,
)
from lorakit.rl.rl_math import entropy_from_logits, logprobs_from_logits
from lorakit.rl.role_policy import backbone_of

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    from lorakit.rl.role_policy import RolePolicy
    from lorakit.rl.rollout_arguments import RolloutArguments

logger = logging.getLogger(__name__)


class TokenStatistics(NamedTuple):
    """Of each sampled answer token, [B, A]: the actor's log-prob, and the entropy of the distribution it came from."""

    logprobs: torch.Tensor
    entropy: torch.Tensor


class SampledBatch(NamedTuple):
    """One generation batch's answer ids with their TokenStatistics, each [rows, answer width] on the CPU."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor


class SampledTokenStatistics(LogitsProcessor):
    """The log-prob of each token generate() samples and the entropy of the distribution it was drawn
    from, computed step by step from the model's own logits of that step over the temperature: the
    values the whole [B, A, V] stack of output_logits=True would give, for the memory of one step.

    A forward hook on the generating model (recording()) keeps the last forward's logits at the last
    position (raw: before any processor, as output_logits returns them); generate() calls this
    processor once per sampled step, after that forward, with the ids so far, whose last column is the
    token sampled at the step before. Steps generate() runs past the end (synced ZeRO-3 ranks, a
    deferred stop check) are cut by finish()."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.latest: torch.Tensor | None = None  # [B, V] float32: the last forward's logits at its last position
        self.pending: torch.Tensor | None = None  # [B, V]: the previous step's scaled logits, until its token is known
        self.logprobs: list[torch.Tensor] = []
        self.entropies: list[torch.Tensor] = []

    @contextmanager
    def recording(self, model: torch.nn.Module) -> Iterator["SampledTokenStatistics"]:
        handle = model.register_forward_hook(self.capture)
        try:
            yield self
        finally:
            handle.remove()

    def capture(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # A copy: a view would keep the whole prefill logits alive.
        self.latest = output.logits[:, -1].to(dtype=torch.float32, copy=True)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        self.resolve(input_ids[:, -1])
        assert self.latest is not None, "no forward recorded: generate() calls the processor after each forward"
        # Its own copy either way: under CUDA graphs (the compiled engine) the hook's tensor is the graph's output
        # memory, overwritten by the next step's replay, while pending is read at the next step.
        logits = self.latest.clone() if self.temperature == 1.0 else self.latest / self.temperature
        self.entropies.append(entropy_from_logits(logits[:, None])[:, 0])
        self.pending = logits
        return scores

    def resolve(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.logprobs.append(logprobs_from_logits(self.pending[:, None], tokens[:, None])[:, 0])
            self.pending = None

    def finish(self, answers: torch.Tensor) -> TokenStatistics:
        """(log-probs, entropy), each [B, A], of the answers [B, A] generate() returned."""
        width = answers.shape[1]
        if len(self.logprobs) < width:
            self.resolve(answers[:, len(self.logprobs)])
        return TokenStatistics(torch.stack(self.logprobs[:width], dim=1), torch.stack(self.entropies[:width], dim=1))


# --generation_gather auto gathers the actor once per generation batch when its whole weights take at most
# this share of what the device has free: the rest is left to the KV cache, the logits and the other roles.
GENERATION_GATHER_SHARE = 0.5


class RolloutEngine(Protocol):
    """Samples one generation batch: prompt ids and mask [rows, P] long (left-padded) in, SampledBatch
    out (answer ids, the sampler's log-probs and entropy, each [rows, answer width] on the CPU). The
    random state is the caller's (torch's global generator, seeded per iteration and rank); an engine
    holds no state a checkpoint lacks."""

    name: str

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> SampledBatch: ...


def quantized_base(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)
                or getattr(model, "is_quantized", False))


def merge_blocker(model: torch.nn.Module) -> str | None:
    """Why the actor cannot decode on merged weights, or None where it can."""
    from peft.tuners.lora import LoraLayer

    if is_zero3_partitioned(model.parameters()):
        return "ZeRO-3 partitions the base weights"
    if quantized_base(model):
        return "the base is quantized (a merge would requantize it)"
    for layer in model.modules():
        if isinstance(layer, LoraLayer) and any(layer.use_dora.get(name) for name in layer.active_adapters):
            return "DoRA adapters"
    return None


class MergedWeights(NamedTuple):
    """What merged_adapters yields: the LoRA layers merged and the bytes of the base weights kept to restore them."""

    layers: int
    saved_bytes: int


@contextmanager
def merged_adapters(model: torch.nn.Module) -> Iterator[MergedWeights]:
    """The active adapter of every LoRA layer folded into its base layer's weights for the block; after
    it each base layer's parameters are restored by copy from a snapshot taken before the merge, so
    base and adapter weights are bit-identical to before (torch.equal), and peft's layers unmerged.
    The snapshot costs the targeted base layers' bytes on their device while the block runs."""
    from peft.tuners.lora import LoraLayer

    saved: list[tuple[LoraLayer, list[tuple[torch.nn.Parameter, torch.Tensor]]]] = []
    try:
        with torch.no_grad():
            for layer in model.modules():
                if isinstance(layer, LoraLayer) and layer.active_adapters and not layer.merged:
                    base = layer.get_base_layer()
                    saved.append((layer, [(p, p.detach().clone()) for p in base.parameters(recurse=False)]))
                    layer.merge(adapter_names=list(layer.active_adapters))
        yield MergedWeights(len(saved), sum(copy.numel() * copy.element_size()
                                            for _, pairs in saved for _, copy in pairs))
    finally:
        with torch.no_grad():
            for lora_layer, pairs in saved:
                for parameter, copy in pairs:
                    parameter.data.copy_(copy)
                lora_layer.merged_adapters = []


def rollout_engine(model: "RolePolicy", args: "RolloutArguments", pad_id: int, answer_end_id: int, max_answer_len: int,
                   deepspeed_engine: Callable[[], Any], max_prompt_len: int | None = None) -> RolloutEngine:
    """The engine --rollout_engine names (auto: compiled on CUDA, eager elsewhere), merging the adapter for the
    rollout under --enable_hybrid_engine. auto's compiled engine falls back to eager, once and said so, if the
    compiled decode fails; an explicit --rollout_engine compiled lets the error through."""
    choice = args.rollout_engine
    if choice == "auto":
        choice = "compiled" if torch.device(args.device).type == "cuda" else "eager"
    engine_class = CompiledEngine if choice == "compiled" else EagerEngine
    engine = engine_class(model, args, pad_id, answer_end_id, max_answer_len, deepspeed_engine,
                          merge=args.enable_hybrid_engine)
    if isinstance(engine, CompiledEngine):
        engine.falls_back = args.rollout_engine == "auto"
        engine.fix_cache_length(max_prompt_len)
    return engine


class EagerEngine:
    """Sampling with the actor's generate(), KV cache on (see the module's docstring)."""

    name = "eager"

    def __init__(self, model: "RolePolicy", args: "RolloutArguments", pad_id: int, answer_end_id: int,
                 max_answer_len: int, deepspeed_engine: Callable[[], Any], merge: bool = False) -> None:
        self.model, self.args, self.merge = model, args, merge
        self.pad_id, self.answer_end_id, self.max_answer_len = pad_id, answer_end_id, max_answer_len
        self.deepspeed_engine = deepspeed_engine
        self.actor_fits_device: bool | None = None  # --generation_gather auto's choice, made once (all ranks agree)
        self.logged_gather_modes: set[tuple[str, bool]] = set()
        self.logged_merge = False

    @contextmanager
    def decoding_weights(self, generator: "PreTrainedModel") -> Iterator[None]:
        """The weights this batch decodes on: the adapter merged (--enable_hybrid_engine, where merge_blocker
        allows) or as it trains; which, and what the merge costs, said once."""
        blocker = merge_blocker(generator) if self.merge else None
        if not self.merge or blocker:
            if blocker and not self.logged_merge:
                self.logged_merge = True
                logger.info("rollout: the actor decodes with its adapter unmerged: %s", blocker)
            yield
            return
        with merged_adapters(generator) as merged:
            if not self.logged_merge:
                self.logged_merge = True
                logger.info("rollout: the actor decodes on its adapter merged into the base weights (%d layers; a "
                            "copy of their base weights, %.3g GB, is kept during the rollout to restore them bit for "
                            "bit)", merged.layers, merged.saved_bytes / 1e9)
            yield

    def generation_config(self) -> GenerationConfig:
        args = self.args
        # Every sampling setting explicit: generate() fills unset ones from the checkpoint's
        # generation_config (a repetition penalty, top_k=50), which PPO's log-probs would not see.
        return GenerationConfig(
            do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, num_beams=1,
            repetition_penalty=1.0, max_new_tokens=self.max_answer_len, min_new_tokens=1,
            eos_token_id=self.answer_end_id, pad_token_id=self.pad_id, use_cache=True,
        )

    def gathers_once_per_batch(self, generator: "PreTrainedModel") -> bool:
        """Whether one generation batch runs on the actor's weights gathered once (ZeRO-3, --generation_gather
        per_batch, or auto where the whole actor fits: GENERATION_GATHER_SHARE of the device's free memory)
        rather than layer by layer at every token. Outside ZeRO-3 nothing is partitioned: False."""
        engine = self.deepspeed_engine()
        if engine is None or not is_zero3_partitioned(generator.parameters()):
            return False
        mode, size = self.args.generation_gather, full_size_bytes(generator.parameters())
        if mode == "auto" and self.actor_fits_device is None:
            free = free_memory_bytes(self.args.device)
            self.actor_fits_device = on_every_rank(size <= GENERATION_GATHER_SHARE * free, self.args.device)
        once = mode == "per_batch" or (mode == "auto" and bool(self.actor_fits_device))
        if (mode, once) not in self.logged_gather_modes:
            self.logged_gather_modes.add((mode, once))
            if once:
                logger.info("generation under ZeRO-3: parameters gathered once per batch (%.3g GB)", size / 1e9)
            else:
                why = "the model does not fit one device" if mode == "auto" else "--generation_gather per_layer"
                logger.info("generation under ZeRO-3: parameters gathered per layer, every token: %s (%.3g GB "
                            "whole)", why, size / 1e9)
        return once

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> SampledBatch:
        """One generation batch: (answer ids, log-probs, entropy), each [rows, answer width] on the CPU,
        log-probs and entropy from the raw logits (before top-k/top-p) that sampled each token, over the
        temperature: recorded step by step (SampledTokenStatistics), or without --chunked_loss from the
        stack of every step's logits, [rows, answer width, vocabulary] float32. Under ZeRO-3 the actor's
        weights are gathered once for the batch (gathers_once_per_batch), or else layer by layer at
        every step, every rank stepping until all are done (synced_gpus). With --enable_hybrid_engine the
        actor decodes on its adapter merged into the base weights (decoding_weights)."""
        generator, prompt_width = self.model.generator(), prompt_ids.shape[1]
        once = self.gathers_once_per_batch(generator)
        config = self.generation_config()
        options = {"input_ids": prompt_ids, "attention_mask": prompt_mask, "return_dict_in_generate": True,
                   "generation_config": config,
                   "synced_gpus": not once and is_deepspeed_zero3_enabled() and self.args.world_size > 1}
        with (gathered_for_generation(self.deepspeed_engine(), generator) if once else nullcontext(),
              self.decoding_weights(generator)):
            # The compiled decode's static cache is its own: there every row is prefilled by generate().
            cache = None if config.cache_implementation else self.shared_prompt_cache(generator, prompt_ids,
                                                                                     prompt_mask)
            if cache is not None:
                options["past_key_values"] = cache
            return self.sample_with(generator, options, prompt_width)

    def shared_prompt_cache(self, generator: "PreTrainedModel", prompt_ids: torch.Tensor,
                            prompt_mask: torch.Tensor) -> DynamicCache | None:
        """Rows that repeat the prompt of the row before them (a group's answers to one prompt) prefilled once: every
        distinct prompt but its last token runs through the decoder stack once, and its KV cache is then repeated to
        each of its rows; generate() continues from that cache with each row's last prompt token. The rows sample as
        from a prefill of their own (to float rounding) for 1/G of its cost. None (every row prefilled by generate)
        where no row repeats the one before, for a one-token prompt, under ZeRO-3 (every rank must run the same
        forwards) and for a model whose cache is not transformers' DynamicCache."""
        if (prompt_ids.shape[1] < 2 or is_deepspeed_zero3_enabled()
                # transformers types this classmethod's cls as its GenerativePreTrainedModel protocol, which
                # GenerationMixin alone does not meet (a causal LM's class, PreTrainedModel besides, does).
                or not generating(generator)._supports_default_dynamic_cache()):  # type: ignore[misc]
            return None
        repeats = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)
        if not repeats.any():
            return None
        starts = torch.cat([repeats.new_ones(1), ~repeats])  # rows that begin a run of one prompt
        distinct = starts.nonzero().squeeze(1)
        ids, mask = prompt_ids[distinct, :-1], prompt_mask[distinct, :-1]
        cache = DynamicCache(config=generator.config)
        backbone_of(generator)(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask),
                               past_key_values=cache, use_cache=True)
        cache.batch_select_indices(starts.long().cumsum(0) - 1)  # each row: its run's prompt
        return cache

    def sample_with(self, generator: "PreTrainedModel", options: dict[str, Any], prompt_width: int) -> SampledBatch:
        """generate() with options; the answers, with the statistics of the logits that sampled them."""
        if self.args.chunked_loss:
            with SampledTokenStatistics(self.args.temperature).recording(generator) as statistics:
                output = generating(generator).generate(**options, logits_processor=LogitsProcessorList([statistics]))
            tokens = output.sequences[:, prompt_width:]
            logprobs, entropy = statistics.finish(tokens)
        else:
            output = generating(generator).generate(**options, output_logits=True)
            tokens = output.sequences[:, prompt_width:]
            logits = torch.stack(output.logits, dim=1).float()
            if self.args.temperature != 1.0:
                logits = logits / self.args.temperature
            logprobs, entropy = logprobs_from_logits(logits, tokens), entropy_from_logits(logits)
        return SampledBatch(tokens.cpu(), logprobs.cpu(), entropy.cpu())



# The compiled engine left-pads prompts up to the next power of two of at least this width, so that the static KV
# cache (prompt bucket + max answer tokens), and with it the compiled decoding step, takes few shapes in a run.
MIN_PROMPT_BUCKET = 16
# torch.compile's recompiles allowed per code object (dynamo's default is 8; past it the decode silently runs eager):
# a run meets one shape per (rows, prompt bucket), at most two row counts (full and last batch) per bucket.
RECOMPILE_LIMIT = 64


def prompt_bucket(width: int) -> int:
    """The width a prompt batch of width columns is left-padded to for the compiled decode."""
    return max(MIN_PROMPT_BUCKET, 1 << (width - 1).bit_length())


def generating(model: "PreTrainedModel") -> "GenerationMixin":
    """The actor as the causal LM it is: its class mixes GenerationMixin into PreTrainedModel, which itself declares no
    generate()."""
    return cast("GenerationMixin", model)


def compile_blocker(model: "PreTrainedModel") -> str | None:
    """Why the actor's decode cannot be compiled, or None where it can."""
    if is_zero3_partitioned(model.parameters()):
        return "ZeRO-3 partitions the weights (compiled code cannot follow partitioned storage)"
    if quantized_base(model):
        return "the base is quantized"
    inner = getattr(model, "get_base_model", lambda: model)()  # a peft model: the transformers model under it
    if not getattr(inner, "_can_compile_fullgraph", False):
        return f"transformers does not compile {inner.config.model_type}'s decoding step"
    return None


def compiled_graphs() -> int:
    """The graphs torch.compile has built in this process so far (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class CompiledEngine(EagerEngine):
    """generate() with a static KV cache and its decoding step compiled by torch.compile (transformers' own
    compiled decode: the prefill runs eager, each later step calls the compiled forward; CUDA graphs on CUDA).
    Prompts are left-padded to a bucket width (prompt_bucket) and every static cache sized for the widest bucket
    the run's prompts can reach (fix_cache_length), so a run compiles once per row count; each new shape's compile
    time and graph count are logged. Where compile_blocker names a reason the
    batch decodes as EagerEngine would, said once. falls_back (--rollout_engine auto): a failing compiled decode
    is said once and the batch, with the random state it started from, and every later one decode eager."""

    name = "compiled"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from transformers import CompileConfig

        on_cuda = torch.device(self.args.device).type == "cuda"
        self.compile_config = CompileConfig(fullgraph=False, dynamic=False,
                                            mode="reduce-overhead" if on_cuda else "default")
        # Compiled on the CPU too, when asked for by name. (transformers declares the flag `= None`, unannotated, which
        # types it None; its generate() reads it as a bool.)
        self.compile_config._compile_all_devices = True  # type: ignore[assignment]
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        # transformers sizes each generate()'s static cache to the longest any earlier call needed (so that the
        # compiled step keeps its shape): a run compiles once per (rows, cache length), the length growing by bucket.
        self.cache_length, self.fixed_cache_length = 0, False
        self.shapes: set[tuple[int, int]] = set()
        self.falls_back = False
        self.eager_reason: str | None = None

    def fix_cache_length(self, max_prompt_len: int | None) -> None:
        """Size every static cache for the longest prompt bucket the run can meet: one cache length from the first
        rollout on, so the compiled shapes (and the sampled numbers) do not depend on which prompts came before, a
        resumed run's or another process's. Without max_prompt_len the length grows with the widest bucket met."""
        if max_prompt_len is not None:
            self.cache_length = prompt_bucket(max_prompt_len) + self.max_answer_len
            self.fixed_cache_length = True

    def generation_config(self) -> GenerationConfig:
        config = super().generation_config()
        if self.eager_reason is None:
            config.cache_implementation, config.compile_config = "static", self.compile_config
            if self.fixed_cache_length:
                config.max_cache_len = self.cache_length
        return config

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> SampledBatch:
        reason = self.eager_reason or compile_blocker(self.model.generator())
        if reason:
            if reason != self.eager_reason:
                self.eager_reason = reason
                logger.info("rollout: the decode runs eager, not compiled: %s", reason)
            return EagerEngine.sample(self, prompt_ids, prompt_mask)
        padding = prompt_bucket(prompt_ids.shape[1]) - prompt_ids.shape[1]
        prompt_ids = torch.nn.functional.pad(prompt_ids, (padding, 0), value=self.pad_id)
        prompt_mask = torch.nn.functional.pad(prompt_mask, (padding, 0), value=0)
        random_state = torch.random.get_rng_state(), on_cuda_rng_state(self.args.device)
        try:
            return self.sample_counting_compiles(prompt_ids, prompt_mask)
        except Exception as error:
            if not self.falls_back:
                raise
            self.eager_reason = f"the compiled decode failed ({type(error).__name__}: {error})"
            logger.warning("rollout: %s; decoding eager from now on", self.eager_reason)
            torch.random.set_rng_state(random_state[0])
            if random_state[1] is not None:
                torch.cuda.set_rng_state(random_state[1], torch.device(self.args.device))
            return EagerEngine.sample(self, prompt_ids, prompt_mask)

    def sample_counting_compiles(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> SampledBatch:
        self.cache_length = max(self.cache_length, prompt_ids.shape[1] + self.max_answer_len)
        shape = (prompt_ids.shape[0], self.cache_length)
        graphs, started = compiled_graphs(), time.perf_counter()
        sampled = EagerEngine.sample(self, prompt_ids, prompt_mask)
        if shape not in self.shapes:
            self.shapes.add(shape)
            logger.info("rollout: decoding step compiled for %d rows x a KV cache of %d (prompt bucket %d): %.1f s "
                        "for the batch, %d new graphs, %d shapes so far", shape[0], shape[1], prompt_ids.shape[1],
                        time.perf_counter() - started, compiled_graphs() - graphs, len(self.shapes))
        return sampled


def on_cuda_rng_state(device: torch.device | str) -> torch.Tensor | None:
    """The CUDA generator's state of device, or None off CUDA."""
    device = torch.device(device)
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None
