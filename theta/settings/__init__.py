"""Configuration, read once at the edge (git config, environment) and passed down as values.

Precedence everywhere: environment ``GIT_THETA_<NAME>`` over ``git config theta.<name>`` over the default.
:mod:`theta.settings.merge_rules` reads the merge configuration (``.thetamerge``, ``theta.merge.*``).
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

from zipslice import formats

from theta.base.errors import ThetaError
from theta.git import repo as gitutil

ENV_PREFIX = "GIT_THETA_"


def parse_bool(value: str, where: str) -> bool:
    """git's spellings of a boolean; a ThetaError naming ``where`` otherwise."""
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ThetaError(f"{where}: expected a boolean (true/false), got {value!r}")


def env(name: str, default: str | None = None) -> str | None:
    """The environment variable ``GIT_THETA_<name>``."""
    return os.environ.get(ENV_PREFIX + name, default)


def env_flag(name: str) -> bool:
    """``GIT_THETA_<name>`` as a boolean (unset: False)."""
    value = env(name)
    return False if value is None else parse_bool(value, ENV_PREFIX + name)


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def _convert(value: str, annotation, default, where: str):
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if "bool" in kind or isinstance(default, bool):
        return parse_bool(value, where)
    try:
        if "int" in kind or (isinstance(default, int) and not isinstance(default, bool)):
            return int(value)
        if "float" in kind or isinstance(default, float):
            return float(value)
    except ValueError:
        raise ThetaError(f"{where}: expected a number, got {value!r}") from None
    if "Path" in kind:
        return Path(value)
    return value


def clean_options(cwd=None, progress: bool | None = None):
    """CleanOptions from defaults, then git config ``theta.<camelCaseField>``, then env ``GIT_THETA_<FIELD>``.

    Example: ``update_type`` is ``git config theta.updateType`` / ``GIT_THETA_UPDATE_TYPE``.
    """
    from theta.model.clean import CleanOptions

    config = gitutil.config_get_regexp(r"^theta\.", cwd)
    kwargs = {}
    for f in dataclasses.fields(CleanOptions):
        if f.name == "progress":
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        key = "theta." + f.name.replace("_", "")
        raw, source = env(f.name.upper()), ENV_PREFIX + f.name.upper()
        if raw is None and f.name == "update_data":  # Git-Theta 0.2.0's name for it (never its "update.pt" default)
            raw, source = env("UPDATE_DATA_PATH"), ENV_PREFIX + "UPDATE_DATA_PATH"
        if raw is None:
            raw, source = config.get(key), key
        if raw is None:
            continue
        kwargs[f.name] = _convert(raw, f.type, default, f"bad value for {source}")
    # checkouts and adds run the HDF5 parser in a child process unless theta.isolate says otherwise
    kwargs.setdefault("isolate", True)
    opts = CleanOptions(**kwargs)
    opts.progress = stderr_is_terminal() if progress is None else progress
    return opts


def checkout_format(path: str, cwd=None) -> str | None:
    """The format to write ``path`` in at checkout: attribute theta-format, else theta.checkoutFormat, else None."""
    return checkout_formats([path], cwd)[path]()


def checkout_formats(paths: list[str], cwd=None) -> dict:
    """:func:`checkout_format` of several paths with one `git check-attr`: path -> a callable returning the
    format or raising ThetaError (a bad value fails only the file it applies to)."""
    attrs = gitutil.check_attr("theta-format", paths, cwd)
    out = {}
    for path in paths:
        fmt, source = attrs.get(path), f"attribute theta-format of {path}"
        if fmt in (None, "set"):
            fmt, source = gitutil.config_get("theta.checkoutFormat", cwd), "git config theta.checkoutFormat"
        out[path] = _format_answer(fmt, source)
    return out


def _format_answer(fmt: str | None, source: str):
    def answer() -> str | None:
        if fmt is not None and fmt not in formats.one_file_writable():
            raise ThetaError(f"{source} is {fmt!r}; expected one of {', '.join(formats.one_file_writable())}")
        return fmt
    return answer


def commit_format() -> str | None:
    """The committed format asked for explicitly, for this command only: env ``GIT_THETA_FORMAT`` (set by
    `git theta add --format F`), else None (a file keeps the format it was committed in).

    Deliberately not a `git config` key: a persistent setting would turn every later `git add` into a
    silent format change, which is exactly what views exist to prevent.
    """
    fmt = env("FORMAT")
    if fmt is None or fmt == "":
        return None
    if fmt not in formats.one_file_writable():
        raise ThetaError(f"{ENV_PREFIX}FORMAT is {fmt!r}; expected one of {', '.join(formats.one_file_writable())}")
    return fmt


