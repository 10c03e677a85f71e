"""launch/train.py with one fault injected, chosen by the environment (for tests/faults/).

    NTIL_FAULT=enospc_at_save:STEP      rank 1's write of its part of the step-STEP checkpoint fails with
                                        ENOSPC, as on a full disk
    NTIL_FAULT=usr1_during_save:STEP    SIGUSR1 (SLURM's warning before preemption) reaches every rank in
                                        the middle of the step-STEP save: after DeepSpeed's files, before
                                        the rest

Everything else is the real entry point, run as the launchers run it.
"""

from __future__ import annotations

import errno
import os
import signal

import torch

import ntil_ds.engine
from launch.train import main
from ntil_ds.checkpoint import checkpoint_tag
from ntil_ds.dist import exit_process


def inject(fault: str) -> None:
    kind, _, step = fault.partition(":")
    tag = checkpoint_tag(int(step))
    rank = int(os.environ.get("RANK", "0"))
    if kind == "enospc_at_save":
        real_save = torch.save

        def full_disk_save(obj, f, *args, **kwargs):
            if rank == 1 and tag in str(f):
                with open(f, "wb") as partial:
                    partial.write(b"\0" * 100)  # what reached the disk before it filled up
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
            return real_save(obj, f, *args, **kwargs)

        torch.save = full_disk_save  # DeepSpeed's writes and ours go through torch.save
    elif kind == "usr1_during_save":
        real_engine_save = ntil_ds.engine.TrainingEngine.save_checkpoint

        def save_then_signal(self, save_dir, tag_now, client_state, **kwargs):
            real_engine_save(self, save_dir, tag_now, client_state, **kwargs)
            if tag_now == tag:
                os.kill(os.getpid(), signal.SIGUSR1)

        ntil_ds.engine.TrainingEngine.save_checkpoint = save_then_signal
    else:
        raise SystemExit(f"unknown NTIL_FAULT={fault!r}")


if __name__ == "__main__":
    inject(os.environ["NTIL_FAULT"])
    exit_process(main())  # as launch/train.py ends a rank
