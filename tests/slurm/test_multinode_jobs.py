"""`sbatch slurm/train.sh` across the nodes of a real multi-node SLURM cluster.

The cluster (tests/slurm/cluster.py, NamespaceSlurmCluster): nodes n1-n4, each `slurmd` in a
network namespace of its own, a management network for SLURM and a fabric for the ranks (gloo on CPU,
GLOO_SOCKET_IFNAME=fab0). The jobs are submitted as the README says, with the tiny Qwen2 recipe
(configs/train/tiny_qwen2_arithmetic.yaml, a tiny random model) and real launch/train.py ranks:

- 2 nodes x 2 processes, preempted with USR1 mid-run and restarted by the requeue on another node list,
  trains to the losses of 1 node x 4 processes step by step, in one MLflow run;
- AutoTP tp=2 over 2 nodes x 2 processes (tensor-parallel pairs inside a node, data parallel across
  nodes) trains to the tp=1 losses;
- a rank killed on the second node ends the job, FAILED, not requeued, nothing left on either node;
- the second node cut off the fabric mid-step ends the job within the collective timeout plus the peer check,
  with an error that names the ranks that no longer answer.

Each job costs 30-90 s here, so one job serves several tests, and the two fault jobs overlap on the 4
nodes; the fault times are printed (pytest -s) and bounded only generously (to catch a hang, not to
measure speed).
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from ntil_ds.preemption import EXIT_PREEMPTED
from tests.conftest import REPO_ROOT
from tests.distributed.training_runs import train_metrics
from tests.slurm.cluster import FABRIC_INTERFACE, FINAL_STATES, NamespaceSlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.distributed]

RECIPE = "configs/train/tiny_qwen2_arithmetic.yaml"
AUTOTP_JSON = "configs/deepspeed/zero3_autotp.json"
STEPS = 16
JOB_TIMEOUT_S = 600  # generous: a guard against hangs on a busy 2-core machine, not a speed check
ENDLESS = 100_000  # max_steps of the fault jobs: they end by the fault, never by finishing


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random Qwen2 folder (config and tokenizer, no weights) and easy arithmetic data."""
    from ntil_ds.data.synthetic import write_dataset
    from ntil_ds.tiny import build_tiny_model_folder

    root = tmp_path_factory.mktemp("multinode-inputs")
    model_dir = build_tiny_model_folder("qwen2", root / "model")
    return model_dir, write_dataset("arithmetic", 200, root / "data", seed=0, difficulty="easy")["train"]


def overrides(inputs: tuple[Path, Path], out: Path, steps: int = STEPS, *extra: str) -> list[str]:
    model_dir, train_file = inputs
    return [
        f"output_dir={out}",
        f"model.name_or_path={model_dir}",
        f"data.train_file={train_file}",
        "data.eval_file=",
        f"train.max_steps={steps}",
        # 8 sequences a step: 4 data-parallel ranks x 2, or (AutoTP) 2 ranks x 2 micro-batches of 2
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "optim.warmup_steps=2",
        "train.log_every=1",
        "train.save_every=0",
        "train.export_at_end=false",
        # Cross-entropy (the recipe's NTIL with lambda 0: its parts are still computed and logged). NTIL's
        # gradient depends on how a step's samples are split into micro-batches (its sequence-level
        # means and CE/NTIL rescale are per micro-batch; tests/distributed/test_train_normalization.py),
        # and AutoTP's 2 data-parallel ranks x 2 micro-batches split them otherwise than 4 ranks x 1.
        "loss.name=ce",
        "tracking.enabled=false",
        *extra,
    ]


def submit(cluster: NamespaceSlurmCluster, tmp: Path, args: list[str], *, nodes: int, nproc: int,
           env: dict[str, str] | None = None) -> str:  # fmt: skip
    """sbatch slurm/train.sh RECIPE ARGS from the login node, as a user would, with CPU ranks."""
    job_env = {
        "ACCELERATOR": "cpu",
        "NPROC_PER_NODE": str(nproc),
        "NTIL_PREEMPT_FLAG": str(tmp / "preempt.flag"),
        # the venv's deepspeed/python, as an activated venv would give
        "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}",
        # the ranks talk over the fabric, SLURM over the management network
        "GLOO_SOCKET_IFNAME": FABRIC_INTERFACE,
        **(env or {}),
    }
    return cluster.sbatch(
        [
            f"--output={tmp}/slurm-%j.out",
            f"--nodes={nodes}",
            "--gpus-per-node=0",
            f"--cpus-per-task={cluster.cpus}",
            "--time=15",
            # the recipe's warning (300 s before the limit) would come at once in a job this short
            "--signal=B:USR1@10",
            "slurm/train.sh",
            RECIPE,
            *args,
        ],
        env=job_env,
        cwd=REPO_ROOT,
    )


