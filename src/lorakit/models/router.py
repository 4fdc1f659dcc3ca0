"""Mixture-of-experts routers: the load-balancing (auxiliary) loss a stage adds to its own loss, and the tokens each
router sends to each expert, from which the trainers log router statistics and warn of a collapsing router.

The aux loss. transformers' MoE causal LMs (Qwen3-MoE, Mixtral, Qwen2-MoE, ...) compute the Switch Transformer
load-balancing loss of their routers' logits when asked (output_router_logits) and, given labels, add
config.router_aux_loss_coef times it to their loss. Our stages compute their own losses from forwards without labels
(the chunked causal-LM loss, DPO's, the RL actor's), which would drop that term: router_aux_coef says whether a model
has one to add and with which weight, and aux_loss_from_router_logits computes it where a stage runs the decoder
alone. None for routers that balance without an aux loss (DeepSeek-V3's bias-corrected top-k: its config has no
router_aux_loss_coef), nor for transformers' *ForSequenceClassification (the reward model), which returns none.

The counts. RouterCounter hooks every router (find_routers) and counts, per router, the tokens sent to each expert
over the training forwards; router_figures and overloads turn summed counts into the logged figures and warnings
(trainers.router_monitor).

Torch only: the trainers pass the models."""

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from lorakit.core.pair_segments import PAIR_PADDING

# A layer is overloaded when its busiest expert takes more of its tokens than halfway from the uniform share
# (top_k / experts, every expert as busy) to every token: 75% at 2 of 4 experts, 62.5% at Mixtral's 2 of 8, 53% at
# Qwen3-MoE's 8 of 128. Relative to the uniform share, so that it means as much at any number of experts.
OVERLOAD_POSITION = 0.5
# A layer's step with fewer tokens proves little (a short last batch): no warning below it.
MIN_TOKENS_TO_WARN = 64


def causal_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (the model itself without one)."""
    # Read with getattr: nn.Module's __getattr__ would type peft's method as a Tensor or a Module.
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if get_base_model is not None else model


def text_config(model: nn.Module) -> Any:
    config: Any = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_balancing_function(model: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The family's load_balancing_loss_func, from the module defining the model's class or one of its bases (the
    stages' head classes are built on the checkpoint's class in lorakit.models.heads)."""
    for cls in type(model).__mro__:
        function = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if callable(function):
            return function
    return None


def router_aux_coef(model: nn.Module) -> float:
    """config.router_aux_loss_coef where the model's forward returns a router aux loss (it takes
    output_router_logits and its family defines the loss), else 0.0: a dense model, a router without an aux loss, a
    sequence classifier, a coefficient of 0. model: a transformers model, bare or under peft."""
    model = causal_model(model)
    coef = float(getattr(text_config(model), "router_aux_loss_coef", 0.0) or 0.0)
    if coef <= 0 or load_balancing_function(model) is None:
        return 0.0
    return coef if "output_router_logits" in inspect.signature(model.forward).parameters else 0.0


def num_experts_of(config: Any) -> int | None:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)


def aux_loss_from_router_logits(model: nn.Module, router_logits: tuple[torch.Tensor, ...],
                                token_mask: torch.Tensor | None) -> torch.Tensor:
    """The family's load-balancing loss of one forward's router logits (a [tokens, experts] tensor per MoE layer,
    as the decoder returns them with output_router_logits), over the tokens token_mask marks ([rows, columns] of
    that forward's tokens, padding 0; None: every token): what the causal LM computes from its attention mask."""
    model = causal_model(model)
    config = text_config(model)
    function = load_balancing_function(model)
    if function is None:
        raise ValueError(f"{type(model).__name__}: no load_balancing_loss_func in its family's module (a model "
                         "without a router aux loss: router_aux_coef is 0 for it)")
    return function(tuple(router_logits), num_experts_of(config), config.num_experts_per_tok, token_mask)


def router_aux_term(coef: float, aux_loss: torch.Tensor | None) -> torch.Tensor | float:
    """coef * aux_loss, the term a stage adds to its loss (0.0 without an aux loss)."""
    return coef * aux_loss if coef and aux_loss is not None else 0.0


# ----------------------------------------------------------------------------- finding and counting the routers


class RouterSite(NamedTuple):
    """A router: its module's name in the model, the module, how many experts it routes to and how many it picks per
    token (None where unknown: then only a router that returns its picks is counted)."""

    name: str
    module: nn.Module
    num_experts: int
    top_k: int | None


def is_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    """transformers 5's router classes (Qwen3MoeTopKRouter, MixtralTopKRouter, DeepseekV3TopkRouter, DbrxRouter,
    ...), or the `gate` of a sparse MoE block whatever its class (an nn.Linear in older code, or peft's layer on
    it)."""
    return type(module).__name__.lower().endswith("router") or (
        name.rsplit(".", 1)[-1] == "gate" and type(parent).__name__.endswith("MoeBlock"))


