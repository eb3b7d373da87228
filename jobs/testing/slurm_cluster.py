"""A real SLURM (Debian's slurm-wlm 22.05) on one machine, for testing the job templates.

``SlurmCluster(root, nodes=N)`` writes its own ``slurm.conf`` + ``gres.conf`` under ``root``
(state, spool, logs, munge socket too), starts munged, slurmctld and N ``slurmd -N nNNN`` (one per
emulated node, each on its own port), waits until every node is idle, and stops all of them by
pid (never by name). Client commands see it through ``SLURM_CONF`` (:meth:`env`).

What makes it work on a container without systemd or cgroups (facts from this kind of machine):
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
``JobAcctGatherType=jobacct_gather/none``; ``SlurmdParameters=config_overrides`` lets a node
claim more CPUs and GPUs than exist; fake GPUs are gres files that are symlinks to /dev/null (SLURM
still sets CUDA_VISIBLE_DEVICES per task); ``AuthInfo=...,cred_expire=10`` cuts the requeue delay
from ~120 s to ~11 s.

Command line (for poking at it by hand)::

    python jobs/testing/slurm_cluster.py start DIR --nodes 4   # prints `export SLURM_CONF=...`
    python jobs/testing/slurm_cluster.py stop DIR
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# libpmix2 + libpmix-dev: slurm's mpi/pmix plugin dlopens pmix2/lib/libpmix.so, which only the
# -dev package provides; without it `srun --mpi=pmix` fails ("can not load PMIx library").
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "slurm-wlm-torque", "libpmix2",
            "libpmix-dev")
MUNGE_KEY = Path("/etc/munge/munge.key")


def install(quiet: bool = True) -> None:
    """apt-get install Debian's SLURM + munge (+ torque wrappers for qsub/#PBS, PMIx) if missing."""
    q = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}\\n", *PACKAGES],
                       capture_output=True, text=True)
    if q.returncode == 0 and all(l.startswith("ii") for l in q.stdout.split("\n") if l):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    out = subprocess.DEVNULL if quiet else None
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, stdout=out)
    subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], check=True, env=env, stdout=out)


def _free_port_base(count: int) -> int:
    """A base port with ``count + 1`` free TCP ports above it (controller + one per slurmd)."""
    for base in range(20000, 60000, 1000):
        ok = True
        for port in (base, base + 1, base + count + 1):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range for the test cluster")


