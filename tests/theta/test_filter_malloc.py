"""The filter process keeps memory it freed for its next allocations (theta.base.malloc.reuse_freed_memory):
a buffer of the same size allocated again costs no page faults, where glibc's defaults fault it in afresh,
also when another thread allocates it (one arena for all threads); and gives it back when asked
(give_back_freed_memory), before a group is held whole after a frame pass."""
import platform
import subprocess
import sys

import pytest

SCRIPT = r"""
import resource, sys
import numpy as np
from theta.base.malloc import reuse_freed_memory
if sys.argv[1] == "1":
    assert reuse_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = []
for _ in range(2):
    before = faults()
    a = np.empty(16 << 20, np.uint8)
    a.fill(1)
    del a
    out.append(faults() - before)
print(out[1])
"""


def second_allocation_faults(reuse: bool) -> int:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "1" if reuse else "0"], capture_output=True, text=True)
    if proc.returncode and "AssertionError" in proc.stderr:
        pytest.skip("no glibc mallopt here")
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


def test_a_freed_buffer_is_reused_without_page_faults():
    assert second_allocation_faults(reuse=True) < 50          # 16 MiB: 4096 pages, or 8 huge pages
    assert second_allocation_faults(reuse=False) > 200        # glibc's defaults: mapped and zeroed again


OTHER_THREAD = r"""
import resource, sys, threading
import numpy as np
from theta.base.malloc import reuse_freed_memory
if sys.argv[1] == "1":
    assert reuse_freed_memory()
elif sys.argv[1] == "git-theta":  # a `git theta` command's process (the merge driver, hooks, squash...)
    from theta.commands.cli import main
    sys.argv = ["git-theta", "--version"]
    try:
        main()
    except SystemExit:
        pass
def use():
    a = np.empty(16 << 20, np.uint8)
    a.fill(1)
    del a
use()  # allocated and freed by the main thread
seen = []
def worker():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    use()
    seen.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=worker)
t.start()
t.join()
print(seen[0])
"""


def other_thread_faults(how: str) -> int:
    proc = subprocess.run([sys.executable, "-c", OTHER_THREAD, how], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1])


def test_a_buffer_freed_by_one_thread_is_reused_by_another():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: no mallopt to call")
    assert other_thread_faults("1") < 50    # one arena: the main thread's freed 16 MiB, already mapped
    assert other_thread_faults("0") > 200  # glibc's defaults: a new arena for the thread, fresh pages


def test_every_git_theta_process_keeps_that_policy():
    """The merge driver, the hooks that materialize a checkout, squash: `git theta` processes run as the filter
    does (theta.commands.cli.main, when run as the console script)."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: no mallopt to call")
    assert other_thread_faults("git-theta") < 50


GIVE_BACK = r"""
import numpy as np
from theta.base.malloc import give_back_freed_memory, reuse_freed_memory
assert reuse_freed_memory()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
blocks = [np.ones(1 << 20, np.uint8) for _ in range(96)]  # 96 MiB of heap blocks (each under the threshold)
del blocks
kept = rss()
assert give_back_freed_memory()
print(kept - rss())
"""


def test_freed_memory_is_given_back_when_asked():
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: no mallopt / malloc_trim to call")
    proc = subprocess.run([sys.executable, "-c", GIVE_BACK], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 64 << 20  # most of the 96 MiB the process still held