def job_log(tmp: Path, job_id: str) -> str:
    path = tmp / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no job log)"


def steps_logged(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for_steps(cluster: NamespaceSlurmCluster, job: str, tmp: Path, out: Path, steps: int) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while steps_logged(out) < steps:
        assert time.monotonic() < deadline, job_log(tmp, job)
        assert cluster.job(job).state in ("PENDING", "RUNNING"), job_log(tmp, job)
        time.sleep(0.05)


def node_list(cluster: NamespaceSlurmCluster, job: str) -> list[str]:
    nodes = cluster.job(job).raw["NodeList"]
    return cluster.run(["scontrol", "show", "hostnames", nodes]).stdout.split()


def training_ranks(cluster: NamespaceSlurmCluster, nodes: list[str]) -> dict[int, dict]:
    """rank -> where it runs and what it was told, for every launch/train.py process on ``nodes``."""
    ranks = {}
    for node in nodes:
        peers = cluster.tcp_peers(node)
        for pid in cluster.pids_in(node):
            try:
                process = psutil.Process(pid)
                # a rank, as the DeepSpeed launcher starts it (not the launchers, whose command names it too)
                if process.cmdline()[1:3] != ["-u", "launch/train.py"]:
                    continue
                environ = process.environ()
            except psutil.NoSuchProcess:
                continue
            ranks[int(environ["RANK"])] = {
                "node": node,  # the network namespace it runs in
                "pid": pid,
                "env": {key: environ.get(key) for key in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")},
                "peers": peers.get(pid, set()),
            }
    return ranks


def wait_nothing_left(cluster: NamespaceSlurmCluster, nodes: list[str], timeout: float = 30) -> dict:
    """Processes still on the nodes once a job ended (slurmstepd may need a moment to exit)."""
    deadline = time.monotonic() + timeout
    while True:
        left = {node: cluster.pids_in(node) for node in nodes}
        if not any(left.values()) or time.monotonic() > deadline:
            return {node: [_command(pid) for pid in pids] for node, pids in left.items() if pids}
        time.sleep(0.5)


def _command(pid: int) -> str:
    try:
        return f"{pid} " + " ".join(psutil.Process(pid).cmdline()[:4])
    except psutil.NoSuchProcess:
        return f"{pid} (gone)"


# ---- 2 x 2, preempted and moved, against 1 x 4 -----------------------------------------------------


@pytest.fixture(scope="module")
def preempted_and_reference(netns_cluster, inputs, tmp_path_factory):
    """Two jobs at once: the 2-node job (preempted after step 2; its first node is drained meanwhile, so
    the requeued start must run on another node list) and the 1-node x 4-process reference."""
    cluster = netns_cluster
    two, one = tmp_path_factory.mktemp("two-nodes"), tmp_path_factory.mktemp("one-node")
    # keep_last=2: the preemption checkpoint stays next to the final one, for the test to read
    tracking = ["tracking.enabled=true", f"tracking.uri=sqlite:///{two}/mlflow.db", "train.keep_last=2"]
    # the data cache on each node's own disk: every node builds its own copy, with its own ranks
    local_cache = f"data.cache_dir={cluster.scratch}/cache"
    two_job = submit(cluster, two, overrides(inputs, two / "out", STEPS, *tracking, local_cache),
                     nodes=2, nproc=2)  # fmt: skip
    one_job = submit(cluster, one, overrides(inputs, one / "out"), nodes=1, nproc=4)
    wait_for_steps(cluster, two_job, two, two / "out", 2)
    first_nodes = node_list(cluster, two_job)
    res = cluster.run(["scancel", "--batch", "--signal=USR1", two_job])
    assert res.returncode == 0, res.stderr
    drained = first_nodes[0]
    cluster.run(
        ["scontrol", "update", f"NodeName={drained}", "State=DRAIN", "Reason=test-move-the-requeued-job"]
    )
    try:
        two_info = cluster.wait_job(two_job, timeout=JOB_TIMEOUT_S)
        second_nodes = node_list(cluster, two_job)
        one_info = cluster.wait_job(one_job, timeout=JOB_TIMEOUT_S)
    finally:
        cluster.run(["scontrol", "update", f"NodeName={drained}", "State=RESUME"])
    cluster.wait_nodes_idle(60)
    return {
        "two": (two, two_job, two_info, first_nodes, second_nodes),
        "one": (one, one_job, one_info),
    }


def test_two_node_job_starts_one_launcher_per_node_with_the_allocations_ranks(preempted_and_reference):
    two, job, info, first_nodes, second_nodes = preempted_and_reference["two"]
    log = job_log(two, job)
    assert info.state == "COMPLETED", log
    assert len(first_nodes) == len(second_nodes) == 2 and first_nodes != second_nodes, (
        first_nodes,
        second_nodes,
    )
    starts = log.split(f"job {job} start ")[1:]
    assert len(starts) == 2, log
    for start, nodes in zip(starts, (first_nodes, second_nodes), strict=True):
        # rank 0 on the allocation's first node; node i holds ranks 2i, 2i+1 (node-major)
        assert f"[{' '.join(nodes)}] x 2 processes, rank 0 on {nodes[0]}:" in start
        assert f"node 0 {nodes[0]}: ranks 0-1" in start and f"node 1 {nodes[1]}: ranks 2-3" in start
        for rank, node in enumerate(nodes):
            assert f"[launch_node] {node} node_rank={rank}:" in start  # `hostname -s` inside the task
            assert f"nnodes=2, num_local_procs=2, node_rank={rank}" in start  # DeepSpeed's launcher
        assert (
            f"global_rank_mapping=defaultdict(<class 'list'>, {{'{nodes[0]}': [0, 1], '{nodes[1]}': [2, 3]}})"
            in start
        )


def test_two_nodes_train_to_the_one_node_losses_step_by_step(preempted_and_reference):
    one, one_job, one_info = preempted_and_reference["one"]
    two, two_job, two_info, _, _ = preempted_and_reference["two"]
    assert (one_info.state, one_info.exit_code) == ("COMPLETED", "0:0"), job_log(one, one_job)
    assert "1 node(s) [" in job_log(one, one_job) and "x 4 processes" in job_log(one, one_job)
    assert two_info.state == "COMPLETED", job_log(two, two_job)
    reference, metrics = train_metrics(one / "out"), train_metrics(two / "out")
    assert sorted(reference) == sorted(metrics) == list(range(1, STEPS + 1))
    # Same 4 data-parallel ranks, same samples, same collectives: bit for bit, whether the ranks share
    # one node or talk TCP across two, and across the preemption and the move to other nodes.
    for step in range(1, STEPS + 1):
        for key in ("loss", "ntil", "grad_norm", "labelled_tokens"):
            assert metrics[step][key] == reference[step][key], (step, key)
    assert reference[STEPS]["loss"] < reference[1]["loss"]  # it trained


def test_each_node_builds_its_own_node_local_data_cache(preempted_and_reference, netns_cluster, inputs):
    """data.cache_dir on the nodes' own disks (the cluster's scratch, one folder per node): every node
    the job started on holds a complete cache, built there (by its first rank to find the lock free, its
    other rank helping: tests/unit/test_data_cache.py pins the split), equal byte for byte to the one
    the one-node job built beside the data on the shared filesystem."""
    cluster = netns_cluster
    two, job, info, first_nodes, second_nodes = preempted_and_reference["two"]
    assert info.state == "COMPLETED", job_log(two, job)
    (shared,) = (inputs[1].parent / ".ntil_cache").glob("*/manifest.json")  # the one-node job's
    for node in {*first_nodes, *second_nodes}:
        caches = list((cluster.scratch_of(node) / "cache").glob("*/manifest.json"))
        assert [c.parent.name for c in caches] == [shared.parent.name], (node, caches)
        files = {p.name: p.read_bytes() for p in sorted(caches[0].parent.iterdir())}
        assert files == {p.name: p.read_bytes() for p in sorted(shared.parent.iterdir())}, node
    assert not (cluster.scratch / "cache").exists()  # outside the nodes the scratch is empty


def test_preempted_two_node_job_checkpoints_once_requeues_and_continues_its_mlflow_run(
    preempted_and_reference,
):
    two, job, info, _, _ = preempted_and_reference["two"]
    log = job_log(two, job)
    out = two / "out"
    assert (info.state, info.exit_code, info.restarts) == ("COMPLETED", "0:0", 1), log
    assert f"ranks checkpointed (exit {EXIT_PREEMPTED}): requeueing job {job}" in log
    checkpoints = sorted(p.parent for p in (out / "checkpoints").glob("step_*/COMPLETE"))
    assert [p.name for p in checkpoints][-1] == f"step_{STEPS:08d}" and len(checkpoints) == 2, log
    preempted = checkpoints[0]
    preempted_at = json.loads((preempted / "trainer_state.json").read_text())["step"]
    assert 2 <= preempted_at < STEPS, log
    # All four ranks, on both nodes, saved their part of the one preemption checkpoint.
    assert sorted(p.name for p in preempted.glob("rng_rank*.pt")) == [f"rng_rank{r}.pt" for r in range(4)]
    first_start, second_start = log.split(f"job {job} start 2")
    assert f"preempted at step {preempted_at}" in first_start
    assert f"resumed from {preempted}" in second_start
    assert not (two / "preempt.flag").exists()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{two}/mlflow.db")
    runs = [run for exp in client.search_experiments() for run in client.search_runs([exp.experiment_id])]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED", [r.info for r in runs]
    assert runs[0].data.tags["ntil_ds.num_nodes"] == "2"
    history = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "train/loss")}
    metrics = train_metrics(out)
    assert history == pytest.approx({s: metrics[s]["loss"] for s in range(1, STEPS + 1)}, rel=1e-9)


