"""A rank's process ends without racing interpreter finalization (ntil_ds.dist.exit_process).

The hazard, reproduced: when a rank's last collective reduced a temporary tensor, gloo's worker thread
holds its last reference and must take the GIL to release it. If the interpreter is finalizing by then,
CPython ends that thread inside a C++ destructor and the process aborts with SIGABRT ("terminate called
without an active exception"): measured here, 3 of 8 plain exits aborted, 0 of 8 with exit_process.
This test asserts the promise (every exit clean), not the race's rate.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from tests.distributed.training_runs import REPO_ROOT, launch_env

pytestmark = [pytest.mark.distributed]

PROBE = REPO_ROOT / "tests" / "distributed" / "exit_probe.py"


def _run_probe(store, how: str) -> list[tuple[int, str]]:
    """Both ranks of one probe job: (exit code, output) each."""
    ranks = [
        subprocess.Popen(
            [sys.executable, str(PROBE), str(rank), str(store), how],
            env=launch_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in ranks]  # then each has its exit code
    return [(process.returncode, output) for process, output in zip(ranks, outputs, strict=True)]


@pytest.mark.timeout(300)
def test_ranks_that_end_with_exit_process_never_abort(tmp_path):
    for attempt in range(4):
        for rank, (code, output) in enumerate(_run_probe(tmp_path / f"store{attempt}", "exit_process")):
            assert code == 0, f"attempt {attempt}, rank {rank}: {output[-2000:]}"
            assert "terminate called" not in output
    # The control: the same job ending by plain finalization. Whether it aborts here says whether this
    # machine shows the race at all (the assertion above cannot fail where it never happens); reported,
    # not asserted, since its rate is the machine's.
    aborted = sum(
        code != 0 or "terminate called" in output
        for attempt in range(2)
        for code, output in _run_probe(tmp_path / f"control{attempt}", "finalize")
    )
    warnings.warn(f"exit-race control: {aborted} of 4 plain exits aborted on this machine", stacklevel=1)
