"""The launcher's ``git-theta filter-process``: a warm child serves git, else this process becomes the cold filter.

git waits for the filter's handshake before it sends a byte, so everything this process does first is on the
add's critical path. The launcher (:func:`theta.commands.install.launcher_script`) therefore starts it as::

    python -S -c 'import sys; del sys.path[0]; sys.path.append(ROOT); from theta.warm.launch import main; ...'
        ROOT COLD-COMMAND...

- ``-S``: no ``site``. The client needs nothing outside the standard library and :mod:`theta.warm`, and ``site``
  runs every ``.pth`` file of the environment (an editable install's finder, certificate hooks...): 5-40 ms.
- ``del sys.path[0]``: ``-c`` puts the working directory (the repository's work tree: untrusted) first on
  ``sys.path``; nothing may be imported from it.
- ``ROOT``: the directory holding the installed ``theta`` package, appended after the standard library and
  ``PYTHONPATH`` (which keep their precedence, as in a cold filter).

With no warm server to take git's pipes (the first filter, ``GIT_THETA_WARM=0``, a refused request), the process
execs ``COLD-COMMAND filter-process``: the console script, with ``site``, exactly as before the light start.
Nothing has been read from git's pipe by then. The key this process asks for is the one the cold filter leaves
its server under (:func:`theta.warm.key` is the same with and without ``site``).
"""
from __future__ import annotations

import os
import sys


def main(cold: list[str]) -> None:
    """Serve git through a warm server and exit with its child's status, or exec ``cold + ["filter-process"]``."""
    from theta import warm

    if warm.enabled():
        from theta.warm.client import run

        code = run([])
        if code is not None:  # (git waits for this exit: no interpreter teardown)
            sys.stderr.flush()
            os._exit(code)
    try:
        os.execv(cold[0], [*cold, "filter-process"])
    except (OSError, IndexError) as e:
        print(f"git-theta: error: cannot start the filter {' '.join(cold)!r}: {e}; run `git theta install` again",
              file=sys.stderr)
        sys.exit(127)