class SlurmCluster:
    """An emulated cluster of ``nodes`` nodes × ``cpus`` CPUs × ``gpus`` fake GPUs."""

    def __init__(self, root: str | Path, nodes: int = 2, cpus: int = 64, gpus: int = 8,
                 partitions: tuple[str, ...] = ("batch", "gpu")) -> None:
        self.root = Path(root).resolve()
        self.nodes = nodes
        self.cpus = cpus
        self.gpus = gpus
        self.partitions = partitions
        self.names = [f"n{i:03d}" for i in range(1, nodes + 1)]
        self.procs: list[subprocess.Popen] = []
        self.conf = self.root / "etc" / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"

    # -- configuration -------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment for client commands (sbatch, squeue, ...) that talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        r = self.root
        for d in ("etc", "state", "log", "munge", "dev", *(f"spool/{n}" for n in self.names), *(f"tmp/{n}" for n in self.names)):
            (r / d).mkdir(parents=True, exist_ok=True)
        for i in range(self.gpus):
            dev = r / "dev" / f"gpu{i}"
            if not dev.is_symlink():
                dev.symlink_to("/dev/null")
        base = _free_port_base(self.nodes)
        self.ctld_port = base
        host = socket.gethostname()
        last = self.names[-1][1:]
        nodeset = f"n[001-{last}]" if self.nodes > 1 else "n001"
        ports = f"[{base + 1}-{base + self.nodes}]" if self.nodes > 1 else str(base + 1)
        lines = [
            "ClusterName=hpclbtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={base}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            f"TmpFS={r}/tmp/%n",
            # no systemd, no cgroups
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "SwitchType=switch/none", "MpiDefault=none", "LaunchParameters=use_interactive_step",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "GresTypes=gpu",
            "ReturnToService=2", "SlurmdTimeout=300", "SlurmctldTimeout=60", "InactiveLimit=0",
            "KillWait=10", "MinJobAge=600", "MessageTimeout=30",
            "JobRequeue=1",
            "SchedulerParameters=bf_interval=1,sched_min_interval=100000",
            f"NodeName={nodeset} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports} "
            f"CPUs={self.cpus} Boards=1 SocketsPerBoard=2 CoresPerSocket={self.cpus // 2} "
            f"ThreadsPerCore=1 RealMemory=512000 Gres=gpu:{self.gpus} State=UNKNOWN",
        ]
        for i, p in enumerate(self.partitions):
            lines.append(f"PartitionName={p} Nodes=ALL Default={'YES' if i == 0 else 'NO'} "
                         f"MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf.write_text("\n".join(lines) + "\n")
        gpus = f"{r}/dev/gpu[0-{self.gpus - 1}]" if self.gpus > 1 else f"{r}/dev/gpu0"
        (r / "etc" / "gres.conf").write_text(
            f"NodeName={nodeset} Name=gpu File={gpus}\n" if self.gpus else "")

    # -- daemons -------------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen:
        f = open(self.root / "log" / log, "ab")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=self.env(),
                             start_new_session=True)
        f.close()
        self.procs.append(p)
        with (self.root / "pids").open("a") as pf:
            pf.write(f"{p.pid} {argv[0]}\n")
        return p

    def start(self, timeout: float = 120.0) -> "SlurmCluster":
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> "SlurmCluster":
        install()
        self._write_config()
        key = self.root / "munge" / "munge.key"
        shutil.copy(MUNGE_KEY, key)
        os.chmod(key, 0o600)
        os.chmod(self.root / "munge", 0o755)
        self._spawn(["munged", "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
                     f"--pid-file={self.root}/munge/munged.pid",
                     f"--log-file={self.root}/log/munged.log",
                     f"--seed-file={self.root}/munge/munged.seed"], "munged.out")
        self._wait(lambda: self.munge_socket.exists(), 20, "munged socket")
        self._spawn(["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)], "slurmctld.out")
        self._wait(lambda: self._run(["scontrol", "ping"], check=False).returncode == 0, 60,
                   "slurmctld to answer `scontrol ping`")
        for n in self.names:
            self._spawn(["slurmd", "-D", "-N", n, "-f", str(self.conf)], f"slurmd-{n}.out")
        self._wait(self._all_idle, timeout, f"{self.nodes} nodes to become idle")
        return self

    def _all_idle(self) -> bool:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}; see {self.root}/log")
        out = self._run(["sinfo", "-h", "-N", "-p", self.partitions[0], "-o", "%N %t"],
                        check=False).stdout
        states = [line.split()[1] for line in out.splitlines() if line.strip()]
        return len(states) == self.nodes and all(s == "idle" for s in states)

    def _wait(self, cond, timeout: float, what: str) -> None:
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                self.stop()
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; "
                                   f"logs in {self.root}/log")
            time.sleep(0.2)

    def _run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env=self.env(), check=check,
                              **kw)

    def stop(self) -> None:
        """Cancel every job, then stop every daemon this object started, by pid (slurmds,
        slurmctld, munged), then any process left that carries this cluster's SLURM_CONF in its
        environment (slurmstepd and job processes outlive a stopped slurmd by design)."""
        if self.procs and all(p.poll() is None for p in self.procs[:2]):
            self._run(["scancel", "--full", "--user", "root"], check=False, timeout=30)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20:
                states = self._run(["squeue", "-h", "-o", "%T"], check=False, timeout=30).stdout
                if not any(s in states for s in ("RUNNING", "COMPLETING", "CONFIGURING")):
                    break
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = self._leftovers()
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if left:
                time.sleep(1.0)

    def _leftovers(self) -> list[int]:
        """Pids of live processes whose environment names this cluster's slurm.conf."""
        tag = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                if tag in (d / "environ").read_bytes().split(b"\0") and \
                        " Z " not in (d / "stat").read_text().split(")")[-1][:4]:
                    pids.append(int(d.name))
            except OSError:
                continue
        return pids

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- helpers for tests ---------------------------------------------------------------------
    def sbatch(self, *args: str, cwd: str | Path | None = None) -> str:
        """Submit; returns the job id."""
        r = self._run(["sbatch", "--parsable", *args], check=False, cwd=cwd)
        if r.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {r.stderr.strip()}")
        return r.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, ...), from squeue or scontrol."""
        r = self._run(["scontrol", "show", "job", job, "-o"], check=False)
        for field in r.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job: str, name: str) -> str | None:
        r = self._run(["scontrol", "show", "job", job, "-o"], check=False)
        for field in r.stdout.split():
            if field.startswith(name + "="):
                return field.split("=", 1)[1]
        return None

    def wait_state(self, job: str, states: set[str], timeout: float) -> str:
        """Poll (``sbatch --wait`` adds ~10 s) until the job is in one of ``states``."""
        t0 = time.monotonic()
        while True:
            s = self.job_state(job)
            if s in states:
                return s
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"job {job} still {s} after {timeout:.0f} s (wanted {states})")
            time.sleep(0.25)


def stop_from_pidfile(root: Path) -> None:
    """Stop the daemons listed in ROOT/pids (started by `start` from the command line)."""
    pids = root / "pids"
    if not pids.exists():
        return
    for line in reversed(pids.read_text().splitlines()):
        pid = int(line.split()[0])
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    pids.unlink()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("action", choices=("start", "stop"))
    p.add_argument("dir")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--cpus", type=int, default=64)
    a = p.parse_args()
    if a.action == "start":
        c = SlurmCluster(a.dir, a.nodes, a.cpus, a.gpus).start()
        print(f"export SLURM_CONF={c.conf}")
        for proc in c.procs:  # leave them running; `stop` kills them by the pids file
            proc.returncode = 0
        os._exit(0)
    stop_from_pidfile(Path(a.dir).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
