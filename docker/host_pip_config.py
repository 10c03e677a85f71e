"""This machine's pip configuration, handed to a container build: what pip finds here, the build finds.

    python3 docker/host_pip_config.py STAGE_DIR   # prints the build's bind mounts, SRC:DST:ro, one a line

A build container sees none of the host's pip setup: a proxy's CA file, a constraint file, local wheel
folders and indexes (this project's CI machines find torch's CPU wheel on local disk). This reads the
settings as pip itself merges them (`pip config list`: its config files and PIP_* variables, the
variables winning) and writes them to STAGE_DIR/pip.conf with every local path in them moved under
/mnt, then prints the mounts that put them there, read-only: STAGE_DIR on /mnt, each path under it, and
the pip.conf on /etc/pip.conf. Mounted, never copied: no file of the host reaches an image layer. /mnt
exists (empty) in Debian and Ubuntu images and every mount point under it is made in STAGE_DIR, so
buildah, which leaves the mount points it had to create in the image, leaves only an empty /etc/pip.conf.
"""

from __future__ import annotations

import ast
import configparser
import subprocess
import sys
from pathlib import Path

MOUNT_ROOT = Path("/mnt")
# pip options whose values name files, folders or file:// URLs on this machine.
INDEX_OPTIONS = {"index-url", "extra-index-url"}


def pip_settings() -> dict[str, dict[str, str]]:
    """{section: {option: value}} as `pip config list` reports them; PIP_* variables go to [global]."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    files: dict[str, dict[str, str]] = {}
    variables: dict[str, str] = {}
    for line in listing.splitlines():
        name, _, value = line.partition("=")
        section, _, option = name.rpartition(".")
        value = ast.literal_eval(value)  # pip prints each value with repr()
        if section == ":env:" and option == "config-file":
            continue  # PIP_CONFIG_FILE: its settings are in the listing already
        if section == ":env:":
            variables[option] = value
        else:
            files.setdefault(section, {})[option] = value
    files.setdefault("global", {}).update(variables)  # pip ranks PIP_* variables above every file
    return files


def host_path(option: str, word: str) -> Path | None:
    """The local file or folder a word of an option's value names, or None (a URL, a flag, a name)."""
    path = Path(word.removeprefix("file://")) if word.startswith(("file:///", "/")) else None
    if path is None or not path.exists():
        return None
    # A PEP 503 index links its files relative to itself (../../files/x.whl): mount the folder above it.
    return path.parent if option in INDEX_OPTIONS and path.is_dir() else path


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    stage = Path(sys.argv[1]).resolve()
    stage.mkdir(parents=True, exist_ok=True)
    try:
        settings = pip_settings()
    except (OSError, subprocess.CalledProcessError) as error:
        sys.exit(f"host_pip_config: cannot read this machine's pip configuration ({error}): "
                 f"{sys.executable} -m pip config list must work")  # fmt: skip

    mounted: set[Path] = set()
    config = configparser.ConfigParser(interpolation=None)
    for section, options in settings.items():
        config[section] = {}
        for option, value in options.items():
            words = value.split()
            for i, word in enumerate(words):
                path = host_path(option, word)
                if path is None:
                    continue
                mounted.add(path)
                inside = MOUNT_ROOT / path.relative_to("/")
                words[i] = word.replace(str(path), str(inside), 1)
            config[section][option] = " ".join(words)

    # A path inside another mounted one comes with it.
    mounted = {p for p in mounted if not any(p != q and p.is_relative_to(q) for q in mounted)}
    for path in sorted(mounted):
        mount_point = stage / path.relative_to("/")
        if path.is_dir():
            mount_point.mkdir(parents=True, exist_ok=True)
        else:
            mount_point.parent.mkdir(parents=True, exist_ok=True)
            mount_point.touch()
    with open(stage / "pip.conf", "w") as out:
        out.write("# This machine's pip settings (docker/host_pip_config.py), mounted into a build\n")
        config.write(out)

    print(f"{stage}:{MOUNT_ROOT}:ro")
    for path in sorted(mounted):
        print(f"{path}:{MOUNT_ROOT / path.relative_to('/')}:ro")
    print(f"{stage / 'pip.conf'}:/etc/pip.conf:ro")
    return 0


if __name__ == "__main__":
    sys.exit(main())
