"""DeepSpeed, in one place: init, backward/step, checkpoints, the consolidated weights.

This is the only module that imports ``deepspeed``. What DeepSpeed is told (the recipe merged into the
DeepSpeed JSON) is decided before, without it, in :mod:`ntil_ds.ds_config`.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups as deepspeed_groups
from deepspeed.utils import set_z3_leaf_modules

from ntil_ds.config import Config, ConfigError
from ntil_ds.dist import (
    DistInfo,
    any_rank,
    check_parallel_layout,
    check_sequence_layout,
    collective_timeout,
    launcher_env_defaults,
    make_host_group,
    make_peer_check_group,
)
from ntil_ds.ds_config import optimizer_build_problem
from ntil_ds.model.parts import expert_modules, num_experts
from ntil_ds.model.sequence_parallel import route_attention

logger = logging.getLogger(__name__)


def lr_ratio(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Factor on optim.lr for optimizer step ``step`` (0-based): linear warmup, then cosine to the floor.

    Warmup reaches the full lr at its last step; cosine starts at the full lr right after warmup and
    would reach ``min_lr_ratio`` at step ``max_steps`` (the one after the last).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------------
# Process group


def init_distributed() -> None:
    """Join the process group the launcher set up; without a launcher, a group of one. Idempotent.

    The backend is DeepSpeed's accelerator's (nccl on CUDA, gloo on CPU), which honours DS_ACCELERATOR:
    ``DS_ACCELERATOR=cpu`` on a GPU node trains on the CPU with gloo, as DeepSpeed itself does.
    """
    # Without torchrun/deepspeed (python launch/train.py) DeepSpeed would try MPI discovery (mpi4py).
    os.environ.update(launcher_env_defaults(os.environ))
    # One timeout for every collective (collective_timeout) bounds how long a rank waits for a lost peer.
    # torch gives the groups made later (the host and peer-check groups below, DeepSpeed's ZeRO and
    # tensor-parallel groups) its own default instead (30 min on gloo, 10 on NCCL), so its defaults are
    # set to the same value.
    timeout = collective_timeout(os.environ)
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.distributed_c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), timeout=timeout)
    # Every rank, at the same point (both are collectives):
    make_host_group()  # counts and flags are reduced without the device
    make_peer_check_group()  # to name the ranks a timed-out collective waited for (launch/train.py)
    # Only now: the collectives above returned on every rank, so every rank has mapped every workspace.
    unlinked = unlink_cpu_allreduce_workspace(os.environ, dist.get_rank())
    if unlinked is not None and dist.get_rank() == 0:
        logger.info("DeepSpeed's CPU allreduce workspaces unlinked (freed when the job ends): %s", unlinked)


def unlink_cpu_allreduce_workspace(environ: Mapping[str, str], rank: int) -> Path | None:
    """Unlink this rank's workspace of DeepSpeed's CPU allreduce, if it made one; the path, or None.

    On CPU, when all ranks are on one host (the deepspeed launcher's LOCAL_SIZE equals the world size),
    DeepSpeed 0.19 puts a 64 MiB workspace per rank in POSIX shared memory and never unlinks it (its
    shared_close is never called): every CPU job left 64 MiB per rank of RAM behind until reboot (240
    of them held 16 GB of this 24 GB machine). The ranks only need the name to map each other's
    workspace at init; unlinked after that, the memory is freed when the last rank holding it exits,
    crashed or not.
    """
    if get_accelerator().device_name() != "cpu":
        return None
    path = cpu_allreduce_workspace_path(environ, rank)
    try:
        path.unlink()
    except FileNotFoundError:  # not made: ranks on several hosts, or another launcher (no LOCAL_SIZE)
        return None
    return path


def unlink_cpu_allreduce_workspace_of_started_group() -> Path | None:
    """:func:`unlink_cpu_allreduce_workspace` for a process group that someone else started (the Hugging Face
    Trainer, through accelerate): COLLECTIVE where there is a workspace, so every rank must call it.

    A rank may only unlink its workspace once every rank has mapped it, that is once every rank has
    returned from DeepSpeed's init: the barrier says so. Whether there is one is the same on every rank
    (DeepSpeed makes one per rank or none), so the ranks agree on whether to take the barrier.
    """
    if not dist.is_initialized() or get_accelerator().device_name() != "cpu":
        return None
    path = cpu_allreduce_workspace_path(os.environ, dist.get_rank())
    if not path.exists():
        return None
    dist.barrier()
    path.unlink()
    return path


def cpu_allreduce_workspace_path(environ: Mapping[str, str], rank: int) -> Path:
    """Where DeepSpeed's CPU allreduce puts this rank's workspace: the name shm.cpp's shm_initialize gives
    it, under /dev/shm where glibc's shm_open puts it."""
    master = f"{environ.get('MASTER_ADDR', '')}_{environ.get('MASTER_PORT', '')}"
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{master}_{rank}"


def device_for(local_rank: int) -> torch.device:
    """This rank's device, from DeepSpeed's accelerator (so it agrees with the engine and the backend)."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    accelerator.set_device(local_rank)
    return torch.device(accelerator.device_name(local_rank))


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this rank so far: allocated device memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def set_expert_leaf_modules(model: torch.nn.Module) -> list[type]:
    """Under ZeRO-3, mark a mixture-of-experts model's expert modules as DeepSpeed leaf modules (their
    parameters gathered whole when the module is entered, no hooks below it), so ranks whose tokens route
    to different experts issue the same gathers; the classes marked (none for a dense model).

    The classes come from the loaded model itself (:func:`~ntil_ds.model.parts.expert_modules`), not
    from a hand list per architecture: DeepSpeed's own ``leaf_module`` defaults cover a few text models
    only and a list that matches nothing only logs a warning. A model whose config has experts but none
    was found is refused here, at start.
    """
    modules = expert_modules(model)
    if num_experts(model.config) and not modules:
        raise ConfigError(
            f"{type(model).__name__} is a mixture of experts ({num_experts(model.config)} experts) but no "
            "module holds 3-D expert weights [num_experts, out, in]: its experts cannot be made ZeRO-3 "
            "leaf modules, and ranks routing to different experts could hang; train it with ZeRO-2 "
            "(deepspeed=configs/deepspeed/zero2.json)"
        )
    classes = sorted({type(m) for m in modules}, key=lambda c: c.__qualname__)
    if classes:
        set_z3_leaf_modules(model, classes)
        logger.info("ZeRO-3 leaf modules: %s", ", ".join(c.__qualname__ for c in classes))
    return classes


def register_sequence_parallel(model: torch.nn.Module, cfg: Config, ds_config: dict[str, Any]) -> Any | None:
    """With ``parallel.sequence_parallel_size`` > 1: DeepSpeed's Ulysses attention put in place of the
    model's attention function (its own Hugging Face integration, ``UlyssesSPAttentionHF``) and its
    groups of consecutive ranks made (a COLLECTIVE); the ``mpu`` for ``deepspeed.initialize``, which then
    shards ZeRO over, and averages gradients across, the data- and sequence-parallel ranks together
    (the model was checked against the size at the trainer's start: check_sequence_parallel_at_start).
    None when off. Teacher-forced evaluation runs sliced rows through it too; generation (whole rows,
    split over the group's ranks) and a vision tower attend as on one process (``route_attention``)."""
    size = cfg.parallel.sequence_parallel_size
    if size == 1:
        return None
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage") == 3 and zero.get("reduce_scatter", True) is False:
        raise ConfigError(
            f"parallel.sequence_parallel_size={size} with zero_optimization.reduce_scatter=false in "
            f"{cfg.deepspeed}: DeepSpeed 0.19.8's ZeRO-3 then scales the gradient of sequence-parallel ranks "
            "by bucket size (see TrainingEngine.gradient_average_size); remove reduce_scatter from the JSON"
        )
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = model.config._attn_implementation
    if dist.get_rank() == 0:
        logger.info("Ulysses sequence parallelism: %d ranks a group, around %s attention", size, attention)
    whole_rows_attention = ALL_ATTENTION_FUNCTIONS[attention]
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=attention,
        sequence_parallel_size=size,
        micro_batch_size=cfg.train.micro_batch_size,
        seq_length_is_variable=True,  # rows are padded per micro-batch, not to one length
        disable_in_eval=False,  # route_attention decides: sliced evaluation runs it, generation does not
    )
    route_attention(model, attention, whole_rows_attention)  # whole rows: vision tower, generation
    return mpu


# ----------------------------------------------------------------------------------------------------
# The engine


def _find_build_tool(name: str) -> str | None:
    """A build tool's path, nvcc also under torch's CUDA_HOME (where DeepSpeed's builders look)."""
    found = shutil.which(name)
    if found is None and name == "nvcc":
        from torch.utils.cpp_extension import CUDA_HOME

        candidate = Path(CUDA_HOME or "/nonexistent") / "bin" / "nvcc"
        found = str(candidate) if candidate.is_file() else None
    return found


def check_optimizer_build(ds_config: dict[str, Any]) -> None:
    """A ConfigError, with the fix, when `deepspeed.initialize` would have to JIT-compile the optimizer's
    op on this accelerator without the tools to (`ds_config.optimizer_build_problem`). Not on the CPU,
    where the project's runs use ops built once (TORCH_EXTENSIONS_DIR)."""
    if get_accelerator().device_name() == "cpu":
        return
    from deepspeed.git_version_info import installed_ops

    problem = optimizer_build_problem(ds_config, installed_ops, _find_build_tool)
    if problem:
        raise ConfigError(problem)


class TrainingEngine:
    """A thin wrapper over ``deepspeed.DeepSpeedEngine`` that speaks the trainer's language.

    ``backward`` does NOT divide by gradient_accumulation_steps (``scale_wrt_gas=False``): the trainer
    normalizes each micro-batch loss itself (see trainer.py for the full contract).
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, ds_config: dict[str, Any]) -> None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise ConfigError("no trainable parameters: check model.freeze_* in the recipe")
        optimizer = self._client_optimizer(cfg, trainable)
        optim = cfg.optim

        def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
            return torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                lambda step: lr_ratio(
                    step,
                    warmup_steps=optim.warmup_steps,
                    max_steps=cfg.train.max_steps,
                    min_lr_ratio=optim.min_lr_ratio,
                ),
            )

        check_optimizer_build(ds_config)  # the trainer checks before building the model; others here
        if ds_config.get("zero_optimization", {}).get("stage") == 3:
            set_expert_leaf_modules(model)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=trainable,
            optimizer=optimizer,
            lr_scheduler=schedule,
            config=ds_config,
            mpu=register_sequence_parallel(model, cfg, ds_config),
        )

    @staticmethod
    def _client_optimizer(cfg: Config, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer | None:
        if cfg.optim.name != "adamw_8bit":
            return None  # DeepSpeed builds it from the merged config's "optimizer" block
        import bitsandbytes as bnb  # optional dependency: only this optimizer needs it

        o = cfg.optim
        return bnb.optim.AdamW8bit(
            params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )

    # -- the step -------------------------------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        """The (ZeRO-partitioned, maybe AutoTP-sharded) model; call it through :meth:`forward`."""
        return self.engine.module

    def forward(self, **batch: Any) -> Any:
        return self.engine(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> None:
        """Called after every micro-batch; DeepSpeed steps the optimizer at the accumulation boundary."""
        self.engine.step()

    def set_accumulation_boundary(self, is_boundary: bool) -> None:
        """Before each micro-batch: whether its backward ends the optimizer step. The trainer says so
        explicitly because with sequence packing the forwards per step vary (DeepSpeed would count to
        its configured gradient_accumulation_steps)."""
        self.engine.set_gradient_accumulation_boundary(is_boundary)

    @property
    def refuses_non_finite_steps(self) -> bool:
        """Whether DeepSpeed itself skips an optimizer step whose gradients are not finite (its ZeRO and
        fp16 optimizers check the gradient norm in ``step()``, every rank alike): then
        :meth:`step_applied` tells the trainer, with no extra collective or host sync."""
        return hasattr(self.engine.optimizer, "overflow")

    def step_applied(self) -> bool:
        """After the boundary's :meth:`step`: whether it changed the weights (False: DeepSpeed found
        non-finite gradients and skipped it; the weights are those of the step before)."""
        return bool(self.engine.was_step_applied())

    def gradients_are_finite(self) -> bool:
        """COLLECTIVE (every rank), a host sync: are all gradients of the step finite? For an optimizer
        that does not check them itself (:attr:`refuses_non_finite_steps` False); call after the
        accumulation boundary's backward, before :meth:`step`."""
        local = any(
            not bool(torch.isfinite(p.grad).all())
            for p in self.engine.module.parameters()
            if p.grad is not None
        )
        return not any_rank(local)

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def check_layout(self, dist_info: DistInfo) -> None:
        """Raise unless DeepSpeed grouped the ranks as the data sharding assumes (see dist.py)."""
        if dist_info.tp_size == 1:
            tp_group, dp_group = [dist_info.rank], list(range(dist_info.world_size))
        else:
            tp_group = dist.get_process_group_ranks(deepspeed_groups.get_tensor_model_parallel_group())
            dp_group = dist.get_process_group_ranks(deepspeed_groups.get_data_parallel_group())
        check_parallel_layout(dist_info, tp_group, dp_group)
        if self.sequence_group is not None:
            check_sequence_layout(dist_info, dist.get_process_group_ranks(self.sequence_group))
        reducing = dist_info.dp_size * dist_info.sp_size
        if self.engine.seq_dp_world_size != reducing:
            raise RuntimeError(
                f"DeepSpeed reduces gradients over {self.engine.seq_dp_world_size} ranks but the job has "
                f"{reducing} (data- times sequence-parallel ranks): the trainer's loss normalization would "
                "be wrong"
            )

    @property
    def gradient_average_size(self) -> int:
        """What DeepSpeed divides the gradient summed over its ranks by (the trainer multiplies it back).

        Without sequence parallelism: the data-parallel ranks (world size / tensor-parallel size). With
        it, the ranks of a sequence-parallel group each hold the gradient of their own positions, summed
        over the ranks; DeepSpeed 0.19.8 then divides by the data-parallel ranks only on ZeRO 0-2 (it
        expects every rank of a group to have the group's mean loss), but by all the ranks on ZeRO-3's
        reduce-scatter path (``stage3.__avg_scatter_grads``; its other path, reduce_scatter=false, divides
        like ZeRO-2 for small buckets only, so :func:`register_sequence_parallel` refuses it). The
        sequence-parallel parity tests pin both (tests/distributed/test_sequence_parallel.py)."""
        size = self.engine.seq_dp_world_size
        if self.engine.sequence_parallel_size == 1 or self.engine.zero_optimization_stage() == 3:
            return size
        return size // self.engine.sequence_parallel_size

    @property
    def sequence_group(self) -> Any | None:
        """The ranks that split this rank's rows (parallel.sequence_parallel_size > 1), else None."""
        return self.engine.seq_parallel_group if self.engine.sequence_parallel_size > 1 else None

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def grad_norm(self) -> torch.Tensor:
        """Norm of the gradients of the last optimizer step, before clipping (NaN if unknown), as a 0-dim
        tensor on the engine's device: reading it is the caller's choice of sync point."""
        norm = self.engine.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            return norm.detach().reshape(()).to(self.engine.device)
        # ZeRO-1/2/3 leave a Python float (inf) on an overflow step, None when they skip the norm: made on
        # the engine's device, as the step's other values are, or `read_to_host` would mix devices on a GPU
        # exactly on the non-finite step whose report it exists for.
        value = float("nan") if norm is None else float(norm)
        return torch.tensor(value, dtype=torch.float64, device=self.engine.device)

    # -- checkpoints and export -------------------------------------------------------------------------

    def save_checkpoint(
        self, save_dir: str | Path, tag: str, client_state: dict[str, Any], with_frozen: bool = True
    ) -> None:
        """Collective: every rank writes its partition of weights and optimizer state (``with_frozen``:
        the frozen parameters too; without them, :meth:`load_checkpoint` keeps the loaded ones)."""
        self.engine.save_checkpoint(
            str(save_dir),
            tag=tag,
            client_state=client_state,
            save_latest=False,
            exclude_frozen_parameters=not with_frozen,
        )

    def load_checkpoint(self, load_dir: str | Path, tag: str) -> dict[str, Any]:
        """Collective. Returns the client state saved with the checkpoint.

        Strict except for frozen parameters: a checkpoint saved without them keeps the ones the model was
        loaded with; any other missing or unexpected weight is an error.
        """
        path, client_state = self.engine.load_checkpoint(
            str(load_dir),
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            custom_load_fn=_load_weights_but_frozen_may_be_missing,
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag!r} in {load_dir}")
        return client_state or {}

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the full (unpartitioned) weights in the training dtype; rank 0 gets them all."""
        if self.engine.zero_optimization_partition_weights():  # ZeRO-3: gather every rank's slice
            return self.engine._zero3_consolidated_16bit_state_dict()
        return self.engine.module.state_dict()  # ZeRO 0-2 keep whole weights on every rank


def _load_weights_but_frozen_may_be_missing(src: dict[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """DeepSpeed's module load (``custom_load_fn``), strict but for frozen parameters."""
    result = dst.load_state_dict(src, strict=False)
    frozen = {name for name, p in dst.named_parameters(remove_duplicate=False) if not p.requires_grad}
    missing = [name for name in result.missing_keys if name not in frozen]

    # A 4-bit weight's quantization state ("<weight>.absmax", "<weight>.quant_state.bitsandbytes__nf4")
    # is saved even when the frozen weight itself is left out; the loaded model has it already.
    def quantized_weight(key: str) -> str:
        return key.split(".quant_state.")[0] if ".quant_state." in key else key.rsplit(".", 1)[0]

    unexpected = [name for name in result.unexpected_keys if quantized_weight(name) not in frozen]
    if missing or unexpected:
        raise RuntimeError(
            "the checkpoint does not match the model: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)}), "
            f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)})"
        )
