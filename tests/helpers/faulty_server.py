"""The OpenAI-compatible server as users start it (its command's entry_point, with the same flags), whose
generation worker meets an accelerator error at each generation: a device-side assert cannot be caused on a
CPU, so the service's fault_injection raises what torch raises for one."""

import torch

from lorakit.commands import serve as serve_command
from lorakit.serve.completion_service import CompletionService


def device_side_assert() -> None:
    raise torch.AcceleratorError("CUDA error: device-side assert triggered\n"
                                 "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.")


class FaultyService(CompletionService):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fault_injection = device_side_assert


serve_command.CompletionService = FaultyService
serve_command.entry_point()
