"""What a run records of its machine, and the cores it sizes its threads by."""
import os
import subprocess
import sys


def test_usable_cores_follow_the_affinity_mask_not_the_machine():
    """A process limited to one core (taskset, a cgroup cpuset, Slurm) sizes its threads by that
    core: usable_cores() is 1 there, while the record keeps the machine's count beside it."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
            " from hybridlab.environment import describe, usable_cores; env = describe();"
            " print(usable_cores(), env['usable_cores'], env['cores'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "1", str(os.cpu_count())]
