"""A real one-node SLURM cluster (munged + slurmctld + slurmd) in a temporary folder, for the tests.

Everything it starts lives under one folder (config, munge key and socket, state, logs) and uses free
ports, so it does not touch the machine's own /etc/slurm or munge and can run beside another cluster.
The daemons run in the foreground as our child processes and are stopped by pid.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ntil_ds.dist import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "squeue", "scancel", "srun", "sinfo")
# Job states after which nothing more happens (REQUEUED/PENDING/RUNNING/COMPLETING are on the way).
FINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def missing_binaries() -> list[str]:
    """SLURM/munge programs this machine lacks (install with `make system-deps`)."""
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]


@dataclass
class JobInfo:
    """The fields of `scontrol show job -o` that the tests look at."""

    job_id: str
    state: str
    exit_code: str
    restarts: int
    raw: dict[str, str] = field(repr=False)


class LocalSlurmCluster:
    """Start with `start()`, stop with `stop()`; `env` is what client commands (sbatch...) need."""

    def __init__(self, root: Path, cpus: int | None = None):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.sock"
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        # munged refuses group/world-accessible key files and socket folders.
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        user = (
            os.environ.get("USER")
            or subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
        )
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=ntiltest",
                    f"SlurmctldHost={self.host}",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # A requeued job waits cred_expire seconds before it may start again (default 120).
                    f"AuthInfo=socket={self.munge_socket},cred_expire=10",
                    f"SlurmUser={user}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "MpiDefault=none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "ReturnToService=2",
                    # Finished jobs stay visible to `scontrol show job` long enough for the tests to read them.
                    "MinJobAge=900",
                    "KillWait=10",
                    "SchedulerParameters=sched_interval=1",
                    f"StateSaveLocation={r}/state",
                    f"SlurmdSpoolDir={r}/spool",
                    f"SlurmctldPidFile={r}/run/slurmctld.pid",
                    f"SlurmdPidFile={r}/run/slurmd.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    f"SlurmdLogFile={r}/log/slurmd.log",
                    f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")  # noqa: SIM115 (kept open while it runs)
        self._logs.append(log)
        self._procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )

    def start(self, timeout: float = 60.0) -> None:
        try:
            socket.gethostbyname(self.host)
        except OSError as e:
            # slurm/train.sh uses the node name as the rendezvous host, as on a real cluster.
            raise RuntimeError(f"host name {self.host!r} does not resolve ({e}); add it to /etc/hosts") from e
        self._write_config()
        m = self.root / "munge"
        self._spawn(
            "munged",
            [
                "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",
                f"--log-file={self.root}/log/munged.log",
            ],
        )  # fmt: skip
        self._wait_for(lambda: self.munge_socket.exists(), timeout, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
        self._wait_for(self._node_idle, timeout, "the node to become idle")

    def _node_idle(self) -> bool:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"a SLURM daemon exited early ({proc.args[0]}): see {self.root}/log\n{self.logs()}"
                )
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env, timeout=10
        ).stdout
        return out.strip().startswith("idle")

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(
                f"--- {path.name} (tail)\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
            )
        return "\n".join(parts)

    def _cancel_all_jobs(self, timeout: float = 30.0) -> None:
        # A job left running (a failed test) would outlive slurmd: its slurmstepd is not slurmd's child.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.run(["squeue", "-h", "-o", "%i %T"], timeout=10)
            active = [line.split()[0] for line in res.stdout.splitlines() if "COMPLETING" not in line]
            if res.returncode != 0 or not res.stdout.strip():
                return
            if active:
                self.run(["scancel", *active], timeout=10)
            time.sleep(0.5)

    def stop(self) -> None:
        if self._procs and all(proc.poll() is None for proc in self._procs):
            # the daemons are stopped below whether or not this works
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self._cancel_all_jobs()
        # slurmd first so it does not try to reach a gone controller.
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        for log in self._logs:
            log.close()
        self._procs.clear()

    # ---- client helpers -------------------------------------------------------------------
    def run(self, argv: list[str], timeout: float = 30.0, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, capture_output=True, text=True, env=kwargs.pop("env", self.env), timeout=timeout, **kwargs
        )

    def sbatch(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit; return the job id. `argv` are sbatch options, then the script and its arguments."""
        full_env = self.env | (env or {})
        res = self.run(["sbatch", "--parsable", *argv], env=full_env, cwd=cwd)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> JobInfo:
        res = self.run(["scontrol", "show", "job", "-o", job_id])
        if res.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id} failed: {res.stderr}")
        raw = dict(re.findall(r"(\w+)=(\S*)", res.stdout))
        return JobInfo(job_id, raw["JobState"], raw["ExitCode"], int(raw.get("Restarts", "0")), raw)

    def wait_job(self, job_id: str, timeout: float) -> JobInfo:
        """Poll until the job is in a final state (a requeued job passes through PENDING again)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.state in FINAL_STATES:
                return info
            time.sleep(0.5)
        self.run(["scancel", job_id])
        raise TimeoutError(
            f"job {job_id} not finished after {timeout:.0f} s (state {info.state}); cancelled it"
        )
