"""Which checkpoint a job resumes from: the newest COMPLETE and intact one, never a half-written or
damaged folder; and a resume under a different recipe is refused."""

import json
import logging

import pytest

from ntil_ds.checkpoint import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    check_resume_config,
    checkpoint_damage,
    checkpoint_tag,
    checkpoints_root,
    complete_checkpoints,
    find_resume_checkpoint,
)
from ntil_ds.config import ConfigError, load_config, save_config

MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def make_checkpoint(output_dir, step, complete):
    """A folder as save_checkpoint leaves it: files, then (if complete) the manifest marker."""
    path = checkpoints_root(output_dir) / checkpoint_tag(step)
    path.mkdir(parents=True)
    (path / MODEL_FILE).write_bytes(b"weights" * 100)
    (path / "rng_rank0.pt").write_bytes(b"rng")
    if complete:
        files = {f.name: f.stat().st_size for f in path.iterdir()}
        (path / COMPLETE_MARKER).write_text(json.dumps({"step": step, "files": files}))
    return path


def test_auto_picks_the_newest_complete_checkpoint_and_skips_half_written_ones(tmp_path):
    assert find_resume_checkpoint("auto", tmp_path) is None  # nothing yet: a fresh start
    make_checkpoint(tmp_path, 9, complete=True)
    newest = make_checkpoint(tmp_path, 30, complete=True)
    make_checkpoint(tmp_path, 100, complete=False)  # the job died while writing it
    (checkpoints_root(tmp_path) / "latest").write_text("step_00000100")  # DeepSpeed's pointer: ignored
    assert find_resume_checkpoint("auto", tmp_path) == newest
    # Steps sort numerically, not as text.
    assert [p.name for p in complete_checkpoints(tmp_path)] == [checkpoint_tag(9), checkpoint_tag(30)]


def test_none_and_explicit_paths(tmp_path):
    complete = make_checkpoint(tmp_path, 3, complete=True)
    half = make_checkpoint(tmp_path, 6, complete=False)
    assert find_resume_checkpoint("none", tmp_path) is None
    assert find_resume_checkpoint(str(complete), tmp_path) == complete
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        find_resume_checkpoint(str(half), tmp_path)


def test_a_truncated_or_missing_file_makes_auto_fall_back_to_the_previous_checkpoint(tmp_path, caplog):
    older = make_checkpoint(tmp_path, 3, complete=True)
    newest = make_checkpoint(tmp_path, 6, complete=True)
    assert checkpoint_damage(newest) is None
    with (newest / MODEL_FILE).open("r+b") as f:
        f.truncate(10)  # cut short after the save (a copy interrupted, a disk fault)
    assert checkpoint_damage(newest) == f"{MODEL_FILE} has 10 bytes, 700 were written"
    with caplog.at_level(logging.WARNING, logger="ntil_ds.checkpoint"):
        assert find_resume_checkpoint("auto", tmp_path) == older
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(newest) in warnings[0] and "700 were written" in warnings[0]

    (older / "rng_rank0.pt").unlink()
    assert checkpoint_damage(older) == "rng_rank0.pt is missing"
    assert find_resume_checkpoint("auto", tmp_path) is None  # nothing intact: a fresh start, warned
    with pytest.raises(ConfigError, match="damaged"):
        find_resume_checkpoint(str(newest), tmp_path)


def test_a_marker_that_is_not_a_manifest_counts_as_damaged(tmp_path):
    path = make_checkpoint(tmp_path, 3, complete=True)
    (path / COMPLETE_MARKER).write_text("step 3\n")
    assert "not a manifest" in checkpoint_damage(path)
    assert find_resume_checkpoint("auto", tmp_path) is None


REQUIRED = ["model.name_or_path=tiny", "data.train_file=train.jsonl"]


def checkpoint_with_config(tmp_path, **overrides):
    path = make_checkpoint(tmp_path / "run", 4, complete=True)
    saved = load_config(None, [*REQUIRED, *(f"{k}={v}" for k, v in overrides.items())])
    save_config(saved, path / CONFIG_FILE)
    return path


def test_resume_with_another_recipe_is_an_error_naming_each_key_old_and_new(tmp_path):
    checkpoint = checkpoint_with_config(tmp_path, **{"loss.name": "ntil", "optim.lr": 1e-5})
    changed = load_config(None, [*REQUIRED, "loss.name=ce", "optim.lr=0.5", "train.max_steps=6"])
    with pytest.raises(ConfigError) as error:
        check_resume_config(checkpoint, changed)
    message = str(error.value)
    assert "loss.name: 'ntil' in the checkpoint, 'ce' now" in message
    assert "optim.lr: 1e-05 in the checkpoint, 0.5 now" in message
    assert "train.max_steps" not in message.split("Keys that may change")[0]  # allowed to change
    assert "output_dir=" in message and "resume=force" in message


def test_keys_that_may_change_on_resume_pass_and_force_only_warns(tmp_path, caplog):
    checkpoint = checkpoint_with_config(tmp_path)
    allowed = load_config(
        None,
        [*REQUIRED, "train.max_steps=500", "train.save_every=7", "tracking.uri=http://127.0.0.1:1",
         "output_dir=/moved", "data.eval_file=val.jsonl"],
    )  # fmt: skip
    check_resume_config(checkpoint, allowed)  # no error
    forced = load_config(None, [*REQUIRED, "loss.name=ce", "resume=force"])
    with caplog.at_level(logging.WARNING, logger="ntil_ds.checkpoint"):
        check_resume_config(checkpoint, forced)
    assert any("loss.name: 'ntil' in the checkpoint, 'ce' now" in r.getMessage() for r in caplog.records)
