"""The code's shape, read from the source: one package whose layers import one way (docs/architecture: a directory
is a layer), entry scripts that nobody imports, record reading and serving free of the training stack, no edit of
the import path anywhere, and no function longer than a screen."""

import ast
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.commands import script_env
from helpers.corpora import generated_corpus, write_lines
from helpers.pipeline_runs import write_config

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "lorakit"
SCRIPTS = REPO / "scripts"

# The training stack, bottom to top: a module may import its own layer or a lower one, never a higher one.
STACK = ["core", "records", "data", "models", "trainers", "rl"]
# The layers apart from the stack, and what each may import (besides itself). The pipeline and the console script
# reach the stages only as processes or through lorakit.commands' table, never by a static import.
APART = {
    "merge": {"core"},
    "serve": {"core", "records", "models"},
    "pipeline": {"core"},
    "demo": set(STACK) | {"pipeline"},
    # The commands (lorakit.commands.NAME: main and entry_point) are the top: they may import every layer, and no
    # layer names them, so nothing in the library imports a command (the console script imports one by its name in
    # the table, at run time).
    "commands": set(STACK) | {"merge", "serve", "pipeline", "demo"},
}
# What lorakit/commands/__init__.py (the table) defines: an import of one of these is of the table, which is
# import-free and open to every layer; any other lorakit.commands.NAME is a command module.
TABLE_NAMES = {"COMMANDS", "Command", "RUN_AS_MODULE", "command_line", "module_of_script"}
# Modules at the package's top (lorakit.commands' table, the version, the console script) import no layer
# statically, and every layer may import them.
# A function reads on one screen (lowered from 60 on 2026-12-08: the longest sat at the old ceiling, which steered it).
LONGEST_FUNCTION = 40


