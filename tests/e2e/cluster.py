"""A throwaway two-host cluster on one machine, for tests that launch through pdsh, Open MPI and slurm.

Everything lives in a network namespace the cluster creates (only a loopback device, brought up with
127.0.0.2 and 127.0.0.3 added to it), so no daemon is reachable from outside and no test traffic leaves
it; inside it, 127.0.0.2 and 127.0.0.3 stand for the two hosts:

- ssh: an sshd listening on both addresses, a generated host key and client key, and an `ssh` on PATH
  that adds the cluster's client config (key, no known_hosts prompts). Root's own ~/.ssh is not touched.
- slurm: a slurmctld and two slurmd (nodes n1 = 127.0.0.2 and n2 = 127.0.0.3, two CPUs each, auth/none:
  nothing outside the namespace can reach them) started from a generated slurm.conf; SLURM_CONF points
  the client commands (sbatch, srun, sinfo) at it.

Commands run inside the namespace through `Cluster.run` / `Cluster.popen`. `close()` stops every daemon
(SIGTERM, then SIGKILL), closes the namespace and removes the directory; the daemons and the namespace
also end with the test process (parent-death signal, and the namespace holder exits when its stdin closes).
Every wait is bounded. Where the machine cannot provide a cluster (not root, no network namespaces,
packages missing), `skip_reason()` says why in one line and the tests skip."""

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from tests.accelerator import deepspeed_accelerator_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTS = ("127.0.0.2", "127.0.0.3")
SLURM_NODES = ("n1", "n2")
PACKAGES = "iproute2 openssh-server pdsh openmpi-bin slurm-wlm"
"""The Debian packages that provide the programs below (.ci/run installs them)."""
PROGRAMS = {
    "ip": ("ip",),
    "pdsh": ("/usr/sbin/sshd", "ssh", "ssh-keygen", "pdsh"),
    "openmpi": ("/usr/sbin/sshd", "ssh", "ssh-keygen", "mpirun", "ompi_info", "orted"),
    "slurm": ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "scancel"),
}
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
SSHD_PORT = 22
SLURMCTLD_PORT = 6817
SLURMD_PORTS = (6818, 6819)

_libc = ctypes.CDLL(None, use_errno=True)


def skip_reason(kind: str) -> Optional[str]:
    """Why this machine cannot build a cluster for `kind` (a PROGRAMS key), or None when it can."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "multi-node launch tests need Linux"
    if os.geteuid() != 0:
        return "multi-node launch tests need root (they start sshd / slurmd in a network namespace)"
    missing = [p for p in PROGRAMS["ip"] + PROGRAMS[kind] if shutil.which(p) is None]
    if missing:
        return (f"{', '.join(missing)} not installed; apt-get install -y {PACKAGES} (.ci/run does it)")
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({CLONE_NEWNET}))"
    probe = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30)
    if probe.returncode != 0:
        return "cannot create a network namespace here (unshare(CLONE_NEWNET) failed)"
    return None


HOLDER = f"""
import ctypes, subprocess, sys
if ctypes.CDLL(None, use_errno=True).unshare({CLONE_NEWNET}) != 0:
    sys.exit("unshare(CLONE_NEWNET) failed")
subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=30)
# The hosts' addresses on lo (besides 127.0.0.1): glibc's getaddrinfo(AI_ADDRCONFIG), which slurm uses, finds
# no IPv4 address on a machine whose only one is 127.0.0.1.
for host in {list(HOSTS)!r}:
    subprocess.run(["ip", "addr", "add", host + "/8", "dev", "lo"], check=True, timeout=30)
