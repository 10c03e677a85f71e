"""Who am I in the job: the only module that reads RANK / LOCAL_RANK / WORLD_SIZE.

Layout: ranks are grouped into tensor-parallel groups of ``tp_size`` consecutive ranks (the layout
DeepSpeed AutoTP builds; engine.py checks it against DeepSpeed's own groups). Data is sharded over
data-parallel ranks only: every rank of one tensor-parallel group reads the same batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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
