"""Checkpoints a job can resume from, and the Hugging Face folder people load afterwards.

Layout under ``<output_dir>/checkpoints/step_00000030/``:

- DeepSpeed's files (every rank's ZeRO partition of weights and optimizer state, the LR schedule);
- ``rng_rank{r}.pt``: each rank's random-number states (python, numpy, torch, cuda);
- ``trainer_state.json``: step, data position, tracker run id (written by rank 0);
- ``COMPLETE``: written last, by rank 0, after every rank has finished writing. A folder without it is
  a checkpoint a dying job left half-written: :func:`find_resume_checkpoint` never picks it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ntil_ds.config import ConfigError
from ntil_ds.dist import DistInfo
from ntil_ds.engine import TrainingEngine

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.json"
_TAG_PREFIX = "step_"


@dataclass
class TrainerState:
    """What the loop needs besides weights and optimizer to continue exactly where it stopped."""

    step: int  # optimizer steps completed
    sampler: dict[str, Any] = field(default_factory=dict)  # ResumableDistributedSampler.state_dict()
    tracker_run_id: str | None = None


def checkpoint_tag(step: int) -> str:
    return f"{_TAG_PREFIX}{step:08d}"


def checkpoints_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders, oldest first (by step)."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_TAG_PREFIX) and (p / COMPLETE_MARKER).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_TAG_PREFIX) :]))


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """``resume``: "auto" (newest complete checkpoint of output_dir, or None), "none", or a folder."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / COMPLETE_MARKER).is_file():
        raise ConfigError(
            f"resume={resume}: not a complete checkpoint (no {COMPLETE_MARKER} marker inside); give a "
            f"folder like {checkpoints_root(output_dir) / checkpoint_tag(100)}, resume=auto or resume=none"
        )
    return path


def save_checkpoint(
    engine: TrainingEngine, output_dir: str | Path, state: TrainerState, dist_info: DistInfo, keep_last: int
) -> Path:
    """COLLECTIVE: every rank writes its part; rank 0 marks the folder complete, then prunes old ones."""
    root = checkpoints_root(output_dir)
    tag = checkpoint_tag(state.step)
    path = root / tag
    if dist_info.is_main and path.exists():
        # A leftover of a job that died while writing this very step: start it over.
        shutil.rmtree(path)
    _barrier()
    engine.save_checkpoint(root, tag, client_state={"trainer_state": asdict(state)})
    torch.save(_rng_states(), path / f"rng_rank{dist_info.rank}.pt")
    if dist_info.is_main:
        (path / TRAINER_STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
    # Every rank's files must be on disk before the folder is called complete.
    _barrier()
    if dist_info.is_main:
        _write_atomically(path / COMPLETE_MARKER, f"step {state.step}\n")
        for old in complete_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s saved", path)
    _barrier()
    return path


def load_checkpoint(engine: TrainingEngine, path: str | Path, dist_info: DistInfo) -> TrainerState:
    """COLLECTIVE: restore weights, optimizer, schedule, this rank's RNG states; return the loop state."""
    path = Path(path)
    engine.load_checkpoint(path.parent, path.name)
    rng_file = path / f"rng_rank{dist_info.rank}.pt"
    if rng_file.is_file():
        _set_rng_states(torch.load(rng_file, weights_only=False))
    else:
        log.warning("%s has no RNG state for rank %d (different world size?)", path, dist_info.rank)
    state = TrainerState(**json.loads((path / TRAINER_STATE_FILE).read_text()))
    log.info("resumed from %s (step %d)", path, state.step)
    return state


def export_hf_folder(engine: TrainingEngine, processor: Any, out_dir: str | Path, is_main: bool) -> Path:
    """COLLECTIVE: a Hugging Face folder (safetensors weights + config + processor) that loads with plain
    ``from_pretrained``, no DeepSpeed needed. Weights are gathered from every rank's ZeRO partition."""
    out_dir = Path(out_dir)
    state_dict = engine.consolidated_state_dict()  # every rank must call it; rank 0 gets the weights
    if is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        model = engine.module
        # transformers 5.x records, at from_pretrained, how checkpoint names were renamed and reverts that
        # on save. After a ZeRO-3 (zero.Init) load the record makes Qwen2-VL save "model.model.layers.*"
        # instead of the hub's "model.layers.*" (transformers reloads both; other tools do not). Without
        # the record, save_pretrained uses the model family's default mapping: the hub's names.
        recorded = model.__dict__.pop("_weight_conversions", None)
        try:
            model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        finally:
            if recorded is not None:
                model._weight_conversions = recorded
        processor.save_pretrained(out_dir)
        log.info("exported a Hugging Face folder to %s", out_dir)
    _barrier()
    return out_dir


# ----------------------------------------------------------------------------------------------------


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
