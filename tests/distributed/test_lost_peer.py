"""A lost peer, on 3 real gloo processes: rank 2 stops answering (as a node cut off the network would),
ranks 0 and 1 see their collective fail (a timeout, or the closed connection a peer's timeout left), recognize the error (ntil_ds.dist.is_communication_error,
is_timeout) and rank 0's roll call (unanswering_ranks) names rank 2. The two-node SLURM test
(tests/slurm/test_multinode_jobs.py) does the same with a real cut link, at minutes' cost; this one
runs in seconds."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntil_ds import dist as ntil_dist

WORLD = 3
LOST = 2  # the rank that stops answering
COLLECTIVE_TIMEOUT = timedelta(seconds=3)
ROLL_CALL_TIMEOUT = timedelta(seconds=3)


def _rank_main(rank: int, store_path: str, tmp: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT
    )
    ntil_dist.make_peer_check_group()  # every rank, while all is well
    dist.barrier()
    if rank == LOST:
        # Alive but silent until the others are done (a process that exited would close its connections,
        # which the others would see at once: not the case under test).
        time.sleep(COLLECTIVE_TIMEOUT.total_seconds() + ROLL_CALL_TIMEOUT.total_seconds() + 10)
        os._exit(0)
    result: dict[str, object] = {}
    try:
        dist.all_reduce(torch.ones(1))
        result["error"] = None
    except RuntimeError as e:
        result.update(
            error=str(e).splitlines()[0],
            communication=ntil_dist.is_communication_error(e),
            timeout=ntil_dist.is_timeout(e),
        )
    result["roll_call"] = ntil_dist.unanswering_ranks(ROLL_CALL_TIMEOUT)
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # no destroy_process_group: its barrier would wait for the silent rank


@pytest.mark.distributed
@pytest.mark.timeout(120)  # a hang guard only
def test_timed_out_collective_is_recognized_and_the_roll_call_names_the_silent_rank(tmp_path):
    mp.start_processes(
        _rank_main, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, start_method="spawn"
    )
    results = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    # Promised: each waiting rank's collective fails with a communication error. Which one is a race: the
    # rank whose timeout fires first sees "Timed out", and its peer may then see "Connection closed by
    # peer" (the first rank's abort closed their pair) before its own timeout fires. Nothing closes a
    # connection before some rank has timed out, so at least one of them saw the timeout.
    for rank, result in results.items():
        assert result["error"] is not None, f"rank {rank}: the collective with a silent peer did not fail"
        assert result["communication"], result
    assert any(result["timeout"] for result in results.values()), results
    assert results[0]["roll_call"] == f"ranks {LOST} of {WORLD} did not answer within 3 s", results[0]
    assert results[1]["roll_call"].startswith("answered rank 0's roll call"), results[1]


def test_error_texts_are_told_apart():
    """What gloo says when a peer is gone (connection closed) and when it is silent (timeout)."""
    reset = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.231.1.2]:4242"
    )
    timed_out = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:446] Timed out waiting 60000ms for recv operation to complete"
    )
    other = RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")
    assert ntil_dist.is_communication_error(reset) and not ntil_dist.is_timeout(reset)
    assert ntil_dist.is_communication_error(timed_out) and ntil_dist.is_timeout(timed_out)
    assert not ntil_dist.is_communication_error(other)