# ---- AutoTP across nodes ---------------------------------------------------------------------------


def test_autotp_pairs_inside_nodes_data_parallel_across_nodes_equals_tp1(
    netns_cluster, inputs, preempted_and_reference, tmp_path
):
    one, _, _ = preempted_and_reference["one"]
    job = submit(netns_cluster, tmp_path, overrides(inputs, tmp_path / "out", STEPS, f"deepspeed={AUTOTP_JSON}"),
                 nodes=2, nproc=2)  # fmt: skip
    info = netns_cluster.wait_job(job, timeout=JOB_TIMEOUT_S)
    log = job_log(tmp_path, job)
    assert (info.state, info.exit_code) == ("COMPLETED", "0:0"), log
    nodes = node_list(netns_cluster, job)
    # Ranks 0,1 on the first node, 2,3 on the second; the trainer refuses to start unless DeepSpeed's
    # tensor-parallel groups are [0, 1] and [2, 3] (ntil_ds/dist.py, check_parallel_layout): each pair
    # inside one node, the data-parallel pairs [0, 2] and [1, 3] across the nodes.
    assert (
        f"global_rank_mapping=defaultdict(<class 'list'>, {{'{nodes[0]}': [0, 1], '{nodes[1]}': [2, 3]}})"
        in log
    )
    tp2, tp1 = train_metrics(tmp_path / "out"), train_metrics(one / "out")
    assert sorted(tp2) == sorted(tp1) == list(range(1, STEPS + 1))
    # The same 8 samples a step in other micro-batches and other summation orders: fp32 rounding only
    # (~1e-8 measured).
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", "labelled_tokens"):
            assert tp2[step][key] == pytest.approx(tp1[step][key], rel=1e-6, abs=0), (step, key)
    assert tp1[STEPS]["loss"] < tp1[1]["loss"]


