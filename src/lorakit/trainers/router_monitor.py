"""Router statistics of a mixture-of-experts model, for every stage's Trainer (ResumableTrainer installs them):
models.router.RouterCounter counts the tokens each router sends to each expert over each optimizer step's training
forwards; at the step's end RouterMonitor sums the counts over every process, warns (rank 0) when a router overloads
one expert (models.router.overloads) and keeps them for the next training log, which carries
router/max_expert_share and router/unused_expert_share over the steps since the last log
(models.router.router_figures)."""

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from lorakit.models.router import OVERLOAD_POSITION, RouterCounter, find_routers, overloads, router_figures

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger(__name__)


class RouterMonitor(TrainerCallback):
    """Step by step, the routers' counts summed over the processes (reduce: a sum over processes, the identity on
    one); pop_figures gives the figures of the steps since its last call. A collective at every step's end, on every
    rank alike: [routers, experts + 1] integers."""

    def __init__(self, counter: RouterCounter, reduce: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device | str) -> None:
        self.counter, self.reduce, self.device = counter, reduce, device
        self.since_log: torch.Tensor | None = None

    def on_step_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                    **kwargs: Any) -> None:
        counts = self.reduce(self.counter.take(self.device)).cpu()
        self.since_log = counts if self.since_log is None else self.since_log + counts
        if state.is_world_process_zero:
            self.warn_of_overload(state.global_step, counts)

    def warn_of_overload(self, step: int, counts: torch.Tensor) -> None:
        """One warning for a step where a router overloads an expert, naming the worst router."""
        found = overloads(counts, self.counter.experts)
        if not found:
            return
        worst = found[0]
        others = f"; {len(found) - 1} other router(s) too" if len(found) > 1 else ""
        logger.warning("step %d: router %s sent %.1f%% of its %d tokens to expert %d (uniform: %.1f%%; warned above "
                       "%.1f%%, %g of the way to every token)%s: its experts are not balanced, the load-balancing "
                       "loss may be off or too weak", step, self.counter.sites[worst.index].name, 100 * worst.share,
                       worst.tokens, worst.expert, 100 * worst.uniform, 100 * worst.threshold, OVERLOAD_POSITION,
                       others)

    def pop_figures(self) -> dict[str, float]:
        """router/max_expert_share and router/unused_expert_share over the steps since the last call (none where no
        router saw a token); the next call starts over."""
        counts, self.since_log = self.since_log, None
        figures = None if counts is None else router_figures(counts, self.counter.experts)
        if figures is None:
            return {}
        return {"router/max_expert_share": figures.max_expert_share,
                "router/unused_expert_share": figures.unused_expert_share}


def add_router_monitor(trainer: "Trainer") -> RouterMonitor | None:
    """Router statistics for the trainer's model where it has routers (None for a dense model): the counting hooks
    and the RouterMonitor callback. Not under --torch_compile: the hooks would run inside compiled decoder layers."""
    model = trainer.model
    if model is None:  # Trainer.__init__ sets one (given, or from model_init) before its subclasses run
        raise ValueError("router statistics need the Trainer's model")
    sites = find_routers(model)
    if not sites:
        return None
    if trainer.args.torch_compile:
        logger.info("router statistics off under --torch_compile (their hooks would sit in compiled layers)")
        return None
    monitor = RouterMonitor(RouterCounter(model, sites),
                            lambda counts: trainer.accelerator.reduce(counts, "sum"), trainer.args.device)
    trainer.add_callback(monitor)
    logger.info("router statistics: %d routers (%s, ...), logged as router/max_expert_share and "
                "router/unused_expert_share", len(sites), sites[0].name)
    return monitor
