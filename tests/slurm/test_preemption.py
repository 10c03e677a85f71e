"""PreemptionWatcher: a signal or flag file seen by some ranks becomes one decision for all ranks."""

from __future__ import annotations

import os
import re
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from ntil_ds.preemption import EXIT_PREEMPTED, PreemptionWatcher
from tests.conftest import REPO_ROOT


@pytest.fixture
def watcher_factory():
    made: list[PreemptionWatcher] = []

    def make(*args, **kwargs) -> PreemptionWatcher:
        made.append(PreemptionWatcher(*args, **kwargs))
        return made[-1]

    yield make
    for watcher in made:
        watcher.close()


def test_no_request_until_the_flag_file_appears(watcher_factory, tmp_path):
    flag = tmp_path / "preempt.flag"
    watcher = watcher_factory(flag_file=str(flag))
    assert not watcher.requested() and watcher.reason is None
    flag.touch()
    assert watcher.requested()
    assert watcher.reason == f"flag file {flag}"
    flag.unlink()
    assert watcher.requested()  # once agreed, it stays: the trainer is already checkpointing


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_is_a_request_and_does_not_kill(watcher_factory, sig):
    watcher = watcher_factory(flag_file=None)
    assert not watcher.requested()
    os.kill(os.getpid(), sig)  # without the handler, either would end this process
    assert watcher.requested()
    assert watcher.reason == f"signal {sig.name}"


def test_close_restores_the_previous_handlers(watcher_factory):
    def previous(signum, frame):
        pass

    old = signal.signal(signal.SIGUSR1, previous)
    try:
        watcher = watcher_factory(signals=(signal.SIGUSR1,))
        assert signal.getsignal(signal.SIGUSR1) != previous
        watcher.close()
        assert signal.getsignal(signal.SIGUSR1) is previous
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_exit_code_is_distinct_from_common_failures_and_agrees_with_the_batch_script():
    # What a process produces without meaning "preempted" must never read as it: 0, 1 (exception),
    # 2 (config/usage), 126/127 (shell: not executable / not found), 128+n (killed by signal n, which
    # shells and SLURM report), and anything a byte cannot hold.
    not_preempted = {0, 1, 2, 126, 127} | {128 + s for s in range(1, 65)}
    assert EXIT_PREEMPTED not in not_preempted and 0 < EXIT_PREEMPTED < 256
    # slurm/train.sh requeues on its own copy of the code (a shell script cannot import Python), which
    # slurm/launch_node.sh hands over past srun.
    for name in ("train.sh", "launch_node.sh"):
        script = (REPO_ROOT / "slurm" / name).read_text()
        assigned = re.findall(r"^EXIT_PREEMPTED=(\d+)", script, flags=re.MULTILINE)
        assert assigned == [str(EXIT_PREEMPTED)], (name, assigned)


def _stop_step(watcher: PreemptionWatcher, request_at: dict[str, int], rank: int, flag: Path) -> int | None:
    for step in range(1, 20):
        if request_at.get("signal") == (rank, step):
            os.kill(os.getpid(), signal.SIGUSR1)
        if request_at.get("flag") == (rank, step):
            flag.touch()
        if watcher.requested():
            return step
    return None


def _rank_main(rank: int, world: int, store_path: str, tmp: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    # Each rank watches its own flag path: a file only one rank sees (node-local, on the batch node).
    flag = Path(tmp) / f"flag.{rank}"
    lines = []
    # Only rank 1 is signalled (at step 4); then, with fresh watchers, only rank 0's flag appears (step 6).
    for request_at in ({"signal": (1, 4)}, {"flag": (0, 6)}):
        watcher = PreemptionWatcher(flag_file=flag)
        lines.append(f"{_stop_step(watcher, request_at, rank, flag)} {watcher.reason}")
        watcher.close()
    Path(tmp, f"rank{rank}").write_text("\n".join(lines))
    dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_all_ranks_stop_at_the_same_step_when_one_rank_sees_a_request(tmp_path):
    mp.start_processes(
        _rank_main, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    stopped = {rank: (tmp_path / f"rank{rank}").read_text().splitlines() for rank in (0, 1)}
    # The rank that saw nothing stops at the same step boundary as the one that did.
    assert stopped[0] == ["4 None", f"6 flag file {tmp_path / 'flag.0'}"]
    assert stopped[1] == ["4 signal SIGUSR1", "6 None"]