def router_width(module: nn.Module, config: Any) -> int | None:
    """How many experts a router routes to: its num_experts, its weight's rows (under ZeRO-3 the partitioned
    weight's ds_shape), its out_features, or the config's."""
    experts = getattr(module, "num_experts", None)
    if isinstance(experts, int):
        return experts
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor):
        shape = tuple(getattr(weight, "ds_shape", None) or weight.shape)
        if len(shape) == 2:
            return shape[0]
    return getattr(module, "out_features", None) or num_experts_of(config)


def find_routers(model: nn.Module) -> list[RouterSite]:
    """Every router of the model, outermost first: one inside another (peft's layer on a gate) is the same router,
    and peft's frozen original of a router trained in full (modules_to_save) does not run in training."""
    config = text_config(model)
    modules = dict(model.named_modules())
    sites: list[RouterSite] = []
    for name, module in modules.items():
        if "original_module" in name.split("."):
            continue
        parent = modules.get(name.rpartition(".")[0]) if name else None
        if not is_router(name, module, parent) or any(name.startswith(site.name + ".") for site in sites):
            continue
        experts = router_width(module, config)
        top_k = (getattr(module, "top_k", None) or getattr(parent, "top_k", None)
                 or getattr(config, "num_experts_per_tok", None))
        if experts:
            sites.append(RouterSite(name, module, experts, top_k))
    return sites


def chosen_experts(output: Any, site: RouterSite) -> torch.Tensor | None:
    """The experts a router's forward picked, [tokens, top_k]: the integer tensor it returns (transformers 5's
    routers return (logits, weights, indices), the indices after any bias correction or group limit), else the top_k
    of the logits it returns."""
    parts = output if isinstance(output, (tuple, list)) else (output,)
    tensors = [part for part in parts if isinstance(part, torch.Tensor)]
    for tensor in tensors:
        if not tensor.is_floating_point() and tensor.dim() >= 1:
            return tensor.reshape(-1, tensor.shape[-1] if tensor.dim() > 1 else 1)
    logits = next((tensor for tensor in tensors if tensor.shape[-1] == site.num_experts), None)
    if logits is None or not site.top_k:
        return None
    return logits.detach().reshape(-1, site.num_experts).topk(site.top_k, dim=-1).indices


def in_backward_pass() -> bool:
    """Whether autograd's engine runs this code: an activation-checkpointed layer recomputed for the backward pass."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def token_mask(args: tuple, kwargs: dict[str, Any], position: int | None) -> torch.Tensor | None:
    """The 2-D mask of a forward's real tokens: its attention_mask where 2-D (a 4-D one is a pair row's attention
    pattern, not its padding), else a preference-pair row's segments (padding is PAIR_PADDING)."""
    mask = kwargs.get("attention_mask")
    if mask is None and position is not None and position < len(args):
        mask = args[position]
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask
    segments = kwargs.get("pair_segments")
    if isinstance(segments, torch.Tensor) and segments.dim() == 2:
        return segments != PAIR_PADDING
    return None


class MaskHolder(NamedTuple):
    """A module above a router whose forward takes the tokens' mask, and attention_mask's position among its
    arguments (None where it takes pair_segments only)."""

    module: nn.Module
    position: int | None


