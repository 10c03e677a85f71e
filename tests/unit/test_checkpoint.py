"""Which checkpoint a job resumes from: the newest COMPLETE one, never a half-written folder."""

import pytest

from ntil_ds.checkpoint import (
    COMPLETE_MARKER,
    checkpoint_tag,
    checkpoints_root,
    complete_checkpoints,
    find_resume_checkpoint,
)
from ntil_ds.config import ConfigError


def make_checkpoint(output_dir, step, complete):
    path = checkpoints_root(output_dir) / checkpoint_tag(step)
    path.mkdir(parents=True)
    (path / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"partial")
    if complete:
        (path / COMPLETE_MARKER).write_text(f"step {step}\n")
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
