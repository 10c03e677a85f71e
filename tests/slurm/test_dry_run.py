"""slurm/train.sh DRY_RUN=1: the launch command each node would run, for 1, 2 and 4 nodes.

No cluster: only `scontrol show hostnames` is used (with a two-line slurm.conf, as on a login node).
Multi-node jobs cannot run on this machine; these tests pin what each node would be told.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.usefixtures("slurm_binaries")

STANDIN = "tests/slurm/standin_train.py"
RECIPE = "tests/slurm/standin_recipe.yaml"


@pytest.fixture
def dry_env(tmp_path: Path) -> dict[str, str]:
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=dry\nSlurmctldHost=localhost\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "MASTER_"))}
    env.pop("NPROC_PER_NODE", None)
    env.update(SLURM_CONF=str(conf), DRY_RUN="1", TRAIN_SCRIPT=STANDIN, NTIL_REPO=str(REPO_ROOT))
    return env


def dry_run(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(
        ["bash", "slurm/train.sh", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    if check:
        assert res.returncode == 0, res.stderr
    return res


def node_commands(stdout: str) -> dict[int, dict]:
    """{node_rank: {"host", "argv", "hostfile"}} from the dry-run output."""
    nodes: dict[int, dict] = {}
    current = None
    for line in stdout.splitlines():
        if m := re.match(r"# node (\d+) \((\S+)\) runs:", line):
            current = nodes.setdefault(int(m[1]), {"host": m[2], "hostfile": []})
        elif current is not None and line.startswith("# ") and ": " in line:
            current["hostfile"].append(line.split(": ", 1)[1])
        elif current is not None and line.startswith("deepspeed "):
            current["argv"] = shlex.split(line)
    return nodes


def flag(argv: list[str], name: str) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} given {len(values)} times in {argv}"
    return values[0]


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu07", ["gpu07"]),
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("gpu-a[01-02],gpu-b[10,12]", ["gpu-a01", "gpu-a02", "gpu-b10", "gpu-b12"]),
    ],
)
def test_each_node_gets_its_rank_and_the_same_rendezvous(dry_env, nodelist, hosts):
    dry_env.update(
        SLURM_JOB_NODELIST=nodelist, SLURM_NNODES=str(len(hosts)), SLURM_JOB_ID="4242", SLURM_GPUS_ON_NODE="8"
    )
    out = dry_run(dry_env, RECIPE, "max_steps=7", "output_dir=/scratch/my run").stdout
    n = len(hosts)

    srun_line = next(line for line in out.splitlines() if line.startswith("srun "))
    srun = shlex.split(srun_line)
    assert {f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"} <= set(srun)
    assert srun[srun.index("bash") :][:2] == ["bash", "slurm/launch_node.sh"]

    nodes = node_commands(out)
    assert sorted(nodes) == list(range(n))
    for rank, node in nodes.items():
        argv = node["argv"]
        assert node["host"] == hosts[rank]
        assert argv[:2] == ["deepspeed", "--no_ssh"]
        assert flag(argv, "node_rank") == str(rank)
        assert flag(argv, "master_addr") == hosts[0]  # rank 0 lives on the first node
        assert flag(argv, "master_port") == str(20000 + 4242 % 20000)
        # every node describes the same world: all hosts, 8 processes each (the GPUs SLURM gave)
        assert node["hostfile"] == [f"{h} slots=8" for h in hosts]
        # the training command arrives intact, spaces included, and nothing is added on a first start
        script_at = argv.index(STANDIN)
        assert argv[script_at:] == [STANDIN, "--config", RECIPE, "max_steps=7", "output_dir=/scratch/my run"]


def test_requeued_start_resumes_from_checkpoint(dry_env):
    dry_env.update(SLURM_JOB_NODELIST="n[1-2]", SLURM_JOB_ID="7", SLURM_RESTART_COUNT="1", NPROC_PER_NODE="4")
    nodes = node_commands(dry_run(dry_env, RECIPE, "resume=none").stdout)
    for node in nodes.values():
        # the last key=value wins: a requeued job never starts over, whatever the first start said
        assert node["argv"][-2:] == ["resume=none", "resume=auto"]
        assert node["hostfile"] == ["n1 slots=4", "n2 slots=4"]


def test_gpu_count_from_typed_gres_and_cpu_mode(dry_env):
    dry_env.update(SLURM_JOB_NODELIST="n1", SLURM_GPUS_PER_NODE="h100:4")
    assert node_commands(dry_run(dry_env, RECIPE).stdout)[0]["hostfile"] == ["n1 slots=4"]
    dry_env.pop("SLURM_GPUS_PER_NODE")
    dry_env.update(ACCELERATOR="cpu", NPROC_PER_NODE="2")
    assert node_commands(dry_run(dry_env, RECIPE).stdout)[0]["hostfile"] == ["n1 slots=2"]


def test_containers(dry_env):
    dry_env.update(SLURM_JOB_NODELIST="n[1-2]", NPROC_PER_NODE="8", CONTAINER_IMAGE="/img/ntil.sqsh")
    srun = shlex.split(next(x for x in dry_run(dry_env, RECIPE).stdout.splitlines() if x.startswith("srun ")))
    assert "--container-image=/img/ntil.sqsh" in srun
    assert f"--container-mounts={REPO_ROOT}:{REPO_ROOT}" in srun

    dry_env.update(CONTAINER_RUNTIME="apptainer", CONTAINER_IMAGE="/img/ntil.sif")
    srun = shlex.split(next(x for x in dry_run(dry_env, RECIPE).stdout.splitlines() if x.startswith("srun ")))
    start = srun.index("apptainer")
    assert srun[start : start + 3] == ["apptainer", "exec", "--nv"]
    assert srun[srun.index("/img/ntil.sif") + 1 : srun.index("/img/ntil.sif") + 3] == [
        "bash",
        "slurm/launch_node.sh",
    ]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {}, "usage: sbatch slurm/train.sh"),
        (("configs/train/no_such.yaml",), {}, "recipe configs/train/no_such.yaml not found"),
        ((RECIPE,), {"NPROC_PER_NODE": "0"}, "cannot tell how many processes to start per node"),
        ((RECIPE,), {"SLURM_NNODES": "3"}, "SLURM_NNODES=3 but the node list"),
        ((RECIPE,), {"ACCELERATOR": "tpu"}, "ACCELERATOR=tpu: use cuda or cpu"),
        ((RECIPE,), {"TRAIN_SCRIPT": "launch/nope.py"}, "launch/nope.py not found"),
    ],
)
def test_bad_input_is_a_clear_error(dry_env, args, env, message):
    dry_env.update(SLURM_JOB_NODELIST="n[1-2]", PATH="/usr/bin:/bin", **env)  # no nvidia-smi on PATH
    dry_env.setdefault("NPROC_PER_NODE", "8")
    res = dry_run(dry_env, *args, check=False)
    assert res.returncode == 2
    assert message in res.stderr


def test_scripts_pass_shellcheck(shellcheck):
    scripts = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "slurm").glob("*.sh"))
    assert "slurm/train.sh" in scripts and "slurm/launch_node.sh" in scripts
    res = subprocess.run([shellcheck, *scripts], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout
