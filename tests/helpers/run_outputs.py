"""What a training run leaves in its output directory, read back."""

import json
import os


def log_history(output_dir) -> list:
    with open(os.path.join(output_dir, "trainer_state.json")) as handle:
        return json.load(handle)["log_history"]


def losses_of(output_dir) -> list:
    """The training loss of every logged step."""
    return [entry["loss"] for entry in log_history(output_dir) if "loss" in entry]


def adapter_weights(adapter_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))


def snapshot(*directories) -> dict:
    """{path: (size, mtime)} of every file and directory below the directories: equal before and after a run
    that wrote nothing."""
    found = {}
    for directory in directories:
        for path, names, files in os.walk(directory):
            for name in names + files:
                stat = os.stat(os.path.join(path, name))
                found[os.path.join(path, name)] = (stat.st_size, stat.st_mtime_ns)
    return found
