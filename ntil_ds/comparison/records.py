"""What makes a comparison resumable: each job known by what it is, and a small record of each finished job.

- :func:`job_identity`: a job as the things that decide its result: the resolved recipe with the job's
  overrides (less where it writes and tracks), the content of its data, test or validation split and
  base model (sha256, not paths: a split copied elsewhere is the same, one drawn again at the same path
  is not), the loss spec, seed, lr, processes and threads. Its :func:`identity_key` names the job.
- A record (``<records>/<kind>/<label>-seed<seed>.json``, a few tens of KB): the job's key and identity,
  its result (status, metrics, wall times, the error of a failed job), the per-item predictions and
  references of the split it was scored on (what the seeds x items bootstrap needs), and the scores it
  logged while training (the curves). A grid started again reads the records and runs only the jobs
  without one; ``--merge`` and the tables read the records, never the exported models or checkpoints.
- ``grid.json`` beside the records: what the whole grid is (recipe, data, arms, lr set, threads). A grid
  started again on the same records with another one is refused, naming what differs.

Records are written whole or not at all (a temporary file renamed), so a grid stopped at any moment
leaves every finished record intact and no half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ntil_ds.comparison.results import RunResult, slug
from ntil_ds.data.cache import update_with_file

GRID_FILE = "grid.json"
# Fields of the resolved recipe that do not decide a job's result: where it writes, how it is tracked.
_NOT_IDENTITY = ("output_dir", "resume", "tracking")
# Fields that hold a path to data or a model: identified by content (``content_digest``), not by path.
_CONTENT_FIELDS = (("data", "train_file"), ("data", "eval_file"), ("model", "name_or_path"))


def atomic_write_json(path: Path, value: Any) -> None:
    """``value`` as JSON at ``path``, all of it or nothing (a stop mid-write leaves the old file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def content_digest(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names and bytes, in sorted order); a data split
    is hashed with its images (comparison.splits.split_hash)."""
    from ntil_ds.comparison.splits import split_hash

    if path.is_dir() and (path / "config.json").is_file():  # a model folder
        digest = hashlib.sha256()
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(path)).encode() + b"\0")
            update_with_file(digest, file)
        return digest.hexdigest()
    return split_hash(path)


def resolved_recipe(cfg_dict: dict[str, Any], digests: dict[str, str]) -> dict[str, Any]:
    """The resolved config as a job's identity sees it: each field that differs from the Config default
    (so a field added to the recipe later, at its default, leaves earlier records valid), without output
    and tracking fields, each data or model path replaced by its content digest (``digests``: path ->
    sha256; a hub model id stays)."""
    from ntil_ds.config import Config, to_dict

    recipe = _differing(cfg_dict, to_dict(Config()))
    recipe = {key: value for key, value in recipe.items() if key not in _NOT_IDENTITY}
    for section, key in _CONTENT_FIELDS:
        value = recipe.get(section, {}).get(key)
        if value and value in digests:
            recipe[section] = {**recipe[section], key: f"sha256:{digests[value]}"}
    mixture = recipe.get("data", {}).get("mixture") or []
    if mixture:
        recipe["data"] = {
            **recipe["data"],
            "mixture": [
                {**source, "file": f"sha256:{digests.get(source['file'], source['file'])}"}
                for source in mixture
            ],
        }
    return recipe


def _differing(tree: dict[str, Any], default: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``tree`` that are not as in ``default``, nested sections kept as sections."""
    kept: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and isinstance(default.get(key), dict):
            inner = _differing(value, default[key])
            if inner:
                kept[key] = inner
        elif key not in default or default[key] != value:
            kept[key] = value
    return kept


def identity_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def record_path(records: Path, kind: str, label: str, seed: int) -> Path:
    return records / kind / f"{slug(label)}-seed{seed}.json"


def read_record(path: Path, key: str) -> dict | None:
    """The record at ``path`` if it is the job ``key`` (another job's record there is not this one)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("key") == key else None


def record_result(record: dict, path: Path) -> RunResult:
    """The RunResult a record holds, pointing at the record (where its items and curve are)."""
    return RunResult(**{**record["result"], "record": str(path)})


def check_grid(records: Path, grid: dict[str, Any]) -> dict[str, Any]:
    """Write ``grid.json`` the first time; later, the same grid or a refusal that names each field that
    differs. Returns what is on disk (its ``name`` is kept, so the grid's MLflow names stay the same)."""
    path = records / GRID_FILE
    if not path.is_file():
        atomic_write_json(path, grid)
        return grid
    earlier = json.loads(path.read_text())
    was, now = _dotted(earlier), _dotted(grid)
    changed = [key for key in dict.fromkeys([*was, *now]) if key != "name" and was.get(key) != now.get(key)]
    if changed:
        lines = [
            f"  {key}: was {json.dumps(was.get(key))[:200]}, now {json.dumps(now.get(key))[:200]}"
            for key in changed
        ]
        raise SystemExit(
            f"{records} holds the records of another grid; what differs:\n"
            + "\n".join(lines)
            + "\nrun this grid with another --out (or --records), or start the earlier one again as it was"
        )
    return earlier


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"recipe.train.max_steps": 2, ...}: each leaf of nested dicts under its dotted name."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= _dotted(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def item_rows(report: dict) -> list[dict[str, str]]:
    """What the bootstrap needs of a scored split: each item's prediction and reference, in order."""
    return [{"prediction": row["prediction"], "reference": row["reference"]} for row in report["samples"]]


def generate_records(metrics_file: Path) -> list[dict]:
    """The scores a job logged while training (its metrics.jsonl's "generate" records)."""
    if not metrics_file.is_file():
        return []
    records = (json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip())
    return [record for record in records if record.get("split") == "generate"]
