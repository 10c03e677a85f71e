"""Real SLURM clusters (munged + slurmctld + slurmd) in a temporary folder, for the tests.

- `LocalSlurmCluster`: one node, this machine (127.0.0.1).
- `NamespaceSlurmCluster`: several nodes on this machine, each `slurmd` in a network namespace (and a
  UTS namespace: its own host name) of its own, the controller in another, all joined by a bridge that
  lives in a namespace too. The nodes talk real TCP to each other through the bridge; none of the
  addresses exists outside the namespaces the cluster makes, so no job traffic reaches the machine's
  own network. The nodes share the filesystem, as cluster nodes share /home.

Everything a cluster starts lives under one folder (config, munge key and socket, state, logs), so it
does not touch the machine's own /etc/slurm or munge and can run beside another cluster. The daemons
run in the foreground as our child processes and are stopped by pid.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

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


def namespaces_unavailable() -> str | None:
    """Why a `NamespaceSlurmCluster` cannot be made on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    for tool, package in (("ip", "iproute2"), ("nsenter", "util-linux"), ("hostname", "hostname")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package})"
    probe = f"ntilprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"`ip netns add` failed: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


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
        self.nodes = [self.host]
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

    # ---- what differs between the clusters ------------------------------------------------------
    def _topology_lines(self) -> list[str]:
        """Controller, ports, nodes and partition."""
        r = self.root
        return [
            f"SlurmctldHost={self.host}",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmdPidFile={r}/run/slurmd.pid",
            f"SlurmdLogFile={r}/log/slurmd.log",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
        ]

    def _client_prefix(self) -> list[str]:
        """What client commands (sbatch, scontrol...) run under to reach the controller."""
        return []

    def _check_host(self) -> None:
        try:
            socket.gethostbyname(self.host)
        except OSError as e:
            # slurm/train.sh uses the node name as the rendezvous host, as on a real cluster.
            raise RuntimeError(f"host name {self.host!r} does not resolve ({e}); add it to /etc/hosts") from e

    def _on_controller(self, argv: list[str]) -> list[str]:
        """`argv` as run on the controller host (munged, slurmctld)."""
        return argv

    def _start_slurm_daemons(self) -> None:
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])

    # ---- start / stop -----------------------------------------------------------------------------
    def _write_config(self) -> None:
        for sub in ("munge", "state", "spool", "log", "run", *(f"spool/{node}" for node in self.nodes)):
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
                    f"SlurmctldPidFile={r}/run/slurmctld.pid",
                    f"SlurmctldLogFile={r}/log/slurmctld.log",
                    *self._topology_lines(),
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
        self._check_host()
        self._write_config()
        m = self.root / "munge"
        self._spawn(
            "munged",
            self._on_controller([
                "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={m}/munge.key", f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",
                f"--log-file={self.root}/log/munged.log",
            ]),
        )  # fmt: skip
        self._wait_for(lambda: self.munge_socket.exists(), timeout, "munged socket")
        self._start_slurm_daemons()
        self.wait_nodes_idle(timeout)

    def node_states(self) -> dict[str, str]:
        """Node name -> state as sinfo prints it (idle, allocated, down*, drained...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=10).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def wait_nodes_idle(self, timeout: float) -> None:
        self._wait_for(self._nodes_idle, timeout, f"nodes {', '.join(self.nodes)} to become idle")

    def _nodes_idle(self) -> bool:
        for proc in self._procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"a SLURM daemon exited early ({' '.join(proc.args)}): see {self.root}/log\n{self.logs()}"
                )
        states = self.node_states()
        return sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values())

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
            [*self._client_prefix(), *argv],
            capture_output=True,
            text=True,
            env=kwargs.pop("env", self.env),
            timeout=timeout,
            **kwargs,
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


# Addresses exist only inside the namespaces a NamespaceSlurmCluster makes (each has its own network
# stack), so two clusters on one machine can both use them.
MANAGEMENT_SUBNET = "10.231.0"  # SLURM's traffic, and host names
FABRIC_SUBNET = "10.231.1"  # the training processes' traffic (GLOO_SOCKET_IFNAME=FABRIC_INTERFACE)
FABRIC_INTERFACE = "fab0"
CONTROLLER = "ctl"
_cluster_ids = itertools.count()
_NAMESPACE = re.compile(r"^ntil(\d+)c\d+-\w+$")  # NamespaceSlurmCluster.netns: ntil<test pid>c<n>-<member>


def remove_stale_clusters() -> None:
    """Delete the namespaces of clusters whose test process is gone (killed before its teardown), and
    end what runs in them: that cluster's daemons and jobs."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in listed:
        match = _NAMESPACE.match(ns)
        if match is None or psutil.pid_exists(int(match[1])):
            continue
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


