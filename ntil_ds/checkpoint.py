"""Checkpoints a job can resume from (the Hugging Face folder people load afterwards: ntil_ds/export.py).

Layout under ``<output_dir>/checkpoints/step_00000030/``:

- DeepSpeed's files (every rank's ZeRO partition of weights and optimizer state, the LR schedule);
  LoRA on pretrained weights leaves the frozen base out (:func:`saves_frozen_weights`);
- ``rng_rank{r}.pt``: each rank's random-number states (python, numpy, torch, cuda);
- ``trainer_state.json``: step, data position, tracker run id (written by rank 0);
- ``config.yaml``: the resolved config of the run that wrote it (a resume with a different recipe is an
  error, see :func:`check_resume_config`);
- ``COMPLETE``: written last, by rank 0, after every rank has finished writing: a JSON manifest of every
  other file of the folder and its size. A folder without it is a checkpoint a dying job left
  half-written; a folder whose files do not match it (a file truncated or lost after the save) is
  damaged. :func:`find_resume_checkpoint` picks neither: it warns and takes the previous complete one.

Resume is decided once, by rank 0 (:func:`agree_on_resume_checkpoint`), and every rank loads that step:
ranks listing a network file system themselves could see different folders.
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

from ntil_ds.config import Config, ConfigError, flatten, load_config, save_config
from ntil_ds.dist import DistInfo, all_gather_objects, barrier, broadcast_from_main
from ntil_ds.engine import TrainingEngine

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
_TAG_PREFIX = "step_"

# Config keys a resumed run may change: they say how long to train, how often to report and save, and
# where to report; none changes what a step computes. Anything else differing from the checkpoint's
# config is an error (resume=force overrides). A key ending in "." covers a whole section.
RESUMABLE_CHANGES = (
    "output_dir",  # the folder may have been moved or copied
    "resume",
    "train.max_steps",  # extend a run (the cosine schedule is stretched to the new end)
    "train.log_every",
    "train.eval_every",
    "train.save_every",
    "train.keep_last",
    "train.export_at_end",
    "data.eval_file",
    "data.num_workers",
    "data.cache",  # the cache holds exactly the samples an uncached start encodes
    "data.cache_dir",
    "data.encode_workers",  # a parallel build writes the same cache byte for byte
    "model.attn_implementation",  # the same attention on other hardware (sdpa <-> flash-attn)
    "model.experts_implementation",  # the same experts' function, looped or batched (per device)
    "model.kernels",  # fused kernels compute the same functions
    "loss.kernel",  # the same loss through the Triton kernel or the torch tiles
    "loss.number_stage",  # the same number stage, compiled or eager
    "loss.logits",  # the head at the labelled rows or everywhere: the same loss and gradients
    "tracking.",
    "eval.",  # what is evaluated and how often; not what a step computes
)


class CheckpointWriteError(OSError):
    """This rank could not write its part of a checkpoint (a full disk, a lost mount)."""


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
    """Checkpoint folders marked complete, oldest first (by step); see :func:`checkpoint_damage`."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(_TAG_PREFIX) and (p / COMPLETE_MARKER).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[len(_TAG_PREFIX) :]))


