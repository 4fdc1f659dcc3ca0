"""Two "nodes" on one machine: two torchrun launchers (--nnodes 2, one process each, gloo) rendezvousing on
127.0.0.1, as users launch a job on two machines. Each node has its own data cache (node-local disk); the
output directory is shared, as docs/nodes-and-memory.md (several nodes) requires."""

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.commands import KILL_WRAPPER, PT_SCRIPT, REPO, free_port, script_env
from helpers.run_outputs import adapter_weights
from helpers.tiny_runs import tiny_pt_args

NODE_TIMEOUT = 300  # seconds; a hang (one node waiting for a peer that is gone) fails the test instead of CI


def run_two_nodes(args_of_node, node0_probes: tuple = ()) -> list:
    """Launch node 0 and node 1 at once; return both CompletedProcess-like results. node0_probes are
    helpers/run_and_kill.py's options for rank 0 (the only process of node 0): --kill_at_step K takes node 0
    down mid-run, --record_steps FILE logs the steps it runs."""
    port = free_port()
    processes = []
    for node in (0, 1):
        wrapper = [KILL_WRAPPER, *node0_probes] if node0_probes and node == 0 else []
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
                   "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                   *wrapper, PT_SCRIPT, *map(str, args_of_node(node))]
        processes.append(subprocess.Popen(command, cwd=REPO, env=script_env(), text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=NODE_TIMEOUT)
        except subprocess.TimeoutExpired as err:
            for other in processes:
                other.kill()
            raise AssertionError("a node did not finish in time (hung waiting for its peer?)") from err
        results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    return results


def assert_both_ok(results) -> None:
    for node, result in enumerate(results):
        assert result.returncode == 0, f"node {node}: exit {result.returncode}\n{result.stderr[-5000:]}"


@pytest.mark.slow
def test_two_nodes_train_and_resume_after_one_node_is_killed(tiny_model_dir, varied_pretrain_dir,
                                                             zero2_two_process_pretraining, tmp_path):
    """Killed on node 0 after step 4 and relaunched, the two-node job resumes from checkpoint-3 and ends with the
    weights of the same job run uninterrupted as two processes on one node (world size, ranks and data alike)."""
    deepspeed = os.path.join(REPO, "ds_configs", "ds_zero2_no_offload.json")

    def node_args(output_dir):
        return lambda node: tiny_pt_args(tiny_model_dir, varied_pretrain_dir, output_dir, tmp_path / f"cache{node}",
                                         max_steps=6, save_steps=3, deepspeed=deepspeed)

    straight, crashed = zero2_two_process_pretraining["out"], tmp_path / "crashed"
    killed = run_two_nodes(node_args(crashed), node0_probes=("--kill_at_step", "4"))
    assert killed[0].returncode != 0 and killed[1].returncode != 0  # node 1 noticed, and did not hang
    assert (crashed / "checkpoint-3").is_dir() and not (crashed / "checkpoint-6").exists()
    # Both nodes prepared their data in their own cache (nothing shared but the output directory).
    assert all(any((tmp_path / f"cache{node}").iterdir()) for node in (0, 1))

    steps = tmp_path / "resumed_steps.jsonl"
    resumed = run_two_nodes(node_args(crashed), node0_probes=("--record_steps", str(steps)))
    assert_both_ok(resumed)
    # A resume, not a restart: the relaunched job ran steps 4-6 only.
    assert [json.loads(line)["step"] for line in steps.read_text().splitlines()] == [4, 5, 6]
    expected, actual = adapter_weights(straight / "pt_lora_model"), adapter_weights(crashed / "pt_lora_model")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[key], actual[key]) for key in expected)