_SUFFIXES = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(value: str, where: str) -> int:
    """A byte count as git writes sizes: ``123``, ``512k``, ``64MiB``, ``1.5G``, ``2 gb`` (binary units; k, m, g,
    t, p with optional ``i``/``b``). Zero is allowed (callers that need a positive size check it)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtp]?)(?:i?b)?\s*", value.lower())
    if m is None or (m.group(2) == "" and value.strip().lower().endswith(("ib",))):
        raise ThetaError(f"{where}: expected a size such as 512MiB or 2G, got {value!r}")
    return int(float(m.group(1)) * _SUFFIXES[m.group(2)])


def max_checkout_bytes(cwd=None) -> int:
    """The most tensor bytes one checked-out file may declare (env GIT_THETA_MAX_CHECKOUT_BYTES, else
    ``git config theta.maxCheckoutBytes``, else theta.updates.bounds.DEFAULT_MAX_OUTPUT = 1 TiB). A checkout
    declaring more is refused before any work: metadata from a clone is untrusted."""
    from theta.updates.bounds import DEFAULT_MAX_OUTPUT

    value, source = env("MAX_CHECKOUT_BYTES"), ENV_PREFIX + "MAX_CHECKOUT_BYTES"
    if value is None:
        value, source = gitutil.config_get("theta.maxCheckoutBytes", cwd), "git config theta.maxCheckoutBytes"
    if value is None:
        return DEFAULT_MAX_OUTPUT
    n = parse_size(value, source)
    if n <= 0:
        raise ThetaError(f"{source}: expected a positive size, got {value!r}")
    return n


def verify_mode(cwd=None) -> str:
    """How checkout verifies rebuilt groups: env GIT_THETA_VERIFY, else ``git config theta.verify``, else
    "frames" (single dense steps trust their zstd checksums)."""
    value, source = env("VERIFY"), ENV_PREFIX + "VERIFY"
    if value is None:
        value, source = gitutil.config_get("theta.verify", cwd), "git config theta.verify"
    from theta.model.smudge import VERIFY

    value = value or "frames"
    if value not in VERIFY:
        raise ThetaError(f"{source} is {value!r}; expected one of {', '.join(VERIFY)}")
    return value


# A checkpoint above this size is written by theta itself once git has finished. Handing it to git instead
# costs git its whole size in memory, and leaves the file "racily clean" (written in the same second as the
# index), so the next `git status` starts the filter and re-reads it. `scripts/bench/git.py --sweep`
# (0.25-256 MiB): the checkout alone takes the same time either way (ratios 0.8-1.2, within this machine's
# noise), checkout + next status 0.36-0.74x with the placeholder path. Small files stay on the direct path
# (single-file smudge and git archive need it anyway): one code path for the tiny checkpoints of old tests.
MATERIALIZE_ABOVE_DEFAULT = 1 << 20
# ... and never more than this share of the memory the process really has (host within its cgroup): git
# holds the whole file, theta two groups, and the page cache the rest.
MEMORY_SHARE = 4


@dataclasses.dataclass(frozen=True)
class CheckoutSettings:
    """How checkout writes theta-tracked files (read once per filter process).

    ``materialize_above``: checkpoints larger than this (bytes of tensor data) reach the work tree as a
    placeholder -- their metadata text, what git stores -- which theta replaces with the checkpoint when the
    git command has finished (the filter process's last act; or `git theta checkout`).
    ``skip``: leave every theta file as a placeholder (GIT_THETA_SKIP_SMUDGE=1, like GIT_LFS_SKIP_SMUDGE);
    `git theta pull` / `git theta checkout` materialize them later.
    """

    materialize_above: int
    skip: bool = False


def checkout_settings(cwd=None) -> CheckoutSettings:
    """env GIT_THETA_MATERIALIZE_ABOVE / git config theta.materializeAbove (a size, or "auto": the smaller of
    1 MiB and a quarter of the memory available within this process's cgroup); GIT_THETA_SKIP_SMUDGE /
    theta.skipSmudge."""
    value, source = env("MATERIALIZE_ABOVE"), ENV_PREFIX + "MATERIALIZE_ABOVE"
    if value is None:
        value, source = gitutil.config_get("theta.materializeAbove", cwd), "git config theta.materializeAbove"
    if value is None or value.strip().lower() == "auto":
        from zipslice import memory

        above = min(MATERIALIZE_ABOVE_DEFAULT, memory.available() // MEMORY_SHARE)
    else:
        above = parse_size(value, source)
    skip_raw, skip_source = env("SKIP_SMUDGE"), ENV_PREFIX + "SKIP_SMUDGE"
    if skip_raw is None:
        skip_raw, skip_source = gitutil.config_get("theta.skipSmudge", cwd), "git config theta.skipSmudge"
    skip = parse_bool(skip_raw, skip_source) if skip_raw is not None else False
    return CheckoutSettings(materialize_above=above, skip=skip)
