"""The per-node commands of a 2-node job, run side by side on this machine, form one job.

SLURM here has one node, so this runs what `srun` would start on each node of a 2-node allocation
(slurm/launch_node.sh with SLURM_NODEID 0 and 1) as two local processes. With `--no_ssh` the hostfile's
host names are never contacted; only the rendezvous address (127.0.0.1 here) must be reachable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ntil_ds.dist import free_port
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.timeout(300)
def test_two_nodes_launch_commands_form_one_job(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ)
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
        PYTHONPATH=str(REPO_ROOT),
        DS_ACCELERATOR="cpu",
        NTIL_NODES="node-a node-b",
        NPROC_PER_NODE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        SLURM_JOB_ID=str(free_port()),  # hostfile names stay unique across test runs
        TMPDIR=str(tmp_path),
    )
    command = ["bash", "slurm/launch_node.sh", "tests/slurm/standin_train.py", "--config",
               "tests/slurm/standin_recipe.yaml", f"output_dir={out}", "max_steps=3"]  # fmt: skip
    nodes = [
        subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**env, "SLURM_NODEID": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        logs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(logs)
    identities = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    # node i runs global rank i (1 process per node), the world spans both nodes
    assert identities == [
        {"rank": 0, "world_size": 2, "local_rank": 0, "node": "0"},
        {"rank": 1, "world_size": 2, "local_rank": 0, "node": "1"},
    ]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]