def imported_names(path: Path) -> set:
    """Absolute module names a file imports, wherever in the file the import sits (`from a import b` counts as
    a.b too, since b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def layer_of(module: str):
    """'lorakit.data.cache' -> 'data'; 'lorakit.commands.sft' -> 'commands'; a top module (the table
    lorakit.commands and what it defines, lorakit.__main__, lorakit.__version__) -> None."""
    parts = module.split(".")
    if parts[1:2] == ["commands"] and (len(parts) == 2 or parts[2] in TABLE_NAMES):
        return None
    return parts[1] if len(parts) > 1 and parts[1] in STACK + list(APART) else None


def allowed_layers(layer: str) -> set:
    if layer in STACK:
        return set(STACK[:STACK.index(layer) + 1])
    return APART[layer] | {layer}


def module_name(path: Path, package_root: Path) -> str:
    relative = path.relative_to(package_root.parent).with_suffix("")
    parts = list(relative.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_imports(package_root: Path) -> list:
    """'importer (layer) imports target (layer)' for every import that breaks the layer rules."""
    wrong = []
    for path in sorted(package_root.rglob("*.py")):
        importer = module_name(path, package_root)
        layer = layer_of(importer)
        for target in sorted(name for name in imported_names(path) if name.startswith("lorakit.")):
            target_layer = layer_of(target)
            if target_layer is None:  # lorakit.commands, lorakit.__version__: import-free, open to every layer
                continue
            if layer is None or target_layer not in allowed_layers(layer):
                wrong.append(f"{importer} ({layer or 'top'}) imports {target} ({target_layer})")
    return wrong


# Directories of the package that hold data, not code (lorakit.core.package_data).
DATA_DIRECTORIES = {"ds_configs", "__pycache__"}


def test_every_package_directory_is_a_known_layer():
    directories = {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name not in DATA_DIRECTORIES}
    assert not list((PACKAGE / "ds_configs").glob("*.py"))
    assert directories == set(STACK) | set(APART), sorted(directories)


def test_imports_point_down_the_layers():
    assert not upward_imports(PACKAGE), "\n".join(upward_imports(PACKAGE))


def test_a_planted_upward_import_is_caught(tmp_path):
    """The rules can fail: a data module importing a trainer, and a model module importing RL code."""
    root = tmp_path / "lorakit"
    for layer in ("data", "models", "trainers", "rl"):
        (root / layer).mkdir(parents=True)
    (root / "data" / "bad.py").write_text("from lorakit.trainers.common import build_trainer\n")
    (root / "models" / "also_bad.py").write_text("import lorakit.rl.rl_math\n")
    (root / "rl" / "fine.py").write_text("from lorakit.models import loader\nfrom lorakit.data import cache\n")
    assert upward_imports(root) == [
        "lorakit.data.bad (data) imports lorakit.trainers.common (trainers)",
        "lorakit.data.bad (data) imports lorakit.trainers.common.build_trainer (trainers)",
        "lorakit.models.also_bad (models) imports lorakit.rl.rl_math (rl)",
    ]


def package_modules(package_root: Path) -> dict:
    """{module name: its file} of every module of the package at package_root."""
    return {module_name(path, package_root): path for path in sorted(package_root.rglob("*.py"))}


def import_graph(package_root: Path) -> dict:
    """{module: the package's modules it imports}, every import counted: module-level, inside a function, and under
    `if TYPE_CHECKING:` (each is a dependency a reader follows, and a cycle through one still ties the modules
    together). `from a.b import c` is an import of a.b.c where that is a module, else of a.b."""
    modules = package_modules(package_root)
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and name != module.rpartition(".")[0] + ".__init__":
                targets.add(name)
        graph[module] = targets - {module}
    return graph


def import_cycles(package_root: Path) -> list:
    """The package's import cycles: each a sorted list of the modules that import one another (Tarjan's strongly
    connected components of import_graph, those of more than one module)."""
    graph, index, low, stack, on_stack, cycles = import_graph(package_root), {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return sorted(cycles)


def test_the_package_has_no_import_cycle():
    assert import_cycles(PACKAGE) == [], "\n".join(" <-> ".join(cycle) for cycle in import_cycles(PACKAGE))


def test_a_planted_import_cycle_is_caught(tmp_path):
    """The check can fail: a cycle closed only by a function-local import and one closed only under TYPE_CHECKING."""
    root = tmp_path / "lorakit"
    (root / "rl").mkdir(parents=True)
    (root / "rl" / "trainer.py").write_text("def run():\n    from lorakit.rl.config import Arguments\n")
    (root / "rl" / "config.py").write_text("from lorakit.rl import trainer\n")
    (root / "rl" / "math.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from lorakit.rl.policy import Policy\n")
    (root / "rl" / "policy.py").write_text("from lorakit.rl.math import loss\n")
    (root / "rl" / "alone.py").write_text("from lorakit.rl.math import loss\n")
    assert import_cycles(root) == [["lorakit.rl.config", "lorakit.rl.trainer"],
                                   ["lorakit.rl.math", "lorakit.rl.policy"]]


def test_nothing_in_the_library_imports_a_command_module(tmp_path):
    """Every module the table names as a command is under lorakit/commands/, and no module outside it imports one
    (TYPE_CHECKING and function-local imports included); a planted import of one is caught as an upward import."""
    from lorakit.commands import COMMANDS

    command_modules = {command.module for command in COMMANDS.values()}
    assert all(layer_of(module) == "commands" for module in command_modules), sorted(command_modules)
    configs = {command.config for command in COMMANDS.values()} - {None}
    assert not {module for module in configs if layer_of(module) == "commands"}, sorted(configs)
    graph = import_graph(PACKAGE)
    wrong = [f"{module} imports {target}" for module, targets in graph.items() if layer_of(module) != "commands"
             for target in targets if layer_of(target) == "commands"]
    assert not wrong, "\n".join(wrong)
    root = tmp_path / "lorakit"
    (root / "rl").mkdir(parents=True)
    (root / "rl" / "bad.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from lorakit.commands.ppo import main\n"
                                        "from lorakit.commands import COMMANDS\n")
    assert upward_imports(root) == ["lorakit.rl.bad (rl) imports lorakit.commands.ppo (commands)",
                                    "lorakit.rl.bad (rl) imports lorakit.commands.ppo.main (commands)"]


ARCHITECTURE_MAP = REPO / "docs" / "architecture.md"
# Modules allowed over the ceiling, each with its reason.
LONG_MODULES = {
    "lorakit.data.build_dataset": "every stage's cached pipelines and collators, one seam each (~710 lines)"}
LONGEST_MODULE = 700


def layer_modules(package_root: Path) -> set:
    """'rl.ppo_config', ... : every module inside a layer, as the map names it (packages' __init__ files left out:
    the layers' are empty and lorakit.commands' is the table the map describes in prose)."""
    return {name.removeprefix("lorakit.") for name, path in package_modules(package_root).items()
            if path.name != "__init__.py" and path.parent != package_root}


def map_problems(modules: set, text: str) -> list:
    """Modules the map leaves out, and names the map gives that are no module (a stale line)."""
    named = set(re.findall(r"`((?:" + "|".join(STACK + list(APART)) + r")\.[a-z_0-9]+)`", text))
    return ([f"{name}: not on the map" for name in sorted(modules - named)]
            + [f"{name}: on the map, not in the package" for name in sorted(named - modules)])


def test_every_module_is_on_the_map():
    """docs/architecture.md names every module of every layer (one line each) and no module that is gone."""
    assert not map_problems(layer_modules(PACKAGE), ARCHITECTURE_MAP.read_text(encoding="utf-8")), "\n".join(
        map_problems(layer_modules(PACKAGE), ARCHITECTURE_MAP.read_text(encoding="utf-8")))


def test_a_module_missing_from_the_map_is_caught():
    text = "| `rl.rollout` | engines |\n| `rl.ppo` | gone |\n"
    assert map_problems({"rl.rollout", "rl.ppo_config"}, text) == ["rl.ppo_config: not on the map",
                                                                   "rl.ppo: on the map, not in the package"]


def test_no_module_is_several_modules():
    """No module of the package over 700 lines but those LONG_MODULES names (a file that long has seams to split
    along: the readers, the plan, the output...), and no benchmark file either (bench_gpu.py was 1,514 lines)."""
    long = {name: len(path.read_text(encoding="utf-8").splitlines())
            for name, path in package_modules(PACKAGE).items()}
    long.update({str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
                 for path in python_files(REPO / "benchmarks")})
    assert {name for name, lines in long.items() if lines > LONGEST_MODULE} <= set(LONG_MODULES), {
        name: lines for name, lines in long.items() if lines > LONGEST_MODULE}


def python_files(*roots: Path) -> list:
    return [path for root in roots for path in sorted(root.rglob("*.py")) if ".cache" not in path.parts]


def test_nothing_imports_an_entry_script():
    """Entry scripts are run, never imported: no file imports a module named like one (their code is the
    package's), and scripts/ is no package."""
    entry_names = {path.stem for path in SCRIPTS.rglob("*.py")}
    wrong = []
    for path in python_files(REPO / "src", REPO / "tests", REPO / "benchmarks", SCRIPTS):
        for name in imported_names(path):
            if name.split(".")[0] in entry_names | {"scripts"}:
                wrong.append(f"{path.relative_to(REPO)} imports {name}")
    assert not wrong, "\n".join(wrong)
    assert not list(SCRIPTS.rglob("__init__.py"))


def test_no_file_edits_the_import_path():
    edits = []
    for path in python_files(REPO / "src", REPO / "tests", REPO / "benchmarks", SCRIPTS):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                edits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not edits, "sys.path is used at " + ", ".join(edits)


def test_every_entry_script_runs_its_package_module():
    """Each script is its command's entry point and nothing else: it names the module lorakit.commands lists."""
    from lorakit.commands import COMMANDS

    for name, command in COMMANDS.items():
        text = (REPO / command.script).read_text(encoding="utf-8")
        assert f"from {command.module} import entry_point" in text, name
        assert len(ast.parse(text).body) <= 4, f"{command.script} holds more than its entry point"


def test_build_dataset_offers_the_card_names():
    namespace = runpy.run_path(str(SCRIPTS / "training" / "build_dataset.py"))
    from lorakit.data import build_dataset
    from lorakit.trainers import checkpoints

    assert namespace["DataCollatorForSupervisedDataset"] is build_dataset.DataCollatorForSupervisedDataset
    assert namespace["SavePeftModelCallback"] is checkpoints.SavePeftModelCallback
    for name in ("build_pretraining_blocks", "build_sft_dataset", "build_preference_dataset", "cached_packed_rows"):
        assert namespace[name] is getattr(build_dataset, name)


def run_python(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, **kwargs)


def test_an_entry_script_without_the_package_says_how_to_install_it():
    """Without site-packages (-S: no lorakit, no torch) a script gives one line, exit 2, no traceback."""
    for script in ("training/run_sft_with_peft.py", "merge/merge_llama_with_lora.py", "run_pipeline.py"):
        # A bare interpreter starts in well under a second alone, but this failed once beside a loaded suite: the
        # time it needs then is a CPU's contention, not the check's subject.
        result = run_python("-S", str(SCRIPTS / script), "--help", timeout=600)
        assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: the lorakit package is not installed"), result.stderr
        assert "make install" in lines[0]


def test_console_script_lists_and_runs_the_commands():
    from lorakit.commands import COMMANDS

    listing = run_python("-m", "lorakit", "--help")
    assert listing.returncode == 0 and all(f"  {name} " in listing.stdout for name in COMMANDS), listing.stdout
    unknown = run_python("-m", "lorakit", "sfft")
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: lorakit has no command 'sfft'")
    merge_help = run_python("-m", "lorakit", "merge", "--help")
    assert merge_help.returncode == 0 and "--lora_model" in merge_help.stdout, merge_help.stderr[-2000:]


# What a plain (not editable) install of the package reads from the package alone: its configs and its commands.
INSTALLED_CHECK = """
import os, lorakit
from lorakit.core.cli import parse_args
from lorakit.core.package_data import DS_CONFIGS
from lorakit.models.arguments import ModelArguments
from lorakit.trainers.sft_config import SFTArguments, SFTDataArguments
argv = ["--model_name_or_path", "m", "--output_dir", "o", "--use_cpu", "--zero_stage", "3", "--offload"]
*_, training = parse_args((ModelArguments, SFTDataArguments, SFTArguments), argv)
print(lorakit.__file__, DS_CONFIGS, training.deepspeed, *sorted(os.listdir(DS_CONFIGS)))
"""


@pytest.mark.slow
def test_a_plain_install_runs_outside_the_repository(tmp_path, tiny_model_dir):
    """`pip install .` (not editable) into a folder, run from a directory with no repository around it: the
    package's DeepSpeed configs come from the package, and the pipeline runs its stage as `python -m lorakit`
    (there is no scripts/ folder to run)."""
    source, site, elsewhere = tmp_path / "source", tmp_path / "site", tmp_path / "elsewhere"
    shutil.copytree(PACKAGE.parent, source / "src")  # with the repository's build inputs, nothing else
    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(REPO / name, source / name)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                              "--no-index", "--target", str(site), str(source)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere.mkdir()
    env = {**script_env(), "PYTHONPATH": str(site)}
    checked = subprocess.run([sys.executable, "-c", INSTALLED_CHECK], cwd=elsewhere, env=env, capture_output=True,
                             text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr[-2000:]
    package, configs, chosen, *shipped = checked.stdout.split()
    assert package.startswith(str(site)) and configs == str(site / "lorakit" / "ds_configs")
    assert chosen == os.path.join(configs, "ds_zero3_offload.json")
    assert shipped == sorted(os.listdir(REPO / "ds_configs"))

    corpus = write_lines(elsewhere / "corpus.txt", generated_corpus(1500, seed=3))
    config = {"base_model": tiny_model_dir, "output_dir": "out", "deployment": {"mode": "single_node"},
              "stages": [{"stage": "vocabulary", "train_corpus": corpus, "vocab_size": 400, "num_threads": 1}]}
    ran = subprocess.run([sys.executable, "-m", "lorakit", "pipeline", write_config(elsewhere / "p.yaml", config)],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "-m lorakit merge-tokenizers" in ran.stdout
    assert (elsewhere / "out" / "vocabulary" / "tokenizer_config.json").is_file()


def loaded_modules(*imports: str) -> set:
    """Modules loaded, in a fresh interpreter, by importing these modules."""
    code = "; ".join(f"import {m}" for m in imports) + "; import sys; print(' '.join(sorted(sys.modules)))"
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    return set(result.stdout.split())


def test_record_reading_is_torch_free():
    loaded = loaded_modules("lorakit.records", "lorakit.records.readers", "lorakit.core.cli",
                            "lorakit.records.chat_templates")
    assert not {name.split(".")[0] for name in loaded} & {"torch", "transformers", "datasets", "pyarrow"}


def test_serving_does_not_load_the_training_data_layer_or_trainer():
    loaded = loaded_modules("lorakit.serve.openai_api")
    assert "fastapi" in loaded and "torch" in loaded  # the server itself did load
    assert not loaded & {"lorakit.data.build_dataset", "datasets", "pyarrow", "lorakit.trainers.common",
                         "lorakit.rl.ppo_trainer"}, sorted(loaded)


def long_functions(*roots: Path) -> list:
    found = []
    for path in python_files(*roots):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_longer_than_a_screen():
    assert not long_functions(REPO / "src", SCRIPTS), "\n".join(long_functions(REPO / "src", SCRIPTS))


@pytest.mark.parametrize("name", ["sft", "pt", "reward", "dpo", "ppo", "grpo"])
def test_training_arguments_pickle_under_their_package_path(name):
    """The Trainer pickles the arguments into training_args.bin by their class's module path: the package's
    config module, the same whether the stage runs from its script, `lorakit NAME` or in-process (the toolkit never
    reads that file back: a checkpoint's identity is its completion marker)."""
    import importlib

    from lorakit.commands import COMMANDS

    config = COMMANDS[name].config
    classes = importlib.import_module(config).ARGUMENT_CLASSES
    assert all(cls.__module__.startswith("lorakit.") and layer_of(cls.__module__) != "commands" for cls in classes), [
        cls.__module__ for cls in classes]


# Where a rename or an fsync may appear outside lorakit.core.atomic, and why it is not a file write.
RENAMES_ELSEWHERE = {
    "lorakit/data/cache.py": "publishes a whole cache directory; a process that loses the race reads the winner's",
    "lorakit/demo/prepare_default.py": "publishes the extracted demo model the same way, and a downloaded wheel",
    "lorakit/core/model_files.py": "swaps an identical file for a hard link: no content is written",
}


def test_atomic_writes_have_one_home():
    """Every writer publishes through lorakit.core.atomic (temporary sibling, fsync, rename, directory fsync)."""
    found = []
    for path in python_files(REPO / "src", SCRIPTS):
        relative = path.relative_to(REPO / "src").as_posix() if PACKAGE in path.parents else str(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr in {"replace", "rename", "fsync"}
                    and getattr(node.value, "id", None) == "os"):
                found.append((relative, node.lineno))
    stray = [f"{name}:{line}" for name, line in found
             if name != "lorakit/core/atomic.py" and name not in RENAMES_ELSEWHERE]
    assert not stray, "rename or fsync outside lorakit.core.atomic: " + ", ".join(stray)
    assert {name for name, _ in found} >= set(RENAMES_ELSEWHERE) | {"lorakit/core/atomic.py"}


# Functions whose fixed-length tuple return a library's protocol dictates, and which protocol.
TRAINER_COMPUTE_LOSS = "transformers.Trainer.compute_loss: the loss, or (loss, outputs) with return_outputs"
TRAINER_PREDICTION_STEP = "transformers.Trainer.prediction_step: (loss, logits, labels)"
PROTOCOL_TUPLES = {
    "src/lorakit/models/loader.py:inputs_in_float32": "a torch forward pre-hook with kwargs returns (args, kwargs)",
    "src/lorakit/rl/role_policy.py:actor_named_parameters": "torch's named_parameters(): (name, parameter) pairs",
    "src/lorakit/rl/ppo_policy.py:actor_named_parameters": "torch's named_parameters(): (name, parameter) pairs",
    "src/lorakit/rl/role_policy.py:contexts":
        "torch.utils.checkpoint's context_fn returns (forward, recompute) contexts",
    "src/lorakit/rl/rl_checkpoint.py:_prepare_for_training": "Trainer._prepare_for_training: (model, dataloader)",
    "src/lorakit/rl/ppo_trainer.py:compute_loss": TRAINER_COMPUTE_LOSS,
    "src/lorakit/rl/grpo_trainer.py:compute_loss": TRAINER_COMPUTE_LOSS,
    "src/lorakit/trainers/causal_lm.py:get_batch_samples": "Trainer.get_batch_samples: (batches, items in batch)",
    "src/lorakit/trainers/causal_lm.py:compute_loss": TRAINER_COMPUTE_LOSS,
    "src/lorakit/trainers/dpo_trainer.py:compute_loss": TRAINER_COMPUTE_LOSS,
    "src/lorakit/trainers/dpo_trainer.py:prediction_step": TRAINER_PREDICTION_STEP,
    "src/lorakit/trainers/reward_trainer.py:compute_loss": TRAINER_COMPUTE_LOSS,
    "src/lorakit/trainers/reward_trainer.py:prediction_step": TRAINER_PREDICTION_STEP,
}
BARE_CONTAINERS = {"tuple", "list", "dict", "set", "Tuple", "List", "Dict", "Set"}


def annotation_node(node: ast.expr) -> ast.expr:
    """A string annotation ("torch.Tensor", written so under TYPE_CHECKING) parsed to the expression it names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return ast.parse(node.value, mode="eval").body
    return node


def loose_return(annotation: ast.expr) -> bool:
    """A bare container, or a fixed-length tuple of parts that deserve names (tuple[X, ...] is a sequence), at the
    top or inside (list[tuple[str, int]], Iterator[dict])."""
    annotation = annotation_node(annotation)
    if isinstance(annotation, ast.BinOp):  # X | Y
        return loose_return(annotation.left) or loose_return(annotation.right)
    if isinstance(annotation, ast.Name):
        return annotation.id in BARE_CONTAINERS
    if not isinstance(annotation, ast.Subscript):
        return False
    parts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    if getattr(annotation.value, "id", None) in {"tuple", "Tuple"}:
        if not (len(parts) == 2 and isinstance(parts[1], ast.Constant) and parts[1].value is Ellipsis):
            return True
        parts = parts[:1]
    if getattr(annotation.value, "id", None) == "Callable":  # its arguments are another function's business
        parts = parts[1:]
    return any(loose_return(part) for part in parts if not isinstance(part, ast.Constant))


def loose_return_types(*roots: Path) -> list:
    found = []
    for path in python_files(*roots):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
                where = f"{path.relative_to(REPO)}:{node.name}"
                if loose_return(node.returns) and where not in PROTOCOL_TUPLES:
                    found.append(f"{where} -> {ast.unparse(node.returns)}")
    return found


def test_returns_name_their_parts():
    """Types say what travels: no function returns a bare tuple, list or dict, and none a fixed tuple of parts
    that a NamedTuple or dataclass would name (ruff's ANN rules, in `make lint`, require the annotations)."""
    assert not loose_return_types(REPO / "src", SCRIPTS), "\n".join(loose_return_types(REPO / "src", SCRIPTS))


def test_loose_returns_are_recognised():
    samples = {"tuple": True, "dict": True, "tuple[int, str]": True, "'tuple[torch.Tensor, torch.Tensor]'": True,
               "list[str] | None": False, "tuple[int, ...]": False, "dict[str, int]": False, "Scores": False,
               "tuple | None": True, "list[tuple[str, int]]": True, "Iterator[dict]": True,
               "dict[str, list[int]]": False, "tuple[tuple[int, int], ...]": True}
    for text, loose in samples.items():
        assert loose_return(ast.parse(text, mode="eval").body) is loose, text