class NamespaceSlurmCluster(LocalSlurmCluster):
    """A cluster of `num_nodes` nodes n1, n2... on this machine, one network namespace per node.

    ::

        ns ctl  eth0 10.231.0.254                  slurmctld; client commands (sbatch...) run here
        ns n1   eth0 10.231.0.1, fab0 10.231.1.1   slurmd -N n1, host name n1
        ns n2   eth0 10.231.0.2, fab0 10.231.1.2   slurmd -N n2, host name n2
        ...
        ns br   bridges mgmt (all eth0) and fabric (all fab0), each link a veth pair to a bridge port

    Two networks, as on most clusters: the management network (host names resolve to it; SLURM,
    srun's I/O and the rendezvous store at MASTER_ADDR use it) and a fabric that jobs pick by interface
    name (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME=fab0). `set_link(node, FABRIC_INTERFACE, up=False)`
    cuts a node off the fabric while SLURM still sees it (the case that hangs a job if anything does);
    taking eth0 down makes the node lost to SLURM as well.

    Every node and the controller have their own network stack, host name (a UTS namespace) and an
    /etc/hosts that names all of them (bind-mounted in a mount namespace of their own), so jobs see what
    they see on a cluster: `hostname` is the node, node names resolve to node addresses. munged runs
    once, outside: its socket is a file, shared by all nodes like the filesystem.
    """

    def __init__(self, root: Path, num_nodes: int = 3, cpus: int | None = None):
        super().__init__(root, cpus)
        self.host = CONTROLLER  # the submit host
        self.nodes = [f"n{i}" for i in range(1, num_nodes + 1)]
        self._tag = f"ntil{os.getpid()}c{next(_cluster_ids)}"
        self._made_namespaces: list[str] = []

    # ---- names and addresses -----------------------------------------------------------------
    def netns(self, member: str) -> str:
        """The network namespace of a node ("n1"...), of the controller ("ctl") or of the bridges ("br")."""
        return f"{self._tag}-{member}"

    def address(self, member: str, interface: str = "eth0") -> str:
        if member == CONTROLLER:
            return f"{MANAGEMENT_SUBNET}.254"
        subnet = FABRIC_SUBNET if interface == FABRIC_INTERFACE else MANAGEMENT_SUBNET
        return f"{subnet}.{self.nodes.index(member) + 1}"

    def hosts_file(self) -> str:
        lines = ["127.0.0.1 localhost", *(f"{self.address(m)} {m}" for m in (CONTROLLER, *self.nodes))]
        return "\n".join(lines) + "\n"

    # ---- the network -------------------------------------------------------------------------
    def _ip(self, *args: str) -> None:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} failed: {res.stderr.strip()}")

    def _add_namespace(self, member: str) -> str:
        ns = self.netns(member)
        self._ip("netns", "add", ns)
        self._made_namespaces.append(ns)
        self._ip("-n", ns, "link", "set", "lo", "up")
        return ns

    def _connect(self, member: str, interface: str, bridge: str) -> None:
        bridge_ns, port = self.netns("br"), f"{member}-{interface}"
        # Made inside the namespaces: no interface ever appears in the machine's own namespace.
        self._ip("-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name", interface,
                 "netns", self.netns(member))  # fmt: skip
        self._ip("-n", bridge_ns, "link", "set", port, "master", bridge, "up")
        self._ip(
            "-n", self.netns(member), "addr", "add", f"{self.address(member, interface)}/24", "dev", interface
        )
        self._ip("-n", self.netns(member), "link", "set", interface, "up")

    def _make_network(self) -> None:
        bridge_ns = self._add_namespace("br")
        for bridge in ("mgmt", "fabric"):
            self._ip("-n", bridge_ns, "link", "add", bridge, "type", "bridge")
            self._ip("-n", bridge_ns, "link", "set", bridge, "up")
        self._add_namespace(CONTROLLER)
        self._connect(CONTROLLER, "eth0", "mgmt")
        for node in self.nodes:
            self._add_namespace(node)
            self._connect(node, "eth0", "mgmt")
            self._connect(node, FABRIC_INTERFACE, "fabric")
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "hosts").write_text(self.hosts_file())
        for member in (CONTROLLER, *self.nodes):
            (self.root / "local" / member).mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(exist_ok=True)

    def set_link(self, node: str, interface: str, up: bool) -> None:
        """Bring one of a node's links up or down (down: as if its cable were pulled)."""
        self._ip("-n", self.netns(node), "link", "set", interface, "up" if up else "down")

    @property
    def scratch(self) -> Path:
        """One path, a different folder on each node (``<root>/local/<node>`` bind-mounted on it): a node's
        own disk, as /scratch or /local on a cluster, beside the shared filesystem."""
        return self.root / "scratch"

    def scratch_of(self, member: str) -> Path:
        """What `scratch` holds on `member`, seen from outside the nodes."""
        return self.root / "local" / member

    def in_namespace(self, member: str, argv: list[str]) -> list[str]:
        """`argv` run in a member's network namespace, under its host name, with the cluster's hosts file
        and its own `scratch`."""
        # Not `ip netns exec`: it remounts /sys, which hides the cgroup mounts slurmd needs. A mount
        # namespace of its own keeps the bind mounts away from the rest of the machine (unshare makes its
        # mounts private).
        mounts = 'mount --bind "$0" /etc/hosts && mount --bind "$1/local/$2" "$1/scratch" && hostname "$2"'
        return ["nsenter", f"--net=/run/netns/{self.netns(member)}", "unshare", "--mount", "--uts", "--",
                "sh", "-c", f'{mounts} && shift 2 && exec "$@"',
                str(self.root / "hosts"), str(self.root), member, *argv]  # fmt: skip

    # ---- the hooks of LocalSlurmCluster ------------------------------------------------------------
    def _check_host(self) -> None:
        pass  # names resolve through the namespaces' hosts files

    def start(self, timeout: float = 60.0) -> None:
        problem = namespaces_unavailable()
        if problem:
            raise RuntimeError(problem)
        remove_stale_clusters()
        self._make_network()
        super().start(timeout)

    def _topology_lines(self) -> list[str]:
        r = self.root
        return [
            # Every member has a network stack of its own: SLURM's default ports collide with nothing.
            f"SlurmctldHost={CONTROLLER}",
            # %n: the node name; one spool, pid and log per slurmd.
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmdPidFile={r}/run/slurmd.%n.pid",
            f"SlurmdLogFile={r}/log/slurmd.%n.log",
            *(
                f"NodeName={node} NodeAddr={self.address(node)} CPUs={self.cpus} RealMemory=4000 State=UNKNOWN"
                for node in self.nodes
            ),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]

    def _client_prefix(self) -> list[str]:
        return self.in_namespace(CONTROLLER, [])

    def _on_controller(self, argv: list[str]) -> list[str]:
        # munged too: its socket is a file every namespace reaches, and all daemons then live in the
        # cluster's namespaces (remove_stale_clusters finds them there).
        return self.in_namespace(CONTROLLER, argv)

    def _start_slurm_daemons(self) -> None:
        self._spawn("slurmctld", self._on_controller(["slurmctld", "-D", "-c", "-f", str(self.conf)]))
        for node in self.nodes:
            self._spawn(
                f"slurmd.{node}", self.in_namespace(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            )

    # ---- what runs where -----------------------------------------------------------------------
    def pids_in(self, member: str) -> set[int]:
        """Processes in a member's network namespace, the SLURM daemons left out (job steps, ranks)."""
        res = subprocess.run(["ip", "netns", "pids", self.netns(member)], capture_output=True, text=True)
        daemons = {proc.pid for proc in self._procs}
        return {int(pid) for pid in res.stdout.split()} - daemons

    def tcp_peers(self, node: str) -> dict[int, set[str]]:
        """pid -> remote addresses of its established TCP connections, for the processes on a node."""
        res = subprocess.run(["nsenter", f"--net=/run/netns/{self.netns(node)}", "ss", "-tnpH", "state",
                              "established"], capture_output=True, text=True, timeout=30)  # fmt: skip
        peers: dict[int, set[str]] = {}
        for line in res.stdout.splitlines():
            # Recv-Q Send-Q Local:Port Peer:Port users:(("python",pid=123,fd=7),...)
            fields = line.split()
            if len(fields) < 5:
                continue
            for pid in re.findall(r"pid=(\d+)", fields[4]):
                peers.setdefault(int(pid), set()).add(fields[3].rsplit(":", 1)[0])
        return peers

    def stop(self) -> None:
        try:
            for node in self.nodes:  # links a test took down: every slurmd must reach the controller
                if self.netns(node) in self._made_namespaces:
                    for interface in ("eth0", FABRIC_INTERFACE):
                        with contextlib.suppress(RuntimeError, subprocess.SubprocessError):
                            self.set_link(node, interface, up=True)
            super().stop()
        finally:
            for ns in reversed(self._made_namespaces):
                # What is still in there was started by this cluster's jobs (the daemons are stopped).
                for pid in self.pids_in(ns.rsplit("-", 1)[1]):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
            self._made_namespaces.clear()
