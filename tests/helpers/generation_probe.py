"""Test-only wrapper: runs run_ppo.py as `python generation_probe.py --record FILE SCRIPT ARGS...` (or under torchrun)
with a probe patched into PPO's generation from outside the product code. Each generation batch is sampled as the run
samples it (its --generation_gather), then again from the same random state with --generation_gather per_layer (the
ZeRO-3 path that gathers every layer at every token); the run goes on with its own answers and random state, so it
trains exactly as it would unprobed. Each process appends one JSON line per batch to FILE:

    {"rank", "steps": the actor's forward passes in the run's own sampling (one per generated token),
     "gathers": DeepSpeed all-gather collectives during the run's own sampling,
     "one_gather": those of gathering every actor parameter once from partitioned (zero3.gathered, after the
                   run's own sampling),
     "per_layer_gathers": those during the per-layer sampling,
     "same_tokens": whether both samplings drew the same answers,
     "logprob_diff", "entropy_diff": the largest difference of their log-probs and entropies}
"""

import argparse
import contextlib
import json
import runpy
import sys

import torch

ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "allgather_fn", "all_gather_coalesced")


class GatherCounter:
    """Counts the all-gather collectives issued through deepspeed.comm (ZeRO-3 fetches parameters through it)."""

    def __init__(self):
        import deepspeed.comm

        self.calls = 0
        for name in ALL_GATHERS:
            original = getattr(deepspeed.comm, name)
            setattr(deepspeed.comm, name, self.counted(original))

    def counted(self, original):
        def call(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        return call

    @contextlib.contextmanager
    def counting(self, into: dict, key: str):
        before = self.calls
        yield
        into[key] = self.calls - before


@contextlib.contextmanager
def forward_count(module, into: dict):
    into["steps"] = 0

    def count(*_):
        into["steps"] += 1

    handle = module.register_forward_hook(count)
    try:
        yield
    finally:
        handle.remove()


def install(record: str) -> None:
    from lorakit.models.zero3 import gathered
    from lorakit.rl.experience import ExperienceMaker

    counter, original_sample = GatherCounter(), ExperienceMaker.sample

    def probed_sample(self, prompt_ids, prompt_mask):
        generator, entry = self.model.generator(), {"rank": self.args.process_index}
        start = torch.get_rng_state()
        with counter.counting(entry, "gathers"), forward_count(generator, entry):
            tokens, logprobs, entropy = original_sample(self, prompt_ids, prompt_mask)
        # After sampling every parameter is partitioned again (before it, some may still be held from the
        # previous phase): the all-gathers of fetching them all once, the reference for "gathers".
        with counter.counting(entry, "one_gather"), gathered(generator.parameters()):
            pass
        end, own_mode = torch.get_rng_state(), self.args.generation_gather
        torch.set_rng_state(start)
        self.args.generation_gather = "per_layer"
        try:
            with counter.counting(entry, "per_layer_gathers"):
                layer_tokens, layer_logprobs, layer_entropy = original_sample(self, prompt_ids, prompt_mask)
        finally:
            self.args.generation_gather = own_mode
            torch.set_rng_state(end)
        entry["same_tokens"] = torch.equal(tokens, layer_tokens)
        if entry["same_tokens"]:
            entry["logprob_diff"] = (logprobs - layer_logprobs).abs().max().item()
            entry["entropy_diff"] = (entropy - layer_entropy).abs().max().item()
        with open(record, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
        return tokens, logprobs, entropy

    ExperienceMaker.sample = probed_sample


def recorded(record: str) -> list:
    with open(record, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", required=True)
    parser.add_argument("script")
    options, script_args = parser.parse_known_args()
    install(options.record)
    sys.argv = [options.script] + script_args
    runpy.run_path(options.script, run_name="__main__")
