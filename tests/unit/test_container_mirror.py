"""The container test's Debian mirror comes from the machine's apt sources (docker/apt_mirror.sh), not from
the project: the script's reader on apt source trees written here, as apt lays them out."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "docker" / "apt_mirror.sh"
# Example hosts of the trees below; not any real archive's (the project names none).
MAIN, SECURITY, OTHER = (
    "http://mirror.example/debian",
    "http://mirror.example/debian-security",
    "https://x.example/apt",
)


def sources(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "etc" / "apt" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def mirror(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(root)], capture_output=True, text=True, check=False)


def found(root: Path) -> tuple[str, str]:
    done = mirror(root)
    assert done.returncode == 0, done.stderr
    uri, source = done.stdout.rstrip("\n").split("\t")
    return uri, str(Path(source).relative_to(root))


def test_deb822_sources_as_debian_12_writes_them(tmp_path):
    """Debian 12's own layout: the security archive in a later stanza; a comment between the fields."""
    root = sources(tmp_path, {"sources.list.d/debian.sources": (
        f"Types: deb\n# a snapshot, commented out\nURIs: {MAIN}/\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        f"Types: deb\nURIs: {SECURITY}\nSuites: bookworm-security\nComponents: main\n"
    )})  # fmt: skip
    assert found(root) == (MAIN, "etc/apt/sources.list.d/debian.sources")  # the trailing / dropped


def test_one_line_sources_skip_security_source_packages_and_options(tmp_path):
    root = sources(tmp_path, {"sources.list": (
        f"# deb {OTHER} bookworm main\ndeb {SECURITY} bookworm-security main\ndeb-src {OTHER} bookworm main\n"
        f"  deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] {MAIN} bookworm main contrib\n"
    )})  # fmt: skip
    assert found(root) == (MAIN, "etc/apt/sources.list")


def test_apts_order_and_what_is_not_a_debian_archive(tmp_path):
    """sources.list first, then sources.list.d by name; a disabled stanza, a third-party repository
    (nodistro, cloud-sdk-bookworm), deb-src only, a cdrom and a disabled file are passed over."""
    root = sources(tmp_path, {
        "sources.list": f"deb {OTHER} cloud-sdk-bookworm main\ndeb cdrom:[Debian 12]/ bookworm main\n",
        "sources.list.d/a.sources": f"Types: deb\nURIs: {OTHER}\nSuites: nodistro\nComponents: main\n",
        "sources.list.d/b.sources": f"Types: deb\nURIs: {OTHER}/off\nSuites: bookworm\nEnabled: no\n\n"
                                    f"Types: deb-src\nURIs: {OTHER}/src\nSuites: bookworm\n",
        "sources.list.d/c.list.disabled": f"deb {OTHER}/disabled bookworm main\n",
        "sources.list.d/d.list": f"deb {MAIN}/ stable-updates main\n",
        "sources.list.d/e.sources": f"Types: deb\nURIs: {OTHER}/later\nSuites: trixie\n",
    })  # fmt: skip
    assert found(root) == (MAIN, "etc/apt/sources.list.d/d.list")


@pytest.mark.parametrize(
    "files",
    [
        {},
        {
            "sources.list": "deb http://mirror.example/ubuntu jammy main\ndeb http://mirror.example/ubuntu jammy-security main\n"
        },
        {
            "sources.list.d/ubuntu.sources": "Types: deb\nURIs: http://mirror.example/ubuntu\nSuites: noble noble-updates\n"
        },
    ],
    ids=["no sources", "ubuntu one-line", "ubuntu deb822"],
)
def test_no_debian_archive_is_a_failure_not_a_guess(tmp_path, files):
    done = mirror(sources(tmp_path, files) if files else tmp_path)
    assert done.returncode == 1 and done.stdout == ""


def test_the_container_test_reads_it_and_names_no_debian_host():
    script = (REPO_ROOT / "docker" / "container_test.sh").read_text()
    assert "source docker/apt_mirror.sh" in script and 'found="$(apt_mirror)"' in script
    assert 'if [[ -n "${DEBIAN_MIRROR:-}" ]]' in script  # the override wins
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    host = re.compile(r"\b(deb|ftp|security|httpredir|cdn-fastly\.deb)\." + "debian" + r"\.org\b")
    named = [
        name
        for name in tracked.stdout.split()
        if (REPO_ROOT / name).is_file() and host.search((REPO_ROOT / name).read_text(errors="ignore"))
    ]
    assert named == [], f"files naming a Debian package host: {named}"