def checkpoint_damage(path: Path) -> str | None:
    """What is wrong with a checkpoint folder marked complete, or None if every file of its manifest
    is there with its size (a file cut short or lost after the save, a marker of an older format)."""
    try:
        manifest = json.loads((path / COMPLETE_MARKER).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its {COMPLETE_MARKER} marker is not a manifest of its files"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    return None


def find_resume_checkpoint(resume: str, output_dir: str | Path) -> Path | None:
    """``resume``: "auto"/"force" (the newest intact checkpoint of output_dir, or None), "none", or a
    folder. A damaged newest checkpoint is passed over with a warning naming it and what is wrong.

    Call on one rank only (:func:`agree_on_resume_checkpoint`): listings of a network file system may
    differ between nodes.
    """
    if resume == "none":
        return None
    if resume in ("auto", "force"):
        for path in reversed(complete_checkpoints(output_dir)):
            damage = checkpoint_damage(path)
            if damage is None:
                return path
            log.warning(
                "checkpoint %s is damaged (%s): not resuming from it; trying the one before", path, damage
            )
        return None
    path = Path(resume)
    if not (path / COMPLETE_MARKER).is_file():
        raise ConfigError(
            f"resume={resume}: not a complete checkpoint (no {COMPLETE_MARKER} marker inside); give a "
            f"folder like {checkpoints_root(output_dir) / checkpoint_tag(100)}, resume=auto or resume=none"
        )
    damage = checkpoint_damage(path)
    if damage is not None:
        raise ConfigError(
            f"resume={resume}: the checkpoint is damaged ({damage}); give an intact one or resume=auto"
        )
    return path


def agree_on_resume_checkpoint(resume: str, output_dir: str | Path, dist_info: DistInfo) -> Path | None:
    """COLLECTIVE: rank 0 chooses the checkpoint (:func:`find_resume_checkpoint`), every rank gets it.

    A ConfigError on rank 0 (a bad resume= folder) is raised on every rank.
    """
    choice: str | ConfigError | None = None
    if dist_info.is_main:
        try:
            found = find_resume_checkpoint(resume, output_dir)
            choice = str(found) if found is not None else None
        except ConfigError as e:
            choice = e
    choice = broadcast_from_main(choice)
    if isinstance(choice, ConfigError):
        raise choice
    return Path(choice) if choice is not None else None


def check_resume_config(checkpoint: Path, cfg: Config) -> None:
    """Raise ConfigError if ``cfg`` differs from the config the checkpoint was trained with in a key
    outside :data:`RESUMABLE_CHANGES` (``resume=force``: warn instead)."""
    saved_file = checkpoint / CONFIG_FILE
    if not saved_file.is_file():
        log.warning(
            "%s has no %s (written by an older ntil-ds): the config cannot be compared",
            checkpoint,
            CONFIG_FILE,
        )
        return
    saved, current = flatten(load_config(saved_file)), flatten(cfg)
    differing = {
        key: (saved.get(key), current.get(key))
        for key in sorted(saved.keys() | current.keys())
        if saved.get(key) != current.get(key)
        and not any(
            key == allowed or (allowed.endswith(".") and key.startswith(allowed))
            for allowed in RESUMABLE_CHANGES
        )
    }
    if not differing:
        return
    listing = "\n".join(
        f"  {key}: {old!r} in the checkpoint, {new!r} now" for key, (old, new) in differing.items()
    )
    if cfg.resume == "force":
        log.warning(
            "resume=force: resuming %s with a config that differs from its own:\n%s", checkpoint, listing
        )
        return
    raise ConfigError(
        f"output_dir={cfg.output_dir} holds checkpoint {checkpoint.name} of a run with another config; "
        f"resuming would continue that run's weights under this recipe:\n{listing}\n"
        "Train in a new output_dir (output_dir=...), start over with resume=none (its checkpoints are then "
        "overwritten), or continue it anyway with resume=force. Keys that may change on resume: "
        + ", ".join(RESUMABLE_CHANGES)
    )


def saves_frozen_weights(cfg: Config) -> bool:
    """Whether checkpoints hold the frozen weights too.

    Not for LoRA on pretrained weights: the frozen base is read again from ``model.name_or_path`` when the
    job resumes (the resume check keeps that path), so a checkpoint holds what trains (adapters,
    ``lora.modules_to_save``, their optimizer state): megabytes instead of a copy of the model per save.
    A random base (``model.init=random``) exists nowhere else, and full fine-tuning keeps DeepSpeed's
    complete checkpoints (``zero_to_fp32`` rebuilds the whole model from them).
    """
    return not (cfg.lora.enabled and cfg.model.init == "pretrained")


def save_checkpoint(
    engine: TrainingEngine, cfg: Config, state: TrainerState, dist_info: DistInfo, keep_last: int
) -> Path:
    """COLLECTIVE: every rank writes its part; rank 0 marks the folder complete, then prunes old ones.

    A rank that cannot write (a full disk) raises: the folder is never marked complete and the older
    checkpoints are untouched, so resume=auto uses the newest of those.
    """
    root = checkpoints_root(cfg.output_dir)
    tag = checkpoint_tag(state.step)
    path = root / tag
    if dist_info.is_main and path.exists():
        # A leftover of a job that died while writing this very step: start it over.
        shutil.rmtree(path)
    barrier()
    try:
        engine.save_checkpoint(
            root, tag, client_state={"trainer_state": asdict(state)}, with_frozen=saves_frozen_weights(cfg)
        )
        torch.save(_rng_states(), path / f"rng_rank{dist_info.rank}.pt")
        if dist_info.is_main:
            (path / TRAINER_STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n")
            save_config(cfg, path / CONFIG_FILE)
    except OSError as e:
        intact = [p.name for p in complete_checkpoints(cfg.output_dir) if p != path]
        raise CheckpointWriteError(
            e.errno,
            f"rank {dist_info.rank} could not write its part of checkpoint {path} ({e}). That folder is "
            "not marked complete and will never be resumed from; "
            + (
                f"the newest complete checkpoint, {intact[-1]}, is untouched and resume=auto continues from it"
                if intact
                else "there is no earlier complete checkpoint"
            )
            + ". Free space (or fix the mount) and start the job again.",
        ) from e
    # Every rank's files must be on disk before the folder is called complete. Each rank reports the
    # sizes it sees (a rank sees its own files exactly, even where a network file system shows others'
    # late); files only grow while written, so the manifest takes the largest size seen.
    listings = all_gather_objects(_file_sizes(path))
    if dist_info.is_main:
        files: dict[str, int] = {}
        for listing in listings:
            for name, size in listing.items():
                files[name] = max(size, files.get(name, 0))
        manifest = {"step": state.step, "files": dict(sorted(files.items()))}
        _write_atomically(path / COMPLETE_MARKER, json.dumps(manifest, indent=1) + "\n")
        for old in complete_checkpoints(cfg.output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s saved", path)
    barrier()
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


class Checkpointer:
    """When the loop saves: every ``train.save_every`` steps, and at the end (or on preemption) unless the
    last step was just saved or loaded."""

    def __init__(self, engine: TrainingEngine, cfg: Config, dist_info: DistInfo, *, loaded_step: int | None):
        self.engine, self.cfg, self.dist = engine, cfg, dist_info
        self.saved_at = loaded_step if loaded_step is not None else -1  # no need to save what was loaded

    def maybe_save(self, state: TrainerState) -> None:
        """COLLECTIVE: save if the recipe's cadence asks for it after this step."""
        every = self.cfg.train.save_every
        if every and state.step % every == 0:
            self.save(state)

    def save_final(self, state: TrainerState) -> None:
        """COLLECTIVE: save unless this very step is saved already (resume continues exactly here)."""
        if self.saved_at != state.step:
            self.save(state)

    def save(self, state: TrainerState) -> None:
        save_checkpoint(self.engine, self.cfg, state, self.dist, self.cfg.train.keep_last)
        self.saved_at = state.step


# ----------------------------------------------------------------------------------------------------


def _file_sizes(folder: Path) -> dict[str, int]:
    return {str(f.relative_to(folder)): f.stat().st_size for f in folder.rglob("*") if f.is_file()}


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