# ---- faults ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faults(netns_cluster, inputs, tmp_path_factory) -> dict[str, dict]:
    """Two fault jobs of 2 nodes each, overlapped on the 4 nodes (each fault leaves its job waiting, not
    computing: the cut-off job waits out its collective timeout while the other starts):

    - "cut": the second node cut off the fabric after step 2 (every collective's timeout 20 s:
      NTIL_COLLECTIVE_TIMEOUT_S; DEEPSPEED_TIMEOUT's unit is a minute);
    - "killed": rank 2, on the second node, killed with SIGKILL after step 2, as the OOM killer would.

    The cut-off job starts alone (its 20 s timeout must not meet the other job's start-up on 2 cores)."""
    cluster = netns_cluster
    jobs: dict[str, dict] = {}

    def start(name: str, env: dict[str, str] | None = None) -> dict:
        tmp = tmp_path_factory.mktemp(f"fault-{name}")
        job = submit(cluster, tmp, overrides(inputs, tmp / "out", ENDLESS), nodes=2, nproc=2, env=env)
        jobs[name] = {"tmp": tmp, "job": job}
        return jobs[name]

    def reached_step_2(run: dict) -> None:
        wait_for_steps(cluster, run["job"], run["tmp"], run["tmp"] / "out", 2)
        run["nodes"] = node_list(cluster, run["job"])

    cut = start("cut", env={"NTIL_COLLECTIVE_TIMEOUT_S": "20"})
    reached_step_2(cut)
    killed = start("killed")  # on the two other nodes, while the cut-off job runs
    cluster.set_link(cut["nodes"][1], FABRIC_INTERFACE, up=False)
    cut["fault_at"] = time.monotonic()
    try:
        reached_step_2(killed)
        assert not set(killed["nodes"]) & set(cut["nodes"]), (killed["nodes"], cut["nodes"])
        killed["ranks"] = training_ranks(cluster, killed["nodes"])
        psutil.Process(killed["ranks"][2]["pid"]).send_signal(signal.SIGKILL)
        killed["fault_at"] = time.monotonic()
        # Both polled at once, so each job's time from its fault to its end is its own.
        deadline = time.monotonic() + 300
        while any("info" not in run for run in (killed, cut)):
            for run in (killed, cut):
                info = cluster.job(run["job"])
                if "info" not in run and info.state in FINAL_STATES:
                    run["info"], run["seconds"] = info, time.monotonic() - run["fault_at"]
            assert time.monotonic() < deadline, {
                name: cluster.job(r["job"]).state for name, r in jobs.items()
            }
            time.sleep(0.5)
    finally:
        cluster.set_link(cut["nodes"][1], FABRIC_INTERFACE, up=True)
        for run in jobs.values():
            if "info" not in run:  # a failed wait above: leave no job behind for the next tests
                cluster.run(["scancel", run["job"]])
    for run in (killed, cut):
        run["left"] = wait_nothing_left(cluster, run["nodes"])
        run["log"] = job_log(run["tmp"], run["job"])
    cluster.wait_nodes_idle(60)
    return jobs


