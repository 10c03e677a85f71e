"""docker/host_pip_config.py: this machine's pip settings, moved under /mnt for a container build.

`make container-test` mounts what it prints into the CPU image's build; here it runs on a pip
configuration made for the test (a config file and PIP_* variables, as pip itself reads them) and the
rewritten file is read back with pip's own parser. The build using it is `make container-test`.
"""

import configparser
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST_PIP_CONFIG = REPO_ROOT / "docker" / "host_pip_config.py"


def test_local_paths_move_under_mnt_with_a_read_only_mount_each(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "index" / "simple" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "files").mkdir()
    (tmp_path / "constraints.txt").write_text("torch<=2.14\n")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (tmp_path / "file-ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\n"
        f"cert = {tmp_path}/file-ca.pem\n"
        f"extra-index-url = file://{tmp_path}/index/simple https://example.org/simple\n"
        f"find-links = {tmp_path}/missing-folder\n"
        "[install]\n"
        f"constraint = {tmp_path}/constraints.txt\n"
    )
    # Only this test's settings: none of the caller's PIP_* variables or user config (the machine's
    # /etc/pip.conf may add more, below these in pip's order).
    env = {
        **{key: value for key, value in os.environ.items() if not key.startswith("PIP_")},
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        "PIP_CONFIG_FILE": str(config),
        "PIP_CERT": f"{tmp_path}/ca.pem",  # a variable beats every file, as in pip
        "PIP_FIND_LINKS": f"{tmp_path}/wheels",
    }
    stage = tmp_path / "stage"
    result = subprocess.run(
        [sys.executable, str(HOST_PIP_CONFIG), str(stage)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr

    written = configparser.ConfigParser(interpolation=None)
    written.read(stage / "pip.conf")
    inside = f"/mnt{tmp_path}"
    assert written["global"]["cert"] == f"{inside}/ca.pem"
    assert written["global"]["find-links"] == f"{inside}/wheels"
    assert written["global"]["extra-index-url"] == f"file://{inside}/index/simple https://example.org/simple"
    assert written["install"]["constraint"] == f"{inside}/constraints.txt"
    assert "config-file" not in written["global"]  # PIP_CONFIG_FILE's settings are the ones above

    mounts = result.stdout.splitlines()
    assert mounts[0] == f"{stage}:/mnt:ro"
    assert mounts[-1] == f"{stage}/pip.conf:/etc/pip.conf:ro"
    # An index links its files relative to itself (../../files/x.whl): the folder above it is mounted.
    for path in ("ca.pem", "constraints.txt", "index", "wheels"):
        assert f"{tmp_path}/{path}:{inside}/{path}:ro" in mounts
    assert not any("file-ca.pem" in m or "missing-folder" in m or "simple:" in m for m in mounts), mounts
    # Every mount point under /mnt exists in the staged folder, so the build creates none in the image.
    assert (stage / tmp_path.relative_to("/") / "wheels").is_dir()
    assert (stage / tmp_path.relative_to("/") / "ca.pem").is_file()
