"""Run model-written code in a sandbox: each execution in its own process tree under bubblewrap
(Debian's ``bwrap``), as an unprivileged user, in a pids cgroup, with resource limits.

What an execution gets (``Sandbox.run``):

- new user, PID, network, IPC, UTS and cgroup namespaces (``--unshare-all``): no network at all
  (not even the host's loopback), no view of the host's processes, no nested user namespaces;
- a filesystem of ``/usr`` (the interpreter and its packages) and the ``read_only`` directories,
  read-only; its program at ``/code`` (read-only); a fresh tmpfs of ``file_mb`` at ``/sandbox``
  as its only writable place and working directory; ``/proc`` of its own and a minimal ``/dev``.
  The run directory, home directories, the host's ``/tmp`` and the repository are absent;
- an empty environment (``PATH``, ``HOME``, ``LANG`` set to fixed values), so no tokens or keys;
- limits: CPU time, address space, file size, open files (rlimits, which hold for any user),
  processes (the pids cgroup: root ignores ``RLIMIT_NPROC``), wall time and output size (the
  parent ends it); as root it runs as ``nobody``, so it cannot read root's files or signal the
  trainer; everything it started is killed when it ends (the cgroup, and the PID namespace).

What it does not protect against: kernel exploits (it shares the host kernel), CPU and memory
bandwidth contention with the trainer, and side channels.
"""
from __future__ import annotations

import os
import selectors
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hybridlab.config.schema import SandboxConfig
from hybridlab.errors import UserError
from hybridlab.sandbox.cgroup import PidsCgroup, parent_dir

NOBODY = 65534
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "LANG": "C.UTF-8"}


class SandboxUnavailable(UserError):
    """The sandbox cannot run here; the message names what is missing."""


@dataclass
class Execution:
    """What one sandboxed execution did."""
    exit_code: int | None       # None when the sandbox ended it (wall time, output size)
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False     # the wall limit ended it
    output_exceeded: bool = False  # it wrote more than output_kb to stdout or stderr

    @property
    def ok(self) -> bool:
        """True when the program ran to exit status 0 within its limits."""
        return self.exit_code == 0 and not self.timed_out and not self.output_exceeded


class Sandbox:
    """Runs programs under ``config``'s limits; raises SandboxUnavailable (naming what is
    missing) when built where isolation cannot be had. It never runs code without it."""

    def __init__(self, config: SandboxConfig = SandboxConfig()):
        self.config = config
        self.bwrap, self.prlimit, self.setpriv = shutil.which("bwrap"), shutil.which("prlimit"), shutil.which("setpriv")
        self.user = NOBODY if os.geteuid() == 0 else None  # root runs the code as nobody
        check_available(self)

    def run_python(self, source: str, stdin: str = "", files: dict[str, str] | None = None) -> Execution:
        """Run Python ``source`` (as /code/main.py, with ``files`` beside it) on ``stdin``."""
        return self.run([self.config.python, "-I", "-B", "/code/main.py"], stdin, {"main.py": source, **(files or {})})

    def run(self, argv: list[str], stdin: str = "", files: dict[str, str] | None = None) -> Execution:
        """Run ``argv`` in a fresh sandbox with ``files`` (name -> text) in /code; returns the Execution."""
        c = self.config
        code = Path(tempfile.mkdtemp(prefix="hybridlab-sandbox-"))
        group = None
        try:
            for name, text in (files or {}).items():
                (code / name).write_text(text, encoding="utf-8")
            (code / ".stdin").write_text(stdin, encoding="utf-8")
            os.chmod(code, 0o755)
            for p in code.iterdir():
                os.chmod(p, 0o644)
            group = PidsCgroup(c.processes)
            return self._execute(self._command(argv, code, group), code / ".stdin", group)
        finally:
            try:
                if group is not None:
                    group.remove()
            finally:
                shutil.rmtree(code, ignore_errors=True)

    def _command(self, argv: list[str], code: Path, group: PidsCgroup) -> list[str]:
        c = self.config
        limits = [f"--cpu={max(1, int(c.cpu_s))}", f"--as={c.memory_mb << 20}", f"--fsize={c.file_mb << 20}",
                  f"--nofile={c.open_files}", "--core=0"]
        mounts = ["--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
                  "--symlink", "usr/bin", "/bin", "--symlink", "usr/sbin", "/sbin", "--proc", "/proc", "--dev", "/dev",
                  "--ro-bind", str(code), "/code", "--size", str(c.file_mb << 20), "--tmpfs", "/sandbox",
                  "--chdir", "/sandbox"]
        for path in c.read_only:
            mounts += ["--ro-bind", str(path), str(path)]
        mounts += ["--remount-ro", "/", "--remount-ro", "/dev"]  # /sandbox stays its only writable place
        # --as-pid-1: the program is its PID namespace's init, so everything in there dies with it;
        # bwrap's own init would be left unreaped when bwrap runs unprivileged (a zombie per run)
        bwrap = [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1", "--die-with-parent",
                 "--new-session", "--clearenv", *[a for k, v in ENV.items() for a in ("--setenv", k, v)], *mounts]
        # the launcher joins the cgroup before anything else runs, then becomes setpriv (as root: the
        # unprivileged user), prlimit and bwrap; one small process throughout, started with vfork
        user = [] if self.user is None else [self.setpriv, f"--reuid={self.user}", f"--regid={self.user}",
                                             "--clear-groups"]
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs_file),
                *user, self.prlimit, *limits, "--", *bwrap, "--", *argv]

    def _execute(self, command: list[str], stdin: Path, group: PidsCgroup) -> Execution:
        c, start = self.config, time.monotonic()
        with open(stdin, "rb") as given:
            proc = subprocess.Popen(command, stdin=given, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                                    cwd="/", close_fds=True, start_new_session=True)
        out, timed_out, exceeded = read_output(proc, start + c.wall_s, c.output_kb << 10)
        # everything inside first: bwrap (the launcher's process) then reaps its child and exits,
        # where killed with the rest its child would be left to the host's init, unreaped
        group.kill_all(spare=proc.pid)
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            group.kill_all()
            code = proc.wait()
        ended = timed_out or exceeded
        return Execution(None if ended else code, out[0].decode(errors="replace"), out[1].decode(errors="replace"),
                         time.monotonic() - start, timed_out, exceeded)


