"""The ceiling on one test's setup or call (tests/phase_ceiling.py), on a pytest run of its own: a test and a
fixture above it fail, naming themselves and the phase; one below it passes."""

import re
import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_a_phase_above_the_ceiling_fails_naming_the_test(tmp_path):
    (tmp_path / "test_timed.py").write_text(
        "import time\n"
        "import pytest\n\n"
        "@pytest.fixture\n"
        "def slow_setup():\n"
        "    time.sleep(1.5)\n\n"
        "def test_slow_call():\n"
        "    time.sleep(1.5)\n\n"
        "def test_slow_setup(slow_setup):\n"
        "    pass\n\n"
        "def test_quick():\n"
        "    pass\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.phase_ceiling", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), str(tmp_path / "test_timed.py")],
        cwd=REPO_ROOT, env={"NTIL_TEST_CEILING_S": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 1, out
    assert re.search(r"the call of test_timed.py::test_slow_call took \d+ s, above the 1 s ceiling", out), out
    assert re.search(r"the setup of test_timed.py::test_slow_setup took \d+ s, above the 1 s ceiling", out), (
        out
    )
    assert "1 failed, 1 passed, 1 error" in out, out
