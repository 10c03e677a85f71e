"""Who am I in the job: the only module that reads RANK / LOCAL_RANK / WORLD_SIZE; and how a rank's
process ends (:func:`exit_process`).

Layout: ranks are grouped into tensor-parallel groups of ``tp_size`` consecutive ranks (the layout
DeepSpeed AutoTP builds; :func:`check_parallel_layout` compares it with DeepSpeed's own groups once the
engine exists). Data is sharded over data-parallel ranks only: every rank of one tensor-parallel group
reads the same batch.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size % self.tp_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by the tensor-parallel size "
                f"{self.tp_size} (tensor_parallel.autotp_size in the DeepSpeed JSON)"
            )

    @classmethod
    def from_env(cls, tp_size: int = 1) -> DistInfo:
        """Read the variables torchrun, the deepspeed launcher and srun-started torchrun set."""
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            tp_size=tp_size,
        )

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, tracks and prints; every rank still takes part in every collective."""
        return self.rank == 0

    def expected_tp_group(self) -> list[int]:
        """The global ranks of this rank's tensor-parallel group (consecutive ranks)."""
        start = self.dp_rank * self.tp_size
        return list(range(start, start + self.tp_size))

    def expected_dp_group(self) -> list[int]:
        """The global ranks of this rank's data-parallel group (same tp_rank, one per TP group)."""
        return list(range(self.tp_rank, self.world_size, self.tp_size))


def check_parallel_layout(info: DistInfo, tp_group: Sequence[int], dp_group: Sequence[int]) -> None:
    """Raise unless DeepSpeed's groups (global ranks) are the layout the data sharding assumes.

    The sampler gives every rank of a TP group the same batch by reading ``dp_rank = rank // tp_size``;
    if DeepSpeed grouped ranks differently, TP ranks would get different batches (or DP ranks the same
    one) and the gradients would be silently wrong.
    """
    if list(tp_group) != info.expected_tp_group() or list(dp_group) != info.expected_dp_group():
        raise RuntimeError(
            f"rank {info.rank}: DeepSpeed's tensor-parallel group is {list(tp_group)} and data-parallel "
            f"group {list(dp_group)}, but ntil-ds shards data for TP groups of {info.tp_size} consecutive "
            f"ranks (expected {info.expected_tp_group()} and {info.expected_dp_group()}). This DeepSpeed "
            "version lays out AutoTP groups differently: pin the tested deepspeed (constraints/cpu.txt)."
        )


def launcher_env_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a launcher sets, for a process started without one (``python launch/train.py``,
    as when debugging): a job of one process on this machine. Empty when a launcher set them."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def exit_process(code: int) -> NoReturn:
    """End this rank's process with ``code`` without interpreter finalization, after flushing its output.

    Why: C++ threads, gloo's workers above all, can still be releasing Python-owned tensors (the last
    reference to a temporary passed to a collective is the worker's) when the interpreter finalizes. A
    thread that needs the GIL then is ended by CPython in the middle of a C++ destructor, and the process
    aborts: SIGABRT, "terminate called without an active exception" (PyTorch issue 190489). That turned
    finished jobs into failed ones, on the rank that left first. Call it only when everything the process
    writes is closed (checkpoints, export, metrics.jsonl, the tracking journal: the trainer's fit() ends
    with all of them).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
