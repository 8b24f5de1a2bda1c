"""A pids cgroup per sandboxed execution: the process limit that holds as root (root ignores
``RLIMIT_NPROC``), and the list of every process the execution started, so all of them are
killed when it ends. cgroup v1's ``pids`` hierarchy is used where it is mounted (our machines),
else cgroup v2 where this process's own cgroup lets it make children with the pids controller.
"""
from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/pids")
V2_ROOT = Path("/sys/fs/cgroup")
_names = itertools.count()


def own_path(controller: str) -> str:
    """Return this process's cgroup path in the hierarchy of ``controller`` ("" for v2's)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    raise OSError(f"no {controller or 'unified'} cgroup in /proc/self/cgroup")


@functools.lru_cache(maxsize=1)
def parent_dir() -> Path:
    """Return the cgroup directory sandboxes are made in (looked up once per process); raises
    OSError saying why there is none."""
    if (V1_ROOT / "cgroup.procs").is_file():
        base = V1_ROOT / own_path("pids").lstrip("/")
    elif "pids" in _read(V2_ROOT / "cgroup.controllers").split():
        base = V2_ROOT / own_path("").lstrip("/")
        if "pids" not in _read(base / "cgroup.subtree_control").split():
            raise OSError(f"cgroup v2: the pids controller is not enabled for the children of {base}"
                          " (its cgroup.subtree_control)")
    else:
        raise OSError("no pids cgroup: neither cgroup v1's /sys/fs/cgroup/pids nor cgroup v2 with the pids"
                      " controller is mounted")
    if not os.access(base, os.W_OK):
        raise OSError(f"the pids cgroup {base} is not writable by this user")
    return base


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def stray_processes(user: int | None) -> set[int]:
    """Return the host processes (zombies included) that sandboxes left: those run by ``user``
    (the sandbox's, ``nobody`` as root; None: not checked) or in a sandbox cgroup."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("Uid:"))
            cgroups = (status.parent / "cgroup").read_text()
        except (OSError, StopIteration):
            continue
        if (user is not None and uid == str(user)) or "hybridlab-sandbox-" in cgroups:
            found.add(int(status.parent.name))
    return found


class PidsCgroup:
    """One execution's cgroup: at most ``limit`` processes; ``kill_all`` ends every one of them."""

    def __init__(self, limit: int):
        self.path = parent_dir() / f"hybridlab-sandbox-{os.getpid()}-{next(_names)}"
        self.path.mkdir()
        try:
            (self.path / "pids.max").write_text(str(limit))
        except OSError:
            self.path.rmdir()
            raise

    @property
    def procs_file(self) -> Path:
        """The file a process writes its pid to, to join."""
        return self.path / "cgroup.procs"

    def pids(self) -> list[int]:
        """Return the processes in the cgroup now."""
        try:
            return [int(p) for p in self.procs_file.read_text().split()]
        except FileNotFoundError:
            return []

    def kill_all(self, spare: int | None = None, within_s: float = 5.0) -> None:
        """SIGKILL every process in the cgroup but ``spare`` until none is left (a fork racing the
        kill is caught by the next round); raises RuntimeError if some survive ``within_s``."""
        deadline = time.monotonic() + within_s
        while pids := [p for p in self.pids() if p != spare]:
            for pid in pids:
                self._kill(pid)
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandbox processes {pids} outlived SIGKILL in {self.path}")
            time.sleep(0.002)

    def _kill(self, pid: int) -> None:
        """SIGKILL ``pid`` if it is still in this cgroup: the check goes through a pidfd opened
        first, so a number the kernel gave to another process meanwhile is never signalled."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            if f"/{self.path.name}\n" in Path(f"/proc/{pid}/cgroup").read_text():
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except (ProcessLookupError, FileNotFoundError):
            pass
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Kill what is left and remove the cgroup."""
        self.kill_all()
        for _ in range(100):  # the kernel frees the cgroup once its last process is reaped
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)
        self.path.rmdir()
