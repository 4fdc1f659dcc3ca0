"""The pipeline launcher's promises about its output directory (issue #30): one run at a time per output (a second
is refused at once, naming the first), SIGTERM reaching the stage's processes, a stage rerun when its data or
models change (contents, not paths) or its products are gone, a rerun that replaces the last good output only when
it succeeds, markers of the earlier version accepted with a line, symlinked stage directories refused, and the
other nodes told when node 0's one-process stage fails."""

import contextlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import time

import pytest

from helpers.commands import REPO, assert_ok, check_refused, free_port, run_in_process, script_env
from helpers.corpora import generated_corpus, write_lines
from helpers.pipeline_runs import (
    PIPELINE,
    STEPS,
    actions,
    pipeline_command,
    run_pipeline,
    words,
    write_config,
    write_jsonl,
)
from lorakit.pipeline.lock import OutputLock, lock_path
from lorakit.pipeline.process import descendants

SFT_STEPS = {**STEPS, "max_steps": 2, "save_steps": 2}


def sft_stage(data_dir) -> dict:
    return {"stage": "sft", "dataset_dir": str(data_dir), "template": "human_assistant", "max_seq_length": 64,
            "per_device_train_batch_size": 4}


def sft_config(model_dir, data_dir, output_dir, cache_dir, **steps) -> dict:
    return {"base_model": model_dir, "output_dir": str(output_dir),
            "deployment": {"mode": "single_node", "nproc_per_node": 1},
            "training_flags": {"use_cpu": True, "data_cache_dir": str(cache_dir), **SFT_STEPS, **steps},
            "stages": [sft_stage(data_dir), {"stage": "merge"}]}


def vocabulary_config(model_dir, corpus, output_dir, **deployment) -> dict:
    return {"base_model": model_dir, "output_dir": str(output_dir),
            "deployment": {"mode": "single_node", "nproc_per_node": 1, **deployment},
            "stages": [{"stage": "vocabulary", "train_corpus": str(corpus), "vocab_size": 400, "num_threads": 1}]}


@pytest.fixture(scope="module")
def sft_run(tiny_model_dir, tmp_path_factory):
    """A finished sft -> merge run. Its SFT data is its own: a test edits it and puts it back (the data's path is
    part of the stage's hash, so a copy elsewhere would be another config)."""
    root, rng = tmp_path_factory.mktemp("pipeline_sft"), random.Random(1)
    data = root / "sft_data" / "train.jsonl"
    write_jsonl(data, [{"instruction": words(rng, 2, 5), "output": words(rng, 2, 5)} for _ in range(24)])
    config = sft_config(tiny_model_dir, data.parent, root / "out", root / "cache")
    assert_ok(run_pipeline(write_config(root / "pipeline.yaml", config)))
    return {"root": root, "config": config, "data": data}


def copy_of_run(sft_run, tmp_path):
    """The finished run's output copied to tmp_path/out (output_dir is no part of a stage's hash): (config, out)."""
    out = tmp_path / "out"
    shutil.copytree(sft_run["root"] / "out", out)
    return write_config(tmp_path / "pipeline.yaml", {**sft_run["config"], "output_dir": str(out)}), out


@contextlib.contextmanager
def edited(path, change):
    """path's text changed for the block, then its bytes put back."""
    original = path.read_bytes()
    path.write_text(change(original.decode("utf-8")), encoding="utf-8")
    try:
        yield
    finally:
        path.write_bytes(original)


def marker(out, name) -> dict:
    return json.loads((out / ".pipeline" / f"{name}.json").read_text(encoding="utf-8"))


def decision_lines(result) -> dict:
    return {line.split("'")[1]: line for line in result.stdout.splitlines() if line.startswith("pipeline: stage '")}


# ----------------------------------------------------------------------------- what a rerun does


