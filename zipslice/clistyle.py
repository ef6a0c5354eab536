"""One style for the project's command lines, ``zipslice`` and ``git theta``: typer parses, rich prints.

A command module uses it like this::

    app = clistyle.make_app("zipslice", "Inspect ... checkpoints.", version=zipslice.__version__)

    @app.command("ls")
    def ls_cmd(path: Path = typer.Argument(..., metavar="PATH", help="checkpoint file"),
               as_json: bool = clistyle.JSON_OPTION, quiet: bool = clistyle.QUIET_OPTION) -> None:
        clistyle.set_quiet(quiet)
        ...
        clistyle.emit_json({...})        # --json: one JSON document on stdout
        clistyle.note("wrote x")         # stderr, silenced by -q

    def main(argv=None):
        clistyle.run(app, "zipslice", argv, user_errors=(ZipsliceError, OSError), error_status=2)

What every command gets:

- ``-h`` and ``--help``; help rendered by :mod:`zipslice.clihelp` (no boxes, no type tags, names never cut,
  wrapped at the terminal width, plain text when stdout is not a terminal); ``--version`` on the app;
  ``completion SHELL`` scripts (:func:`zipslice.clihelp.completion_script`).
- errors in the command line's own terms: a usage error prints ``PROG CMD: error: MESSAGE`` and a hint to
  ``-h`` (status 2); an expected failure (the ``user_errors`` classes given to :func:`run`) prints
  ``PROG: error: MESSAGE`` on one line (status ``error_status``); Ctrl-C is status 130; a closed pipe
  (``| head``) ends quietly. Anything else is a bug and keeps its traceback.
- ``emit_json`` (``--json`` output: NaN/Inf as strings, UTF-8, one document), ``natural_key`` (sort
  ``layer.2`` before ``layer.10``), ``out_console`` (rich on stdout: colour only on a terminal, long
  lines never folded), ``columns`` (aligned rows, the name last and never padded), ``printable`` (control
  characters escaped), ``note``/``say``/``set_quiet`` (messages for people, on stderr / stdout, that ``-q``
  silences), ``one_of`` (choice validation with a one-line error and shell completion of the choices).

No click import: typer vendors its own click in recent versions, so the classes are reached through typer.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import typer
from .clihelp import StyledCommand, StyledGroup, _complete_var, _metavar
from .clihelp import SHELLS, completion_script  # noqa: F401 (re-exported: command modules need only clistyle)

# click's exception classes, whichever click typer uses (its vendored copy or the click package)
_USAGE_ERROR: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
_CLICK_EXCEPTION: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")

HELP_OPTIONS = ["-h", "--help"]
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


# -- shared options --------------------------------------------------------------------------------

JSON_OPTION = typer.Option(False, "--json", help="Print one JSON document on stdout instead of a table.")
QUIET_OPTION = typer.Option(False, "--quiet", "-q", help="Print nothing but the data asked for and errors.")


@dataclass
class _State:
    quiet: bool = False


_state = _State()


def set_quiet(quiet: bool) -> None:
    """Silence :func:`note` for the rest of this command (``-q``); a root ``-q`` stays in force."""
    _state.quiet = _state.quiet or bool(quiet)


def is_quiet() -> bool:
    return _state.quiet


def note(message: str) -> None:
    """A message for the person at the terminal (what was written, what to do next): stderr, unless ``-q``."""
    if not _state.quiet:
        print(message, file=sys.stderr)


def say(message: str) -> None:
    """A line of a command's report on stdout (what changed), silenced by ``-q``; data is printed directly."""
    if not _state.quiet:
        print(message)


def one_of(choices: "Sequence[str] | Callable[[], Sequence[str]]", what: str = "value") -> dict[str, Any]:
    """Keyword arguments for ``typer.Option`` that accept exactly ``choices`` (or None).

    ``choices`` may be a function returning them (a registry asked when the option is used, e.g.
    :func:`zipslice.formats.writable`, so plugins count and starting the CLI scans no entry points).
    The error is one line naming the flag and the choices; the shell completes the choices.
    """
    def listed() -> Sequence[str]:
        return choices() if callable(choices) else choices

    def check(value: str | None) -> str | None:
        if value is not None and value not in listed():
            raise typer.BadParameter(f"{value!r} is not a {what}; choose one of {', '.join(listed())}")
        return value

    def complete(incomplete: str) -> list[str]:
        return [c for c in listed() if c.startswith(incomplete)]

    return {"callback": check, "autocompletion": complete}


# -- output ----------------------------------------------------------------------------------------

_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple:
    """Sort key that orders digit runs by value: ``layer.2`` before ``layer.10``; ties fall back to the text."""
    parts = _DIGITS.split(name)
    return tuple((0, int(p)) if i % 2 else (1, p.casefold()) for i, p in enumerate(parts) if p != ""), name


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("nan", "inf", "-inf"), tuples as lists, bytes as text:
    what strict JSON readers (``jq``, JavaScript) accept."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return jsonable(value.item())
    return value


