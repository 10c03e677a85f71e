"""Who am I in the job, how the ranks talk, and how a rank's process ends.

- :class:`DistInfo`: the only reader of RANK / LOCAL_RANK / WORLD_SIZE.
- The collectives the project uses, each named for what it does and marked COLLECTIVE (every rank of
  the process group must call it, in the same order): :func:`barrier`, :func:`all_gather_objects`,
  :func:`broadcast_from_main`, :func:`all_reduce_sums` (device values: a dict of named sums in one
  all-reduce, never a tensor read back by position), :func:`all_reduce_host_sums` and :func:`any_rank`
  (values the host knows already, reduced on a CPU group: they never wait for the device),
  :func:`leave_process_group`, :func:`unanswering_ranks` (after a lost peer). Without an initialized
  process group each answers for this process alone, so one code path serves 1 and N processes.
- :func:`is_communication_error`, :func:`is_timeout`: what a failed collective raised.
- :func:`read_to_host`: the one way device values reach the host (a sync point, named so it can be
  counted).
- :func:`exit_process`: how a rank's process ends.

Layout: ranks are grouped into tensor-parallel groups of ``tp_size`` consecutive ranks (the layout
DeepSpeed AutoTP builds; :func:`check_parallel_layout` compares it with DeepSpeed's own groups once the
engine exists). Data is sharded over data-parallel ranks only: every rank of one tensor-parallel group
reads the same batch. Sequence parallelism (``sp_size`` > 1, DeepSpeed Ulysses) groups ``sp_size``
consecutive ranks the same way: they read the same batch and each keeps its :class:`SequenceSlice`.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ntil_ds.typed_config import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    local_world_size: int = 1  # the ranks on this node
    sp_size: int = 1  # parallel.sequence_parallel_size: ranks that split one batch's sequences

    def __post_init__(self) -> None:
        if self.world_size % self.tp_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by the tensor-parallel size "
                f"{self.tp_size} (tensor_parallel.autotp_size in the DeepSpeed JSON)"
            )
        if self.sp_size > 1 and self.tp_size > 1:
            raise ConfigError(
                f"parallel.sequence_parallel_size={self.sp_size} with tensor_parallel.autotp_size="
                f"{self.tp_size}: ntil-ds runs one of the two at a time; drop autotp_size from the DeepSpeed "
                "JSON (ZeRO-3 already shards the weights) or set parallel.sequence_parallel_size=1"
            )
        if self.world_size % self.sp_size:
            raise ConfigError(
                f"world size {self.world_size} is not divisible by parallel.sequence_parallel_size="
                f"{self.sp_size}: launch a multiple of {self.sp_size} processes or change the size"
            )

    @classmethod
    def from_env(cls, tp_size: int = 1, sp_size: int = 1) -> DistInfo:
        """Read the variables torchrun, the deepspeed launcher and srun-started torchrun set."""
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            tp_size=tp_size,
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            sp_size=sp_size,
        )

    @property
    def dp_size(self) -> int:
        """Ranks that read different batches: the world over tensor- and sequence-parallel groups."""
        return self.world_size // (self.tp_size * self.sp_size)

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.sp_size)

    @property
    def sp_rank(self) -> int:
        """This rank's place in its sequence-parallel group (consecutive ranks, as DeepSpeed builds it)."""
        return self.rank % self.sp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, tracks and prints; every rank still takes part in every collective."""
        return self.rank == 0

    def expected_tp_group(self) -> list[int]:
        """The global ranks of this rank's tensor-parallel group (consecutive ranks)."""
        start = self.rank - self.tp_rank
        return list(range(start, start + self.tp_size))

    def expected_dp_group(self) -> list[int]:
        """The global ranks of this rank's data-parallel group (same tp_rank, one per TP group)."""
        return list(range(self.tp_rank, self.world_size, self.tp_size))