@pytest.mark.slow
def test_an_edited_record_reruns_sft_and_what_follows_and_replaces_their_output(sft_run, tmp_path):
    """The same paths and flags, one record's text changed: SFT reruns (built beside the old output, which it then
    replaces) and so does the merge after it; with the record put back, both are complete again."""
    path, out = copy_of_run(sft_run, tmp_path)
    adapter = out / "sft" / "sft_lora_model" / "adapter_model.safetensors"
    old_adapter, old_run = adapter.stat().st_ino, marker(out, "sft")["run_id"]
    with edited(sft_run["data"], lambda text: text.replace('"output": "', '"output": "很好 ', 1)):
        planned = run_in_process(PIPELINE, [path, "--dry_run"])
        assert_ok(planned)
        assert actions(planned) == {"sft": "run", "merge": "run"}
        assert "the contents of its data files or models changed" in decision_lines(planned)["sft"]
        rerun = run_pipeline(path)
        assert_ok(rerun)
        assert actions(rerun) == {"sft": "run", "merge": "run"}
        assert adapter.stat().st_ino != old_adapter and marker(out, "sft")["run_id"] != old_run
        assert f"--output_dir {out / '.pipeline' / 'build' / 'sft'}" in (out / "logs" / "sft.log").read_text()
        assert not (out / ".pipeline" / "build" / "sft").exists()
        assert "sft/sft_lora_model/adapter_model.safetensors" in marker(out, "sft")["products"]
        assert f"--lora_model {out / 'sft' / 'sft_lora_model'}" in (out / "logs" / "merge.log").read_text()
        assert set(actions(run_in_process(PIPELINE, [path, "--dry_run"])).values()) == {"skip"}


@pytest.mark.slow
def test_a_rerun_refused_for_bad_input_leaves_the_last_good_output_in_place(sft_run, tmp_path):
    """A record broken after a complete run: the rerun is refused by the SFT script (exit 2, file:line), the
    complete adapter and its marker stay as they were; launched again on the same data it is refused at once
    (no resume after exit 2); with the record put back, nothing needs to run."""
    path, out = copy_of_run(sft_run, tmp_path)
    adapter = out / "sft" / "sft_lora_model" / "adapter_model.safetensors"
    before, complete = adapter.read_bytes(), marker(out, "sft")
    with edited(sft_run["data"], lambda text: text + "{not json\n"):
        refused = run_pipeline(path)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "train.jsonl:25" in refused.stderr and "stage 'sft' exited with status 2" in refused.stderr
        assert adapter.read_bytes() == before and (out / "merge" / "model.safetensors").exists()
        assert {key: value for key, value in marker(out, "sft").items() if key != "attempt"} == complete
        assert marker(out, "sft")["attempt"]["failed"]["status"] == 2
        check_refused(run_in_process(PIPELINE, [path]), "stage 'sft' stopped with exit status 2")
    assert set(actions(run_in_process(PIPELINE, [path, "--dry_run"])).values()) == {"skip"}


@pytest.mark.slow
def test_a_complete_stage_whose_products_are_gone_runs_again(sft_run, tmp_path):
    path, out = copy_of_run(sft_run, tmp_path)
    (out / "sft" / "sft_lora_model" / "adapter_model.safetensors").unlink()
    planned = run_in_process(PIPELINE, [path, "--dry_run"])
    assert_ok(planned)
    assert actions(planned) == {"sft": "run", "merge": "run"}
    assert "adapter_model.safetensors is gone" in decision_lines(planned)["sft"]


@pytest.mark.slow
def test_markers_of_the_earlier_version_are_accepted_with_a_line_naming_what_cannot_be_checked(sft_run, tmp_path):
    """Markers as the version before content hashes wrote them (its config_hash is today's flags hash; no
    products): complete stages are skipped with a line saying their data and models are taken as unchanged; a
    changed flag still reruns them."""
    path, out = copy_of_run(sft_run, tmp_path)
    for name in ("sft", "merge"):
        record = marker(out, name)
        legacy = {"config_hash": record["flags_hash"], "inputs": record["inputs"], "complete": True,
                  "run_id": record["run_id"], "command": record["command"], "seconds": record["seconds"]}
        (out / ".pipeline" / f"{name}.json").write_text(json.dumps(legacy), encoding="utf-8")
    planned = run_in_process(PIPELINE, [path, "--dry_run"])
    assert_ok(planned)
    assert actions(planned) == {"sft": "skip", "merge": "skip"}
    assert all("holds no hash of file contents" in line for line in decision_lines(planned).values())
    assert actions(run_in_process(PIPELINE, [path, "sft.learning_rate=1e-2", "--dry_run"])) == {
        "sft": "run", "merge": "run"}


