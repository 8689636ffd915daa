"""A throwaway single-node SLURM cluster for the tests: Debian's munge, MariaDB, slurmdbd, slurmctld and
slurmd, configured in one temporary folder on free ports, started in order, stopped by pid.

Accounting (slurmdbd on MariaDB) is part of it: without it submitit cannot see a cancelled job end
(its state stays UNKNOWN and `job.result()` waits forever). The daemons run as root, as the recipe that
was checked on this machine kind does; `unavailable()` says why a machine cannot run it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "mariadb-install-db", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
CLIENTS = ("munge", "unmunge", "mariadb", "sinfo", "sbatch", "squeue", "scancel", "sacct")


def which(tool: str) -> str | None:
    return shutil.which(tool, path=SBIN)


def unavailable() -> str | None:
    """One line on why this machine cannot start the cluster, or None."""
    missing = [t for t in (*DAEMONS, *CLIENTS) if which(t) is None]
    if missing:
        return (f"no SLURM cluster: {', '.join(missing)} not installed "
                "(apt-get install slurm-wlm slurmdbd munge mariadb-server, as .ci/run does)")
    if os.geteuid() != 0:
        return "no SLURM cluster: its daemons run as root here (SlurmUser=root), and this is not root"
    return None


def free_port() -> int:
    """A TCP port nobody listens on at 127.0.0.1, below the kernel's ephemeral range: a port from that range
    (what binding port 0 gives) can be taken, between this pick and the server's bind, as the source port of
    any process's outgoing connection (the gloo meshes of a DP test on the other worker did, and the server
    could not start)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:  # not Linux: the usual start of the range
        low = 32768
    ports = range(max(1024, low // 2), low)
    for port in random.Random().sample(ports, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {ports.start}-{ports.stop - 1}")


def wait_for(what: str, check, timeout: float, log: Path | None = None) -> None:
    """Poll `check()` until it is true; after `timeout` s, fail with the end of `log`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    tail = log.read_text()[-2000:] if log is not None and log.is_file() else ""
    raise RuntimeError(f"SLURM test cluster: {what} not ready after {timeout:.0f} s\n{tail}")


def quietly(*cmd: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kwargs)


class SlurmCluster:
    """`start()` it, use `env` (SLURM_CONF) for every SLURM command, `stop()` it."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.node = socket.gethostname().split(".")[0]
        self.conf = folder / "slurm.conf"
        self.logs = folder / "log"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": SBIN}
        self.started: list[tuple[str, subprocess.Popen]] = []  # in start order; stopped in reverse

    def _spawn(self, name: str, *cmd: str, user: str | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.out", "wb")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                user=user, group=user)
        self.started.append((name, proc))
        return proc

    def _munge_works(self) -> bool:
        encoded = quietly(which("munge"), "-n")
        return encoded.returncode == 0 and quietly(which("unmunge"), input=encoded.stdout).returncode == 0

    def start(self) -> None:
        d = self.folder
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        if not self._munge_works():  # a munged already running (a real node) is used as it is
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            self._spawn("munged", which("munged"), "--foreground", "--force", user="munge")
            wait_for("munged", self._munge_works, 20)

        db_port, dbd_port, ctld_port, slurmd_port = (free_port() for _ in range(4))
        password = os.urandom(8).hex()
        install = quietly(which("mariadb-install-db"), "--no-defaults", f"--datadir={d / 'mysql'}", "--user=root",
                          "--auth-root-authentication-method=normal")
        if install.returncode != 0:
            raise RuntimeError(f"mariadb-install-db failed: {install.stderr[-2000:]}")
        sock = d / "mysql.sock"
        self._spawn("mariadbd", which("mariadbd"), "--no-defaults", f"--datadir={d / 'mysql'}", "--user=root",
                    "--bind-address=127.0.0.1", f"--port={db_port}", f"--socket={sock}", f"--pid-file={d / 'mysql.pid'}",
                    "--skip-log-error")
        sql = [which("mariadb"), "--no-defaults", f"--socket={sock}", "-u", "root"]
        wait_for("MariaDB", lambda: quietly(*sql, "-e", "SELECT 1").returncode == 0, 60, self.logs / "mariadbd.out")
        grant = quietly(*sql, "-e", f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
                                    "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")
        if grant.returncode != 0:
            raise RuntimeError(f"MariaDB grant failed: {grant.stderr}")

        dbd = d / "slurmdbd.conf"
        dbd.write_text(f"""AuthType=auth/munge
DbdHost=localhost
DbdPort={dbd_port}
SlurmUser=root
PidFile={d / 'slurmdbd.pid'}
LogFile={self.logs / 'slurmdbd.log'}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=slurm
StoragePass={password}
StorageLoc=slurm_acct_db
""")
        dbd.chmod(0o600)
        cpus = os.cpu_count() or 1
        memory_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
        self.conf.write_text(f"""ClusterName=gaexptest
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldLogFile={self.logs / 'slurmctld.log'}
SlurmdLogFile={self.logs / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={dbd_port}
MailProg=/bin/true
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MpiDefault=none
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self._spawn("slurmdbd", which("slurmdbd"), "-D")
        wait_for("slurmdbd", lambda: _listening(dbd_port), 30, self.logs / "slurmdbd.log")
        self._spawn("slurmctld", which("slurmctld"), "-D", "-f", str(self.conf))
        self._spawn("slurmd", which("slurmd"), "-D", "-f", str(self.conf))
        wait_for("the node", lambda: self.run("sinfo", "-h", "-o", "%T").stdout.strip() == "idle", 60,
                 self.logs / "slurmctld.log")

    def run(self, *cmd: str) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return quietly(*cmd, env=self.env)

    def log(self, name: str = "slurmctld") -> str:
        path = self.logs / f"{name}.log"
        return path.read_text() if path.is_file() else ""

    def stop(self) -> None:
        """Cancel what is left, then TERM (later KILL) every daemon this cluster started, newest first."""
        jobs = self.run("squeue", "-h", "-o", "%i").stdout.split() if self.started else []
        if jobs:
            self.run("scancel", "--full", *jobs)
        for _, proc in reversed(self.started):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
        self.started.clear()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