def read_output(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[list[bytes], bool, bool]:
    """Read the process's stdout and stderr until both close, the deadline passes or either
    passes ``cap`` bytes; returns ([stdout, stderr], timed out, over the cap)."""
    chunks: list[list[bytes]] = [[], []]
    sizes = [0, 0]
    with selectors.DefaultSelector() as selector:
        for i, stream in enumerate((proc.stdout, proc.stderr)):
            selector.register(stream, selectors.EVENT_READ, i)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return [b"".join(c) for c in chunks], True, False
            for key, _ in selector.select(timeout=min(left, 0.05)):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                i = key.data
                chunks[i].append(data[: max(0, cap - sizes[i])])
                sizes[i] += len(data)
                if sizes[i] > cap:
                    return [b"".join(c) for c in chunks], False, True
    return [b"".join(c) for c in chunks], False, False


def check_available(sandbox: Sandbox) -> None:
    """Raise SandboxUnavailable naming what is missing: bwrap, prlimit, setpriv, the interpreter,
    a read-only directory, a pids cgroup, or user namespaces (bwrap's trial run)."""
    c, missing = sandbox.config, []
    if sandbox.bwrap is None:
        missing.append("bubblewrap's bwrap (Debian: apt-get install bubblewrap; make install installs it as root)")
    missing += [f"util-linux's {name}" for name in ("prlimit", "setpriv") if getattr(sandbox, name) is None]
    if not Path(c.python).is_file():
        missing.append(f"the interpreter sandbox.python={c.python}")
    missing += [f"the directory {path} of sandbox.read_only" for path in c.read_only if not Path(path).is_dir()]
    try:
        parent_dir()
    except OSError as exc:
        missing.append(str(exc))
    if missing:
        raise SandboxUnavailable("code cannot be run in a sandbox here, and hybridlab never runs it without one;"
                                 " missing: " + "; ".join(missing))
    trial = sandbox.run(["/bin/true"])
    if trial.exit_code != 0:
        raise SandboxUnavailable("bubblewrap cannot make its namespaces here (are unprivileged user namespaces"
                                 f" allowed? sysctl user.max_user_namespaces): {trial.stderr.strip()[:300]}")