def assert_failed_without_requeue(run: dict) -> None:
    info = run["info"]
    assert info.state == "FAILED", run["log"]
    # Promised: non-zero and not the preemption code (so no requeue). Which code reaches SLURM is a race:
    # the killed node's (247: its launcher's -9), 1 from the ranks, or 143 (srun --kill-on-bad-exit
    # stopped the other node).
    code, _ = info.exit_code.split(":")
    assert code not in ("0", str(EXIT_PREEMPTED)), info.exit_code
    assert info.restarts == 0
    assert not run["left"], run["left"]  # nothing left on either node


def test_killed_rank_on_the_second_node_ends_the_job_and_leaves_nothing(netns_cluster, faults):
    cluster, run = netns_cluster, faults["killed"]
    nodes, ranks = run["nodes"], run["ranks"]
    # Each rank runs in its node's network namespace, with the allocation's layout and rendezvous, and
    # talks real TCP to the other node over the fabric.
    assert {rank: r["node"] for rank, r in ranks.items()} == {
        0: nodes[0],
        1: nodes[0],
        2: nodes[1],
        3: nodes[1],
    }
    for rank, r in ranks.items():
        assert r["env"] == {"LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4", "MASTER_ADDR": nodes[0]}, r
    assert cluster.address(nodes[0], FABRIC_INTERFACE) in ranks[2]["peers"], ranks[2]
    assert cluster.address(nodes[1], FABRIC_INTERFACE) in ranks[0]["peers"], ranks[0]
    print(f"\nkilled rank 2 on {nodes[1]}: job {run['info'].state} {run['info'].exit_code} after "
          f"{run['seconds']:.1f} s")  # fmt: skip
    assert_failed_without_requeue(run)


def test_second_node_cut_off_the_fabric_ends_the_job_naming_the_lost_ranks(faults):
    run = faults["cut"]
    nodes, log = run["nodes"], run["log"]
    print(f"\n{nodes[1]} cut off the fabric: job {run['info'].state} {run['info'].exit_code} after "
          f"{run['seconds']:.1f} s")  # fmt: skip
    assert_failed_without_requeue(run)
    # The ranks' collectives time out after those 20 s, then rank 0 names who no longer answers.
    assert "Timed out waiting 20000ms" in log, log
    assert re.search(r"\[rank 0\] ranks that do not answer: ranks 2, 3 of 4 did not answer", log), log
    assert f"node 1 {nodes[1]}: ranks 2-3" in log