def test_a_symlinked_stage_directory_is_refused(tiny_model_dir, tmp_path):
    """Clearing or replacing OUTPUT/sft would act on the link, not on what it points to: refused before anything
    runs, and what the link points to is left alone."""
    data = tmp_path / "data" / "train.jsonl"
    write_jsonl(data, [{"instruction": "a", "output": "b"}])
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept.txt").write_text("kept")
    out.mkdir()
    (out / "sft").symlink_to(elsewhere)
    path = write_config(tmp_path / "pipeline.yaml", sft_config(tiny_model_dir, data.parent, out, tmp_path / "cache"))
    for arguments in ([], ["--dry_run"]):
        check_refused(run_in_process(PIPELINE, [path, *arguments]), f"{out / 'sft'} is a symbolic link")
    assert (elsewhere / "kept.txt").read_text() == "kept" and sorted(os.listdir(out)) == ["sft"]


# ----------------------------------------------------------------------------- one run per output directory


def test_a_second_launcher_on_the_same_output_is_refused_at_once_and_the_first_runs_as_alone(tiny_model_dir,
                                                                                            tmp_path):
    corpus = tmp_path / "corpus.txt"
    write_lines(corpus, generated_corpus(1500, seed=3))
    path = write_config(tmp_path / "pipeline.yaml", vocabulary_config(tiny_model_dir, corpus, tmp_path / "out"))
    first = subprocess.Popen(pipeline_command(path), cwd=REPO, env=script_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in first.stdout:  # the first holds the lock and runs its stage
            if line.startswith("pipeline: $ "):
                break
        started = time.time()
        second = run_pipeline(path, timeout=60)
        took = time.time() - started
        first_output, first_errors = first.communicate(timeout=300)
    finally:
        first.kill()
    check_refused(second, f"is in use by another pipeline run: pid {first.pid} on host {socket.gethostname()}, since")
    assert took < 10 and first.returncode == 0, first_errors[-3000:]
    assert not os.path.exists(lock_path(str(tmp_path / "out"), 0))  # released at the end
    alone = tmp_path / "alone"
    assert_ok(run_pipeline(write_config(tmp_path / "alone.yaml", vocabulary_config(tiny_model_dir, corpus, alone))))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / "vocabulary" / name).read_bytes() == (alone / "vocabulary" / name).read_bytes()


def take_lock(output_dir, outcome, leave):
    """A child process: take the lock, report, stay until told to leave (or at once: leave None), and leave it behind
    as a killed run would (no release)."""
    try:
        OutputLock(output_dir, 0).acquire()
        outcome.put("taken")
    except Exception as err:  # noqa: BLE001 the refusal, whatever its type, is what the parent reads
        outcome.put(str(err))
    if leave is not None:
        leave.wait(30)


def test_a_lock_left_by_a_dead_run_is_taken_over_once_and_a_live_one_refuses(tmp_path):
    """A lock whose process is gone (same host) is taken over with a line naming it; two runs taking over the same
    stale lock at once: exactly one wins (flock around the takeover), the other is refused naming the winner."""
    context = multiprocessing.get_context("fork")
    output_dir = str(tmp_path / "out")
    outcome = context.Queue()
    dead = context.Process(target=take_lock, args=(output_dir, outcome, None))
    dead.start()
    dead.join()
    assert outcome.get(timeout=10) == "taken" and os.path.exists(lock_path(output_dir, 0))
    leave = context.Event()
    takers = [context.Process(target=take_lock, args=(output_dir, outcome, leave)) for _ in range(2)]
    for taker in takers:
        taker.start()
    results = sorted(outcome.get(timeout=10) for _ in takers)
    leave.set()
    for taker in takers:
        taker.join()
    assert results[1] == "taken" and "is in use by another pipeline run" in results[0], results
    winner = json.loads(open(lock_path(output_dir, 0), encoding="utf-8").read())
    assert winner["pid"] in {taker.pid for taker in takers} and f"pid {winner['pid']}" in results[0]
    # Held by a live process (this one): refused, naming it; another node's rank is another lock.
    with OutputLock(output_dir, 1) as held:
        with pytest.raises(Exception, match=f"pid {os.getpid()} on host"):
            OutputLock(output_dir, 1).acquire()
        with pytest.raises(Exception, match=f"pid {os.getpid()} on host"):
            OutputLock(output_dir, 1).check_free()
        assert json.loads(open(held.path, encoding="utf-8").read())["token"] == held.token
    assert not os.path.exists(lock_path(output_dir, 1))


# ----------------------------------------------------------------------------- signals and nodes


def test_sigterm_to_the_launcher_ends_the_stage_and_its_processes(tiny_model_dir, tmp_path):
    """SIGTERM to the launcher while SFT trains under torchrun: the launcher forwards it to the stage's process
    group, waits for torchrun and its worker to end, and exits 128 + 15 with one line."""
    data = tmp_path / "data" / "train.jsonl"
    rng = random.Random(2)
    write_jsonl(data, [{"instruction": words(rng, 2, 5), "output": words(rng, 2, 5)} for _ in range(24)])
    config = sft_config(tiny_model_dir, data.parent, tmp_path / "out", tmp_path / "cache", max_steps=500)
    launcher = subprocess.Popen(pipeline_command(write_config(tmp_path / "pipeline.yaml", config)), cwd=REPO,
                                env=script_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    stage = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not sft_worker(stage):
            time.sleep(0.2)
            stage = descendants(launcher.pid)  # torchrun (launch.py) and, once started, its worker
        assert sft_worker(stage), "the SFT worker never started"
        launcher.send_signal(signal.SIGTERM)
        _, errors = launcher.communicate(timeout=120)
        assert launcher.returncode == 128 + signal.SIGTERM, errors[-3000:]
        assert "error: stopped by SIGTERM during stage 'sft'" in errors
        assert [pid for pid in stage if alive(pid)] == []
        assert marker(tmp_path / "out", "sft")["complete"] is False
    finally:
        for pid in [launcher.pid, *stage]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def sft_worker(pids) -> bool:
    # a worker runs `python -u -m lorakit sft ...`; its launcher `python -m lorakit launch ... -m lorakit sft ...`
    return any("lorakit sft" in command_line(pid) and "lorakit launch" not in command_line(pid) for pid in pids)


def command_line(pid) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid) -> bool:
    """Running (a zombie, ended but not yet reaped by a parent that is itself ending, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_node_1_exits_with_node_0s_reason_when_its_one_process_stage_fails(tiny_model_dir, tmp_path):
    """Two nodes on one output: node 0 runs the vocabulary stage, which refuses an empty corpus; node 1, waiting for
    its marker, exits with the same status and node 0's reason instead of waiting forever."""
    corpus = tmp_path / "empty.txt"
    corpus.write_text("\n", encoding="utf-8")
    config = vocabulary_config(tiny_model_dir, corpus, tmp_path / "out", mode="multi_node", nnodes=2,
                               master_port=free_port())
    path = write_config(tmp_path / "pipeline.yaml", config)
    nodes = [subprocess.Popen(pipeline_command(path, f"deployment.node_rank={rank}"), cwd=REPO, env=script_env(),
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in (0, 1)]
    try:
        results = [node.communicate(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert nodes[0].returncode == 2, results[0][1][-3000:]
    assert "holds no training lines" in results[0][1]
    assert nodes[1].returncode == 2, results[1][1][-3000:]
    errors = [line for line in results[1][1].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds no training lines" in errors[0] and "vocabulary" in errors[0], errors