class RouterCounter:
    """Counts the tokens each router sends to each expert in the training forwards: with grad on and outside the
    backward pass, so that no evaluation, generation, reference or old-policy pass (all under no_grad) and no layer
    recomputed by activation checkpointing counts (under use_reentrant=True checkpointing, whose forward runs under
    no_grad, nothing is counted). Padding is skipped where a 2-D mask is reachable: forward pre-hooks on every module
    above a router that takes an attention_mask keep a stack of their masks, and a router reads the innermost one
    that fits its tokens (the last columns: a pass over a cache runs the newest ones); elsewhere every position
    counts. take(): [routers, widest + 1] int64, the tokens sent to each expert and then the tokens seen."""

    def __init__(self, model: nn.Module, sites: list[RouterSite]) -> None:
        self.sites = sites
        self.experts = [site.num_experts for site in sites]
        self.width = max(self.experts)
        self.counts: torch.Tensor | None = None
        self.masks: list[torch.Tensor | None] = []
        self.handles = [site.module.register_forward_hook(self.counting_hook(index, site))
                        for index, site in enumerate(sites)]
        for module, position in self.mask_holders(model):
            self.handles.append(module.register_forward_pre_hook(self.push_hook(position), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self.pop_mask, always_call=True))

    def mask_holders(self, model: nn.Module) -> list[MaskHolder]:
        """Each module above a router whose forward takes an attention_mask or pair_segments."""
        modules = dict(model.named_modules())
        above = {".".join(site.name.split(".")[:depth]) for site in self.sites
                 for depth in range(len(site.name.split(".")))}
        holders = []
        for name in sorted(above, key=len):
            parameters = list(inspect.signature(modules[name].forward).parameters)
            if "attention_mask" in parameters or "pair_segments" in parameters:
                position = parameters.index("attention_mask") if "attention_mask" in parameters else None
                holders.append(MaskHolder(modules[name], position))
        return holders

    def push_hook(self, position: int | None) -> Callable[[nn.Module, tuple, dict[str, Any]], None]:
        def push(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            self.masks.append(token_mask(args, kwargs, position))
        return push

    def pop_mask(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.masks:
            self.masks.pop()

    def row_weights(self, rows: int) -> torch.Tensor | None:
        """1 for each real token of the router's rows, 0 for padding; None where no mask fits."""
        for mask in reversed(self.masks):
            if mask is not None and rows % mask.shape[0] == 0 and rows // mask.shape[0] <= mask.shape[1]:
                return mask[:, mask.shape[1] - rows // mask.shape[0]:].reshape(-1)
        return None

    def counting_hook(self, index: int, site: RouterSite) -> Callable[[nn.Module, tuple, Any], None]:
        def count(module: nn.Module, args: tuple, output: Any) -> None:
            if not torch.is_grad_enabled() or in_backward_pass():
                return
            experts = chosen_experts(output, site)
            if experts is not None:
                self.add(index, site.num_experts, experts.detach(), self.row_weights(experts.shape[0]))
        return count

    def add(self, index: int, num_experts: int, experts: torch.Tensor, weights: torch.Tensor | None) -> None:
        # index_add_ on the device, no .item(): counting never waits for the device.
        device = experts.device
        if self.counts is None:
            self.counts = torch.zeros(len(self.sites), self.width + 1, dtype=torch.long, device=device)
        rows, top_k = experts.shape
        weights = (torch.ones(rows, dtype=torch.long, device=device) if weights is None
                   else weights.to(device=device, dtype=torch.long))
        picks = experts.reshape(-1).long()
        valid = (picks >= 0) & (picks < num_experts)  # an "expert" past the last one is a dropped slot
        counts = self.counts.to(device)
        counts[index, : self.width].index_add_(0, picks.clamp(0, self.width - 1),
                                               weights.repeat_interleave(top_k) * valid)
        counts[index, self.width] += weights.sum()
        self.counts = counts

    def take(self, device: torch.device | str) -> torch.Tensor:
        """The counts since the last take (zeros where no training forward ran), on device; counting starts over."""
        counts, self.counts = self.counts, None
        if counts is None:
            return torch.zeros(len(self.sites), self.width + 1, dtype=torch.long, device=device)
        return counts.to(device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# ----------------------------------------------------------------------------- figures from counts


# A frozen dataclass, not a NamedTuple: a field named index would shadow tuple.index.
@dataclass(frozen=True)
class LayerShares:
    """A router's shares: its index, the tokens it saw and the share of them each expert took (float64 [experts];
    they sum to top_k)."""

    index: int
    tokens: int
    shares: torch.Tensor


def layer_shares(counts: torch.Tensor, experts: list[int]) -> list[LayerShares]:
    """The shares of every router that saw a token, from RouterCounter.take's counts (summed over processes)."""
    found = []
    for index, width in enumerate(experts):
        tokens = int(counts[index, -1])
        if tokens > 0:
            found.append(LayerShares(index, tokens, counts[index, :width].double().cpu() / tokens))
    return found


class RouterFigures(NamedTuple):
    """max_expert_share: the largest share of a router's tokens that one expert took, over every router (the worst
    layer's; uniform routing gives top_k / experts, a collapsed router 1); unused_expert_share: the share of every
    router's experts that took no token."""

    max_expert_share: float
    unused_expert_share: float


def router_figures(counts: torch.Tensor, experts: list[int]) -> RouterFigures | None:
    """The figures of the counts; None where no router saw a token."""
    layers = layer_shares(counts, experts)
    if not layers:
        return None
    unused = sum(int((layer.shares == 0).sum()) for layer in layers)
    return RouterFigures(max(layer.shares.max().item() for layer in layers),
                         unused / sum(layer.shares.numel() for layer in layers))


@dataclass(frozen=True)
class Overload:
    """A router whose busiest expert took more than overload_threshold of its tokens (a dataclass, as LayerShares)."""

    index: int
    expert: int
    share: float
    uniform: float
    threshold: float
    tokens: int


def overload_threshold(uniform: float) -> float:
    """OVERLOAD_POSITION of the way from the uniform share (top_k / experts) to every token."""
    return uniform + OVERLOAD_POSITION * (1.0 - uniform)


def overloads(counts: torch.Tensor, experts: list[int]) -> list[Overload]:
    """The overloaded routers of the counts (those that saw at least MIN_TOKENS_TO_WARN tokens), busiest first."""
    found = []
    for layer in layer_shares(counts, experts):
        uniform = layer.shares.sum().item() / layer.shares.numel()  # top_k / experts: the shares sum to top_k
        share, expert = layer.shares.max(dim=0)
        threshold = overload_threshold(uniform)
        if layer.tokens >= MIN_TOKENS_TO_WARN and share.item() > threshold:
            found.append(Overload(layer.index, int(expert), share.item(), uniform, threshold, layer.tokens))
    return sorted(found, key=lambda overload: -overload.share)
