"""What one benchmark run knows as it goes: its settings, its files, and every run's result so far. The plan reads it
to build the runs that depend on earlier figures, the report to judge them, and the budget's driver fills it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RunState:
    """settings: settings.settings_of's; paths: {name: path} of the data, the tokenizer and each model's directory
    (model:NAME) and reward adapter (reward:NAME); results: {run name: its spec and result}; prepared: {model: its
    preparation's result}; winners: the variants' best runs (plan.winners_step); deadline: time.monotonic()'s at
    the end of the time budget."""

    settings: dict
    paths: dict
    deadline: float
    flash_attention: bool = False
    results: dict = field(default_factory=dict)
    prepared: dict = field(default_factory=dict)
    winners: dict = field(default_factory=dict)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def device(self) -> str:
        """The device the models were prepared on, as the first preparation that finished named it."""
        return next((p["device"] for p in self.prepared.values() if p["status"] == "done"), "?")
