"""Where a rank runs and how the job is laid out: the device and backend follow DeepSpeed's accelerator
(DS_ACCELERATOR), the tensor-parallel layout the data sharding assumes is checked, and a process started
without a launcher is a job of one."""

from __future__ import annotations

import pytest
import torch

from ntil_ds.dist import DistInfo, check_parallel_layout, launcher_env_defaults
from ntil_ds.engine import device_for


def test_ds_accelerator_cpu_on_a_gpu_node_keeps_model_and_inputs_on_the_cpu(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what conftest and the Makefile set; stated here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU node
    assert get_accelerator().device_name() == "cpu"
    assert device_for(0) == torch.device("cpu")
    assert get_accelerator().communication_backend_name() == "gloo"


@pytest.mark.parametrize("rank", range(4))
def test_the_layout_deepspeed_builds_passes(rank):
    info = DistInfo(rank=rank, world_size=4, tp_size=2)
    # DeepSpeed's AutoTP groups (deepspeed/utils/groups.py): TP = consecutive ranks, DP = same TP rank.
    tp = [0, 1] if rank < 2 else [2, 3]
    dp = [rank % 2, rank % 2 + 2]
    check_parallel_layout(info, tp, dp)


def test_another_layout_is_refused_naming_both():
    info = DistInfo(rank=1, world_size=4, tp_size=2)
    with pytest.raises(
        RuntimeError, match=r"tensor-parallel group is \[1, 3\].*expected \[0, 1\] and \[1, 3\]"
    ):
        check_parallel_layout(info, tp_group=[1, 3], dp_group=[0, 1])


def test_no_launcher_means_a_job_of_one_on_this_machine():
    defaults = launcher_env_defaults({})
    assert {k: defaults[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
    }  # fmt: skip
    assert 0 < int(defaults["MASTER_PORT"]) < 65536
    assert launcher_env_defaults({"RANK": "3", "WORLD_SIZE": "8"}) == {}  # a launcher's values win
