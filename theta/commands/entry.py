"""The light pieces of theta's entry points, shared by :mod:`theta.commands.cli` (the console scripts) and
:mod:`theta.commands.app` (the typer app): names, the version, and git's filter process, which starts
without typer or the command tree (git waits for its handshake before it sends a byte)."""
from __future__ import annotations

import os
import sys

from theta.base.malloc import reuse_freed_memory  # (the filter's memory policy: theta.base.malloc)

PROG = "git theta"           # how users type it (help, usage and error lines)
SCRIPT = "git-theta"         # the console script git runs (shell completion asks it)
EXIT_USAGE = 2               # zipslice.clistyle's codes (not imported here: it brings typer)
EXIT_INTERRUPTED = 130


def version() -> str:
    """This installation's version (package metadata; the source tree's pyproject when not installed)."""
    from zipslice.version import package_version

    return package_version()


FILTER_HELP = """\
Usage: git-theta-filter
       git-theta-filter clean PATH
       git-theta-filter smudge PATH

  Without arguments: git's long-running filter process for theta-tracked checkpoints (the pkt-line
  protocol of gitattributes(5), "Long Running Filter Process"). git starts it; it is not meant to be
  run by hand. `git theta install` configures git to start it (filter.theta.process).

  clean PATH / smudge PATH: the single-file filters (filter.theta.clean = git-theta-filter clean %f and
  filter.theta.smudge = git-theta-filter smudge %f, as Git-Theta's install writes them): one file
  from stdin to stdout, the same bytes the long-running filter gives. PATH is the file's path from
  the work tree's top (git's %f). clean: checkpoint in, metadata text out; smudge: metadata text in,
  checkpoint out (e.g. `git-theta-filter smudge model.pt < metadata.txt > model-out.pt`).

Options:
  --version   Print the version and exit.
  -h, --help  Show this message and exit.
"""


def single_threaded_blas() -> None:
    """One OpenBLAS thread in the filter (unless the user chose otherwise), set before numpy is imported: the
    filter's few BLAS calls are tiny (the LSH norm of a group), yet OpenBLAS's idle threads spin for a while
    after each one, taking ~7% of a `git add`'s CPU from the threads doing the work (measured with perf)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def few_collections() -> None:
    """Python's cycle collector every 100,000 new objects instead of 700: a filter's imports and metadata
    made it run ~50 times per `git add`, ~10 ms before git's first byte could be read (gc.callbacks, one-off).
    Reference counting still frees what is not in a cycle; cycles wait longer, which costs no more in all."""
    import gc

    gc.set_threshold(100_000, 10, 10)


# the hooks git runs after every checkout, switch, restore, clone and reset, with the arguments git passes
# (githooks(5)); with any other arguments (``--help``) they go through the typer app
HOOK_ARGUMENTS = {"post-checkout": 3, "post-index-change": 2}


def is_hook_call(args: list[str]) -> bool:
    """Whether ``args`` are a hook's as git passes them (:func:`hook_main` runs it)."""
    return bool(args) and HOOK_ARGUMENTS.get(args[0]) == len(args) - 1 and not any(a.startswith("-") for a in args)


def hook_main(args: list[str]) -> int:
    """`git-theta post-checkout PREVIOUS NEW FLAG` / `post-index-change WORKTREE SKIP`, as git runs them: the
    typer app's commands of those names, without building the CLI (typer, and the pydantic its parameter
    handling imports, took ~0.2 s of every checkout before the first placeholder could be written). The
    filter's BLAS and collector settings too: idle OpenBLAS threads spinning took ~5% of a checkout's CPU
    (perf, a clone's hook). Errors and interrupts end as the app's do."""
    single_threaded_blas()
    few_collections()
    from theta.base.errors import MissingDependencyError, ThetaError
    from theta.commands.filter import checkout_hooks

    try:
        if args[0] == "post-checkout":
            return checkout_hooks.post_checkout()
        return checkout_hooks.post_index_change(args[1] == "1")
    except (ThetaError, MissingDependencyError) as e:  # the app's user errors (theta.commands.app.run)
        from zipslice.clistyle import one_line

        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def filter_main(argv: list[str] | None = None) -> int:
    """The `git-theta-filter` entry point: the long-running filter process, the single-file filters
    (``clean PATH`` / ``smudge PATH``: theta.commands.filter.single_file) or its help."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in ("-h", "--help"):
        sys.stdout.write(FILTER_HELP)
        return 0
    if args and args[0] == "--version":
        print(f"git-theta-filter {version()}")
        return 0
    if args and args[0] in ("clean", "smudge"):  # one file, stdin to stdout: git's filter.<driver>.clean/smudge
        from theta.commands.filter.single_file import main as single_file

        return single_file(args[0], args[1:])
    if args:
        print(f"git-theta-filter: error: unexpected argument {args[0]!r}; git starts this filter without "
              f"arguments, or as `clean PATH` / `smudge PATH` (see git-theta-filter -h)", file=sys.stderr)
        return EXIT_USAGE
    if sys.stdin.isatty():
        print("git-theta-filter: error: this is git's filter process and speaks git's protocol on stdin; "
              "run `git theta install` and use git (see git-theta-filter -h)", file=sys.stderr)
        return EXIT_USAGE
    single_threaded_blas()
    reuse_freed_memory()
    few_collections()
    from theta.base.errors import ThetaError
    from theta.commands.filter.process import serve

    try:
        return serve(sys.stdin.buffer, sys.stdout.buffer, os.getcwd())
    except ThetaError as e:
        from zipslice.clistyle import one_line

        print(f"git-theta: error: {one_line(e)}", file=sys.stderr)
        return 1
    except EOFError:
        print("git-theta-filter: error: stdin ended before git's filter handshake; git starts this filter "
              "(see git-theta-filter -h)", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
