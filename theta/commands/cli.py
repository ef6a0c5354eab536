"""`git theta ...` and `git-theta-filter`: the console scripts' entry points, kept light.

git starts ``git-theta filter-process`` for every add and checkout and waits for its handshake: that path
imports the filter alone (no typer, no command tree: ~40 ms less before git sends a byte); the post-checkout
and post-index-change hooks, called as git calls them, likewise (:func:`theta.commands.entry.hook_main`). Every
other command is the typer app of :mod:`theta.commands.app` (its names -- ``app``, ``_register_areas``... -- are
reachable from here too). User commands are listed by ``git theta -h``; the ones git runs (filter-process,
clean, smudge, merge-driver, diff-driver, diff-textconv, pre-push) are hidden. Every ThetaError becomes
``git theta: error: <message>`` on one line and exit status 1; a usage error names the flag and exits with
status 2.
"""
from __future__ import annotations

import sys

from theta.commands.entry import (EXIT_INTERRUPTED, EXIT_USAGE, FILTER_HELP, PROG, SCRIPT, filter_main,  # noqa: F401
                                  hook_main, is_hook_call, reuse_freed_memory, single_threaded_blas, version)


def main(argv: list[str] | None = None) -> int:
    """The `git-theta` entry point; returns the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["filter-process"]:  # the hot path git starts for every add/checkout: skip building the CLI
        return filter_main([])
    if argv is None:  # a process of its own (the merge driver, the hooks materializing checkouts, squash...):
        reuse_freed_memory()  # the filter's memory policy (not in a caller's process, e.g. tests)
    if is_hook_call(args):  # git runs these after every checkout: skip building the CLI too
        return hook_main(args)
    from theta.commands.app import run

    return run(args)


def __getattr__(name: str):
    """The typer app's names (``app``, ``_app``, ``_register_areas``, ``_INTERNAL``...), imported on first use."""
    if name.startswith("__"):
        raise AttributeError(name)
    from theta.commands import app as typer_app

    try:
        return getattr(typer_app, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


if __name__ == "__main__":
    sys.exit(main())