def emit_json(obj: Any) -> None:
    """Write ``obj`` as one strict JSON document (see :func:`jsonable`) and a newline on stdout."""
    sys.stdout.write(json.dumps(jsonable(obj), indent=1, ensure_ascii=False, allow_nan=False) + "\n")


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``), so a hostile name cannot break a line
    or drive the terminal. --json output keeps the exact text."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def out_console(stderr: bool = False):
    """A rich Console for stdout (or stderr): colour only on a terminal; lines are never folded or cut, so a
    long name stays whole (a terminal wraps it softly, a pipe gets it on one line)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, soft_wrap=True, highlight=False, force_terminal=tty, no_color=not tty,
                   width=shutil.get_terminal_size().columns if tty else 1 << 16)


def columns(rows: Iterable[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    """Plain aligned columns, two spaces apart. The last column (put names there) is never padded or cut,
    so no line carries trailing blanks and a name can be copied whole. ``right``: right-aligned columns."""
    rows = [[str(c) for c in r] for r in rows]
    if not rows:
        return []
    n = max(len(r) for r in rows)
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(n - 1)]
    out = []
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r[:-1])]
        out.append("  ".join([*cells, r[-1]]))
    return out


class App(typer.Typer):
    """A typer app whose commands use :class:`StyledCommand` (``-h`` included) unless told otherwise."""

    def command(self, *args, **kwargs):
        kwargs.setdefault("cls", StyledCommand)
        return super().command(*args, **kwargs)


def make_app(name: str, help: str, version: str | Callable[[], str], *,
             callback: Callable | None = None) -> App:
    """A typer app in the shared style, with ``--version``, ``-q`` and ``-h`` on the app itself.

    ``callback(quiet)``, if given, runs before any command (after the shared options are handled).
    """
    app = App(name=name, help=help, cls=StyledGroup, no_args_is_help=True, add_completion=False,
              rich_markup_mode=None, pretty_exceptions_enable=False,
              context_settings={"help_option_names": HELP_OPTIONS})

    def show_version(value: bool) -> None:
        if value:
            print(f"{name} {version() if callable(version) else version}")
            raise typer.Exit(0)

    @app.callback()
    def root(version_flag: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                               is_eager=True, callback=show_version),
             quiet: bool = QUIET_OPTION) -> None:
        set_quiet(quiet)
        if callback is not None:
            callback(quiet)

    root.__doc__ = help
    return app


# -- running ---------------------------------------------------------------------------------------

def one_line(e: BaseException) -> str:
    """An exception as one line in the user's terms (OSError: 'path: reason'; KeyError: its message)."""
    if isinstance(e, KeyError) and e.args:
        text = str(e.args[0])
    elif isinstance(e, OSError) and e.filename is not None:
        text = f"{e.filename}: {e.strerror or e}"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def _usage_message(e) -> str:
    """click's message, with a missing parameter named as the help shows it (``SRC``, ``--to``)."""
    param = getattr(e, "param", None)
    if type(e).__name__ == "MissingParameter" and param is not None:
        if param.param_type_name == "argument":
            return f"missing argument {_metavar(param)}"
        return f"missing option {max(param.opts, key=len)}"
    return " ".join((e.format_message() if hasattr(e, "format_message") else str(e)).split())


def _usage_error(prog: str, e) -> None:
    ctx = getattr(e, "ctx", None)
    where = ctx.command_path if ctx is not None else prog
    print(f"{where}: error: {_usage_message(e)}", file=sys.stderr)
    print(f"Try '{where} -h' for help.", file=sys.stderr)


def run(app: typer.Typer, prog: str, argv: Sequence[str] | None = None, *,
        user_errors: tuple[type[BaseException], ...] = (), error_status: int = 1,
        translate: Callable[[BaseException], str | None] | None = None, complete_var: str | None = None) -> int:
    """Run ``app`` as the program ``prog`` and return its exit status (see the module docstring).

    ``translate(e)`` may return a better one-line message for a user error (for example to name a flag
    where the Python API named a keyword argument), or None to keep ``one_line(e)``. ``complete_var``: the
    environment variable that asks for shell completion (default ``_PROG_COMPLETE``; see
    :func:`completion_script`), needed when ``prog`` is not the console script's name (``git theta``).
    """
    _state.quiet = False
    complete_var = complete_var or _complete_var(prog)
    if complete_var in os.environ:  # a shell asks for completions: typer answers once its shells are known
        from typer.completion import completion_init

        completion_init()
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=list(sys.argv[1:] if argv is None else argv), prog_name=prog,
                          complete_var=complete_var, standalone_mode=False)
    except _USAGE_ERROR as e:
        if type(e).__name__ == "NoArgsIsHelpError" and getattr(e, "ctx", None) is not None:
            print(e.ctx.get_help())  # no command given: the help, as status 2 (nothing was done)
            return EXIT_USAGE
        _usage_error(prog, e)
        return getattr(e, "exit_code", EXIT_USAGE) or EXIT_USAGE
    except _CLICK_EXCEPTION as e:
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return getattr(e, "exit_code", 1) or 1
    except typer.Exit as e:
        return int(getattr(e, "exit_code", 0) or 0)
    except (KeyboardInterrupt, typer.Abort):
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return 1
    except user_errors as e:
        if isinstance(e, OSError) and e.errno == errno.EPIPE:
            _silence_stdout()
            return 1
        message = (translate(e) if translate else None) or one_line(e)
        print(f"{prog}: error: {message}", file=sys.stderr)
        return error_status
    return rv if isinstance(rv, int) else 0


def _silence_stdout() -> None:
    """After ``| head`` closed the pipe: point stdout at /dev/null so the interpreter's final flush is quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
