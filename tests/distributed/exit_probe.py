"""A 2-rank gloo job that ends the way a busy rank does: its last collective reduces a temporary (only
gloo's worker thread still holds it) and the main thread, keeping the GIL, goes straight to the end.

    python exit_probe.py RANK STORE_FILE finalize|exit_process
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ntil_ds.dist import exit_process

rank, store, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
sys.setswitchinterval(30)  # the main thread keeps the GIL unless it blocks, as on a loaded machine
for _ in range(3):
    dist.all_reduce(torch.ones(8) * 2)
if how == "exit_process":
    exit_process(0)
# else: plain interpreter finalization