print("ready", flush=True)
sys.stdin.read()
"""
"""The namespace holder: creates the namespace, brings lo up with the hosts' addresses, and lives until its
stdin closes."""


class ClusterError(RuntimeError):
    """The cluster could not be started; the message says which daemon and shows its log."""


class Cluster:
    """A two-host cluster in its own network namespace (see the module docstring)."""

    def __init__(self, directory: Optional[str] = None) -> None:
        self.dir = Path(directory or tempfile.mkdtemp(prefix="neox-cluster-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._daemons: List[subprocess.Popen] = []
        self._created_run_sshd = False
        self.sshd_running = False
        self.slurm_running = False
        self.env: Dict[str, str] = {}
        self.holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
        line = self._readline(self.holder, 30)
        if line.strip() != "ready":
            _stop(self.holder)
            why = self.holder.stderr.read().strip() or line
            self.close()
            raise ClusterError(f"the network namespace could not be set up: {why}")
        self.netns = f"/proc/{self.holder.pid}/ns/net"
        self.bin = self.dir / "bin"
        self.bin.mkdir(exist_ok=True)
        self.env.update({
            "PATH": f"{self.bin}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **deepspeed_accelerator_env(), "OMP_NUM_THREADS": "1",
            # the namespace has only lo: gloo would look for the address the host name resolves to
            "GLOO_SOCKET_IFNAME": "lo",
            # Open MPI: mpirun as root, and its daemons' own connections over lo (by default it skips loopback)
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_oob_tcp_if_include": "lo",
        })

    @staticmethod
    def _readline(proc: subprocess.Popen, timeout: float) -> str:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                return "<timeout>"
        return proc.stdout.readline()

    # ---- running commands inside the namespace ----------------------------------------------------------
    def _enter(self) -> None:
        """preexec_fn: join the namespace; die with the parent."""
        fd = os.open(self.netns, os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                os._exit(126)
        finally:
            os.close(fd)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def full_env(self, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        return {**os.environ, **self.env, **(extra or {})}

    def popen(self, argv: Sequence[str], extra_env: Optional[Dict[str, str]] = None, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(list(argv), env=self.full_env(extra_env), preexec_fn=self._enter, **kwargs)

    def run(self, argv: Sequence[str], extra_env: Optional[Dict[str, str]] = None, timeout: float = 600,
            **kwargs) -> subprocess.CompletedProcess:
        """Run a command inside the namespace (stdout and stderr captured as text)."""
        proc = self.popen(argv, extra_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            out, err = proc.communicate()
            err += f"\n[cluster] killed after {timeout} s"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def _daemon(self, argv: Sequence[str], log: Path) -> subprocess.Popen:
        handle = open(log, "ab")
        try:
            proc = self.popen(argv, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT)
        finally:
            handle.close()
        self._daemons.append(proc)
        return proc

    def _wait_for_port(self, host: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
        """Until a daemon accepts connections on host:port (inside the namespace); fails fast if it exits."""
        probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
        deadline = time.time() + timeout
        while time.time() < deadline and proc.poll() is None:
            if self.run([sys.executable, "-S", "-c", probe], timeout=10).returncode == 0:
                return
            time.sleep(0.2)
        state = (f"exited with status {proc.returncode}" if proc.poll() is not None
                 else f"not listening after {timeout} s")
        raise ClusterError(f"{Path(proc.args[0]).name} on {host}:{port}: {state}; its log ({log}):\n{_tail(log)}")

    def deepy(self, argv: Sequence[str], extra_env: Optional[Dict[str, str]] = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
        """`python deepy.py ARGV` from the repository, inside the namespace (as a user on the first host)."""
        return self.run([sys.executable, "deepy.py", *argv], extra_env, timeout=timeout, cwd=REPO)

    # ---- ssh ------------------------------------------------------------------------------------------------
    def start_sshd(self) -> None:
        """sshd on HOSTS port 22 (inside the namespace), root login with a generated key (once)."""
        if self.sshd_running:
            return
        ssh_dir = self.dir / "ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        for name in ("host_key", "client_key"):
            if not (ssh_dir / name).exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"neox-test-{name}",
                                "-f", str(ssh_dir / name)], check=True, capture_output=True, timeout=30)
        shutil.copy(ssh_dir / "client_key.pub", ssh_dir / "authorized_keys")
        (ssh_dir / "sshd_config").write_text("\n".join([
            f"Port {SSHD_PORT}", *(f"ListenAddress {h}" for h in HOSTS), f"HostKey {ssh_dir / 'host_key'}",
            f"PidFile {ssh_dir / 'sshd.pid'}", f"AuthorizedKeysFile {ssh_dir / 'authorized_keys'}",
            "StrictModes no", "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
            "PermitRootLogin prohibit-password", "PrintMotd no", "PrintLastLog no", "UseDNS no",
            "MaxStartups 100:30:200", "LogLevel ERROR", ""]))
        (ssh_dir / "ssh_config").write_text("\n".join([
            "Host *", f"  IdentityFile {ssh_dir / 'client_key'}", "  IdentitiesOnly yes", "  BatchMode yes",
            "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null", "  LogLevel ERROR",
            "  ConnectTimeout 10", ""]))
        wrapper = self.bin / "ssh"
        wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {ssh_dir / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)
        if not os.path.isdir("/run/sshd"):  # sshd's privilege separation directory (Debian's service creates it)
            os.makedirs("/run/sshd", mode=0o755)
            self._created_run_sshd = True
        log = self.dir / "sshd.log"
        proc = self._daemon(["/usr/sbin/sshd", "-D", "-e", "-f", str(ssh_dir / "sshd_config")], log)
        for host in HOSTS:
            self._wait_for_port(host, SSHD_PORT, proc, log)
        check = self.run(["ssh", HOSTS[1], "true"], timeout=30)
        if check.returncode != 0:
            raise ClusterError(f"ssh {HOSTS[1]} true failed: {check.stderr.strip()}; sshd log:\n{_tail(log)}")
        self.sshd_running = True

    def hostfile(self, slots: int = 1, hosts: Sequence[str] = HOSTS) -> str:
        path = self.dir / f"hostfile_{len(hosts)}x{slots}"
        path.write_text("".join(f"{h} slots={slots}\n" for h in hosts))
        return str(path)

    # ---- slurm ----------------------------------------------------------------------------------------------
    def start_slurm(self) -> None:
        """slurmctld and one slurmd per node; waits until both nodes are idle (once)."""
        if self.slurm_running:
            return
        sdir = self.dir / "slurm"
        for sub in ("state", "spool"):
            (sdir / sub).mkdir(parents=True, exist_ok=True)
        (sdir / "plugstack.conf").write_text("")
        nodes = [f"NodeName={n} NodeAddr={h} NodeHostname={n} Port={p} CPUs=2 RealMemory=1000 State=UNKNOWN"
                 for n, h, p in zip(SLURM_NODES, HOSTS, SLURMD_PORTS)]
        conf = sdir / "slurm.conf"
        conf.write_text("\n".join([
            "ClusterName=neoxtest", f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
            f"SlurmctldPort={SLURMCTLD_PORT}",
            f"SlurmdPort={SLURMD_PORTS[0]}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/none", "CredType=cred/none",
            f"StateSaveLocation={sdir / 'state'}", f"SlurmdSpoolDir={sdir / 'spool'}/%n",
            f"SlurmctldPidFile={sdir / 'slurmctld.pid'}", f"SlurmdPidFile={sdir / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={sdir / 'slurmctld.log'}", f"SlurmdLogFile={sdir / 'slurmd-%n.log'}",
            f"PlugStackConfig={sdir / 'plugstack.conf'}",
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "SwitchType=switch/none", "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "ReturnToService=2", "SlurmdParameters=config_overrides",
            "MailProg=/bin/true", "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5",
            *nodes, f"PartitionName=test Nodes={','.join(SLURM_NODES)} Default=YES MaxTime=60 State=UP", ""]))
        self.env["SLURM_CONF"] = str(conf)
        ctl_log = sdir / "slurmctld.out"
        ctl = self._daemon(["slurmctld", "-D", "-i", "-f", str(conf)], ctl_log)
        self._wait_for_port("127.0.0.1", SLURMCTLD_PORT, ctl, ctl_log)
        for node, host, port in zip(SLURM_NODES, HOSTS, SLURMD_PORTS):
            log = sdir / f"slurmd-{node}.out"
            proc = self._daemon(["slurmd", "-D", "-N", node, "-f", str(conf)], log)
            self._wait_for_port(host, port, proc, log)
        deadline = time.time() + 60
        state = ""
        while time.time() < deadline:
            state = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20).stdout
            if sorted(line.split()[1] for line in state.splitlines() if line.strip()) == ["idle", "idle"]:
                self.slurm_running = True
                return
            time.sleep(0.5)
        raise ClusterError(f"slurm nodes not idle after 60 s: {state!r}; slurmctld log:\n"
                           f"{_tail(sdir / 'slurmctld.log')}")

    def sbatch(self, script: str, args: Sequence[str], options: Sequence[str] = (),
               extra_env: Optional[Dict[str, str]] = None, timeout: float = 600) -> subprocess.CompletedProcess:
        """Submit a batch script from the repository and wait for the job; the result's stdout is the job's
        output, its returncode the job's exit status (124 if it ran past `timeout` and was cancelled)."""
        output = self.dir / f"job-{time.time_ns()}.out"
        submitted = self.run(["sbatch", "--parsable", f"--output={output}", *options, script, *args], extra_env,
                             timeout=30, cwd=REPO)
        if submitted.returncode != 0:
            return submitted
        job = submitted.stdout.strip().split(";")[0]
        deadline = time.time() + timeout
        state, code = "PENDING", 124
        while time.time() < deadline:
            fields = dict(f.split("=", 1) for f in self.run(["scontrol", "-o", "show", "job", job], timeout=20)
                          .stdout.split() if "=" in f)
            state = fields.get("JobState", state)
            if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                exit_status, _, signal_number = fields.get("ExitCode", "1:0").partition(":")
                code = int(exit_status) or (128 + int(signal_number or 0) if signal_number != "0" else 0)
                break
            time.sleep(0.5)
        else:
            self.run(["scancel", job], timeout=20)
        text = output.read_text(errors="replace") if output.is_file() else ""
        if code == 124:
            text += f"\n[cluster] job {job} still {state} after {timeout} s; cancelled"
        elif state != "COMPLETED":
            text += f"\n[cluster] job {job} ended {state}"
        return subprocess.CompletedProcess([script, *args], code, text, "")

    # ---- teardown -------------------------------------------------------------------------------------------
    def _namespace_processes(self) -> List[int]:
        """Every process in the cluster's namespace but its holder (jobs' steps outlive slurmd, for one)."""
        try:
            ours = os.readlink(self.netns)
        except OSError:
            return []
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.holder.pid:
                try:
                    if os.readlink(f"/proc/{entry}/ns/net") == ours:
                        pids.append(int(entry))
                except OSError:
                    pass
        return pids

    def close(self) -> None:
        if self.slurm_running:
            self.run(["scancel", "--full", "--partition=test"], timeout=20)
        for proc in reversed(self._daemons):
            _stop(proc)
        self._daemons.clear()
        if getattr(self, "netns", None):
            for pid in self._namespace_processes():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.holder.poll() is None:
            try:
                self.holder.stdin.close()
                self.holder.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                _stop(self.holder)
        for stream in (self.holder.stdout, self.holder.stderr):
            if stream:
                stream.close()
        if self._created_run_sshd:
            try:
                os.rmdir("/run/sshd")
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(proc: subprocess.Popen, grace: float = 10) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"