@dataclass(frozen=True)
class SequenceSlice:
    """This rank's part of a micro-batch split on the sequence dimension: positions ``[rank * L,
    (rank + 1) * L)`` of rows padded from ``length`` to ``padded_length = size * L`` tokens."""

    rank: int
    size: int
    length: int  # the collated rows' length
    padded_length: int  # the smallest multiple of size >= length

    @classmethod
    def of(cls, length: int, rank: int, size: int) -> SequenceSlice:
        return cls(rank=rank, size=size, length=length, padded_length=-(-length // size) * size)

    @property
    def local_length(self) -> int:
        return self.padded_length // self.size

    @property
    def start(self) -> int:
        return self.rank * self.local_length

    @property
    def stop(self) -> int:
        return self.start + self.local_length

    def part(self, full: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """This slice's positions of ``full [B, length, ...]``, the rows padded with ``fill``."""
        pad = full.new_full((full.shape[0], self.padded_length - self.length, *full.shape[2:]), fill)
        return torch.cat([full, pad], dim=1)[:, self.start : self.stop]


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


def check_sequence_layout(info: DistInfo, sequence_group: Sequence[int]) -> None:
    """Raise unless DeepSpeed's sequence-parallel group (global ranks) is the ``sp_size`` consecutive
    ranks the sampler gives the same batch (``dp_rank = rank // sp_size``)."""
    start = info.dp_rank * info.sp_size
    expected = list(range(start, start + info.sp_size))
    if list(sequence_group) != expected:
        raise RuntimeError(
            f"rank {info.rank}: DeepSpeed's sequence-parallel group is {list(sequence_group)}, but ntil-ds "
            f"gives one batch to consecutive ranks {expected}: pin the tested deepspeed (constraints/cpu.txt)"
        )


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous of processes started here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables a launcher sets, for a process started without one (``python launch/train.py``,
    as when debugging): a job of one process on this machine. Empty when a launcher set them."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return {}
    port = free_port()
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


# ----------------------------------------------------------------------------------------------------
# Collectives


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


_host_group: list[Any] = []  # [the group] once made


def make_host_group() -> None:
    """COLLECTIVE, once, right after the process group starts (``engine.init_distributed``): the group
    for values the host already knows (counts, flags). With NCCL that is a gloo group of the same ranks,
    so reducing a host value never waits for the device; with gloo it is the default group."""
    if not _grouped() or _host_group:
        return
    _host_group.append(None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))


def _host_group_or_default() -> Any:
    return _host_group[0] if _host_group else None


def barrier() -> None:
    """COLLECTIVE: return when every rank has arrived."""
    if _grouped():
        dist.barrier()


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """COLLECTIVE over ``group`` (default: all ranks; hence also a barrier): every rank's picklable
    ``obj``, in rank order."""
    if not _grouped():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def all_gather_tensors(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """COLLECTIVE over ``group``: every rank's ``tensor`` (same shape on every rank), in rank order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def broadcast_from_main(obj: Any) -> Any:
    """COLLECTIVE: rank 0's picklable ``obj`` on every rank (what other ranks pass is ignored)."""
    if not _grouped() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sums(
    values: Mapping[str, torch.Tensor | float], device: torch.device
) -> dict[str, torch.Tensor]:
    """COLLECTIVE: the sum over all ranks of each named value, in ONE all-reduce.

    Every rank must pass the same names with the same shapes. The values are float64 on ``device``
    (float64: sums of token counts and losses stay exact far beyond what a step holds) and are NOT read
    to the host: reading them is a sync point the caller chooses. Returns a dict with the same keys,
    each value its own shape (a 0-dim tensor for a scalar).
    """
    names = sorted(values)  # every rank concatenates in the same order, whatever its dict's order
    parts = [
        torch.as_tensor(values[name], dtype=torch.float64).to(device, non_blocking=True) for name in names
    ]
    flat = torch.cat([part.reshape(-1) for part in parts]) if parts else torch.zeros(0, dtype=torch.float64)
    if _grouped():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out, start = {}, 0
    for name, part in zip(names, parts, strict=True):
        out[name] = flat[start : start + part.numel()].view(part.shape)
        start += part.numel()
    return out


def read_to_host(values: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Named device values on the host, in ONE device-to-host copy: a sync point (the CPU waits for
    every kernel queued so far). A 0-dim value becomes a float, any other a list of floats."""
    names = sorted(values)
    if not names:
        return {}
    # One device for the one copy: a value elsewhere (a CPU scalar among CUDA ones) is moved to the first's
    # device rather than failing the concatenation.
    device = values[names[0]].device
    flat = torch.cat([values[name].detach().reshape(-1).double().to(device) for name in names]).cpu().tolist()
    out, start = {}, 0
    for name in names:
        size = values[name].numel()
        out[name] = flat[start] if values[name].dim() == 0 else flat[start : start + size]
        start += size
    return out


def all_reduce_host_sums(values: Mapping[str, float]) -> dict[str, float]:
    """COLLECTIVE: the sum over all ranks of each named host value (counts, flags), in one all-reduce on
    the host group (:func:`make_host_group`): no device is involved, so nothing waits for one."""
    names = sorted(values)
    flat = torch.tensor([float(values[name]) for name in names], dtype=torch.float64)
    if _grouped():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=_host_group_or_default())
    return dict(zip(names, flat.tolist(), strict=True))


def any_rank(flag: bool) -> bool:
    """COLLECTIVE: True on every rank when ``flag`` is True on any rank (on the host group)."""
    return all_reduce_host_sums({"flag": 1.0 if flag else 0.0})["flag"] > 0


def leave_process_group() -> None:
    """COLLECTIVE, at the end of a job: every rank waits for the others, then leaves the process group.

    After it no collective of one rank can still be in flight while another is gone, and ranks finish on
    their own (rank 0 delivering tracking records) with no group held open.
    """
    if _grouped():
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# A lost peer (a dead node, a cut link): a collective that fails, or never completes until the process
# group's timeout (engine.init_distributed sets collective_timeout for every group).

COLLECTIVE_TIMEOUT_ENV = "NTIL_COLLECTIVE_TIMEOUT_S"


def collective_timeout(environ: Mapping[str, str]) -> timedelta:
    """How long a rank waits in a collective for a peer: ``NTIL_COLLECTIVE_TIMEOUT_S`` seconds where a
    minute is too coarse (a job that should fail fast on a lost node; the test cluster), else DeepSpeed's
    ``DEEPSPEED_TIMEOUT`` whole minutes, default 10, read as deepspeed.constants reads it (slurm/train.sh
    sets 10). Checked with the recipe (ds_config.resolve_run): a bad value fails at start."""
    value = environ.get(COLLECTIVE_TIMEOUT_ENV, "").strip()
    if not value:
        return timedelta(minutes=int(environ.get("DEEPSPEED_TIMEOUT", "10")))
    seconds = int(value) if value.isdigit() else 0
    if seconds <= 0:
        raise ConfigError(
            f"{COLLECTIVE_TIMEOUT_ENV}={value!r}: expected a whole number of seconds > 0 (how long a rank "
            "waits in a collective for a peer), or unset it to use DEEPSPEED_TIMEOUT (minutes)"
        )
    return timedelta(seconds=seconds)


# How long rank 0 waits for the other ranks to answer after a collective timed out (unanswering_ranks).
PEER_CHECK_TIMEOUT = timedelta(seconds=20)
_peer_check_group: list[Any] = []  # [the group] once made (make_peer_check_group)


def is_communication_error(error: BaseException) -> bool:
    """A collective failed: a peer died (connection closed) or did not answer within the process-group
    timeout. NCCL raises DistError; gloo plain RuntimeErrors, known by their text."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        marker in text for marker in ("gloo/transport", "pair closure", "by peer")
    )


def is_timeout(error: BaseException) -> bool:
    """A collective gave up waiting ("Timed out waiting 600000ms for recv", or "Application timeout caused
    pair closure" on a rank whose group another rank's timeout closed): unlike a closed connection
    ("Connection reset by peer [10.1.2.3]:port") it does not say which peer was lost."""
    return re.search(r"timed? ?out", str(error), flags=re.IGNORECASE) is not None


def make_peer_check_group() -> None:
    """COLLECTIVE, once, right after the process group starts (``engine.init_distributed``): a gloo group
    kept only for :func:`unanswering_ranks`.

    A collective that timed out closes its group's connections ("Application timeout caused pair
    closure"), so the roll call needs a group of its own whose connections were made while all was well.
    """
    if _grouped() and not _peer_check_group:
        _peer_check_group.append(dist.new_group(backend="gloo"))


def unanswering_ranks(timeout: timedelta = PEER_CHECK_TIMEOUT) -> str:
    """COLLECTIVE (on the peer-check group), after a failed collective: on rank 0, the ranks that do
    not answer within ``timeout``, in one line; on the others, whether rank 0 was reached.

    A roll call: each rank sends rank 0 one number; rank 0 waits for all of them until ``timeout`` has
    passed. The ranks still alive get there within moments of each other, as their collectives all waited
    for the same lost peer with the same timeout. (torch's monitored_barrier does the same but keeps
    every rank waiting for rank 0's answer, and waits ``timeout`` per missing rank to name them all.)
    """
    if not _peer_check_group or not _grouped():
        return "not checked (no peer-check group: engine.init_distributed makes it)"
    group = _peer_check_group[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        try:  # a blocking send to an unreachable rank 0 would wait the whole process-group timeout
            dist.isend(torch.zeros(1), dst=0, group=group).wait(timeout)
        except RuntimeError:
            return f"could not reach rank 0 within {timeout.total_seconds():.0f} s"
        return "answered rank 0's roll call (rank 0 names the ranks that did not)"
    deadline = time.monotonic() + timeout.total_seconds()
    calls, missing = {}, []
    for peer in range(1, world):
        try:  # a peer that crashed closed its connection: posting the receive already fails
            calls[peer] = dist.irecv(torch.zeros(1), src=peer, group=group)
        except RuntimeError:
            missing.append(peer)
    for peer, call in calls.items():
        try:
            call.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
        except RuntimeError:
            missing.append(peer)
    missing.sort()
    if not missing:
        return "every rank answered"
    return f"ranks {', '.join(map(str, missing))} of {world} did not answer within {timeout.total_seconds():.0f} s"


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
