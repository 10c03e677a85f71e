"""A ceiling on one test's setup or call (issue 56): a phase that runs longer fails, naming itself, so the
suite stays inside CI's budget and a slow new test is caught where it is added, not by a red CI later.

The ceiling (NTIL_TEST_CEILING_S, default 360 s) is generous against this machine's slowest phase (the
four-node SLURM cluster's start with its first job: 130-200 s on the machines CI has used, the slowest
1.4x this one): it is a guard against a test that runs for many minutes, not a speed measurement."""

import os

import pytest

CEILING_S = float(os.environ.get("NTIL_TEST_CEILING_S", "360"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when in ("setup", "call") and report.passed and call.duration > CEILING_S:
        report.outcome = "failed"
        report.longrepr = (
            f"the {call.when} of {item.nodeid} took {call.duration:.0f} s, above the {CEILING_S:.0f} s "
            "ceiling on one test's setup or call (tests/phase_ceiling.py, NTIL_TEST_CEILING_S): share its "
            "fixture with other tests, make its job smaller, or split it"
        )
