"""Fixtures for the SLURM tests: real local clusters (one node; four nodes in network namespaces), each
started once for the whole session."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.slurm.cluster import (
    LocalSlurmCluster,
    NamespaceSlurmCluster,
    missing_binaries,
    namespaces_unavailable,
)


def _unavailable(reason: str, fix: str = "`make system-deps` installs slurm-wlm and munge") -> None:
    # CI (.ci/run) sets NTIL_REQUIRE_SLURM=1: there a missing SLURM is a failure, not a skip.
    if os.environ.get("NTIL_REQUIRE_SLURM"):
        pytest.fail(f"{reason} (NTIL_REQUIRE_SLURM is set; {fix})")
    pytest.skip(f"{reason} ({fix})")


@pytest.fixture(scope="session")
def slurm_binaries() -> None:
    """SLURM's programs are installed (the dry-run tests need `scontrol`, not a running cluster)."""
    missing = missing_binaries()
    if missing:
        _unavailable(f"SLURM programs missing: {', '.join(missing)}")


@pytest.fixture(scope="session")
def shellcheck() -> str:
    """Path of Debian's shellcheck (installed by `make system-deps`)."""
    path = shutil.which("shellcheck")
    if path is None:
        _unavailable("shellcheck is not installed")
    return path


@pytest.fixture(scope="session")
def slurm_cluster(slurm_binaries, tmp_path_factory) -> LocalSlurmCluster:
    """munged + slurmctld + slurmd on this machine, config and state in a temp folder; stopped at the end."""
    if os.geteuid() != 0:
        _unavailable("the local SLURM cluster needs root (slurmd launches jobs as their user)")
    cluster = LocalSlurmCluster(tmp_path_factory.mktemp("slurm-cluster"))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def netns_cluster(slurm_binaries, tmp_path_factory) -> NamespaceSlurmCluster:
    """Nodes n1-n4 (two 2-node jobs at once), each slurmd in a network namespace of its own (tests/slurm/cluster.py)."""
    problem = namespaces_unavailable()
    if problem:
        _unavailable(
            f"the multi-node SLURM cluster cannot be made: {problem}",
            "run as root; `make system-deps` installs iproute2, slurm-wlm and munge",
        )
    cluster = NamespaceSlurmCluster(tmp_path_factory.mktemp("slurm-netns"), num_nodes=4)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
