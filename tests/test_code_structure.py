"""The code's shape, read from the source: imports point one way through the layers (README,
"Architecture"), record reading and serving stay free of the training stack, and no function
grows past a screen."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"

# scripts/training, bottom to top: a module may import modules of its own layer or lower ones.
LAYERS = {
    "foundation": {"cli", "records", "chat_templates", "zero3", "ppo_utils", "model_files", "pair_segments",
                   "dpo_losses", "checkpoint_state", "chunked_loss"},
    "data": {"build_dataset", "data_cache", "data_splits", "conversation_tokenizer", "prompt_data"},
    "model": {"model_utils", "ppo_policy"},
    "trainer": {"training_utils", "ppo_trainer", "ppo_experience", "ppo_ema", "ppo_checkpoint", "dpo_trainer"},
    "scripts": {"run_clm_pt_with_peft", "run_sft_with_peft", "run_reward", "run_ppo", "launch", "estimate_memory",
                "run_dpo"},
}
ORDER = list(LAYERS)
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}
# The other script directories and the training layers each may reach.
ALLOWED = {
    "merge": {"foundation"},
    "inference": {"foundation", "model"},
    # Every stage runs as its own process; the pipeline reads the scripts' argument tables only.
    "pipeline": {"foundation"},
}
LONGEST_FUNCTION = 60


def project_imports(path: Path, project_modules: set) -> set:
    """Names of project modules a file imports, wherever in the file the import sits."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    return imported & project_modules


def modules_in(directory: str) -> dict:
    return {path.stem: path for path in sorted((SCRIPTS / directory).glob("*.py"))}


def test_every_training_module_has_a_layer():
    unplaced = set(modules_in("training")) - set(LAYER_OF)
    assert not unplaced, f"place these modules in a layer of tests/test_code_structure.py LAYERS: {sorted(unplaced)}"


def test_training_imports_point_down():
    training = modules_in("training")
    upward = []
    for name, path in training.items():
        rank = ORDER.index(LAYER_OF[name])
        for target in project_imports(path, set(training)):
            if ORDER.index(LAYER_OF[target]) > rank:
                upward.append(f"{name} ({LAYER_OF[name]}) imports {target} ({LAYER_OF[target]})")
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("directory", sorted(ALLOWED))
def test_merge_and_inference_stay_off_the_training_stack(directory):
    training = set(modules_in("training"))
    wrong = []
    for name, path in modules_in(directory).items():
        for target in project_imports(path, training):
            if LAYER_OF[target] not in ALLOWED[directory]:
                wrong.append(f"{directory}/{name} imports {target} ({LAYER_OF[target]})")
    assert not wrong, "\n".join(wrong)


def loaded_modules(*imports: str) -> set:
    """Top-level modules loaded, in a fresh interpreter, by importing these script modules."""
    paths = [str(SCRIPTS / d) for d in ("training", "inference", "merge")]
    code = (f"import sys; sys.path[:0] = {paths!r}; " + "; ".join(f"import {m}" for m in imports)
            + "; print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    return set(result.stdout.split())


def test_record_reading_is_torch_free():
    loaded = loaded_modules("records", "cli", "chat_templates")
    assert not loaded & {"torch", "transformers", "datasets", "pyarrow"}, sorted(loaded)


def test_serving_does_not_load_the_training_data_layer_or_trainer():
    loaded = loaded_modules("openai_api_server")
    assert "fastapi" in loaded and "torch" in loaded  # the server itself did load
    assert not loaded & {"build_dataset", "datasets", "pyarrow", "training_utils", "ppo_trainer"}, sorted(loaded)


def long_functions(root: Path) -> list:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_longer_than_a_screen():
    assert not long_functions(SCRIPTS), "\n".join(long_functions(SCRIPTS))
