"""The repository's own files that the package reads at run time: the shipped DeepSpeed configs (ds_configs/) and
the entry scripts that the pipeline, the demo and the reward stage's merge run as processes. The one place that
knows the package sits in the repository (src/lorakit/core/ is three folders below its root)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DS_CONFIGS = os.path.join(ROOT, "ds_configs")


def script_path(relative: str) -> str:
    """An entry script (lorakit.commands.COMMANDS' script) as an absolute path."""
    return os.path.join(ROOT, relative)
