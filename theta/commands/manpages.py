"""The manual pages where ``man`` finds them, so `git theta --help` and `git help theta` work in every install.

git answers ``git theta --help`` itself: it becomes ``git help theta``, which runs ``man git-theta`` (git-theta
never runs). man finds a page through ``MANPATH`` (git puts its own man directory first) and otherwise through
``PATH``: for each directory on it, man-db looks in ``<dir>/../share/man`` (``/usr/bin`` and ``/usr/local/bin``
map to ``/usr/share/man`` and ``/usr/local/share/man``). git runs ``git-theta`` from a directory on ``PATH``,
so the man directory beside that one is found with no shell configuration. A wheel install puts the pages
there (pyproject's data files, ``<prefix>/share/man/man1`` beside ``<prefix>/bin``); an editable install does
not, nor does a checkout run through a wrapper, nor a wheel behind pyenv's shims (they are a directory of
their own). So `git theta install` writes the pages there when they are missing: into
``<dir of git-theta>/../share/man/man1``, else (unwritable) into ``~/.local/share/man/man1``, then asks man
which page it would show and warns, with the fix, when it is not this installation's.

Each page it writes starts with :data:`MARKER`, and the files and directories it made are listed in
``manifest`` beside the global launcher, so `git theta uninstall` removes exactly those (a page pip installed
is never touched). ``GIT_THETA_MAN_DIR`` names the man directory to use instead (``<dir>/man1``), or, empty,
installs none (a packager's choice; the tests' git environments).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from theta import settings
from theta.base.errors import GitError
from theta.git import repo as gitutil
from zipslice.version import DISTRIBUTION

PAGES = ("git-theta.1", "zipslice.1")
MARKER = '.\\" written by `git theta install`; `git theta uninstall` removes it\n'
CHECKOUT_PAGES = Path(__file__).absolute().parents[2] / "docs" / "man"  # (a checkout or an editable install)


def sources() -> dict[str, Path]:
    """Each page of this installation: a checkout's docs/man, else the files the wheel installed."""
    if all((CHECKOUT_PAGES / p).is_file() for p in PAGES):
        return {p: CHECKOUT_PAGES / p for p in PAGES}
    try:
        files = metadata.distribution(DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        return {}
    found = {}
    for f in files:
        if f.name in PAGES and f.parent.name == "man1":
            path = Path(f.locate())
            if path.is_file():
                found[f.name] = path
    return found


def user_dir() -> Path:
    """The user's man directory (man-db searches it when ``~/.local/bin`` is on PATH, as pip's --user needs)."""
    return Path.home() / ".local" / "share" / "man"


def man_dir() -> Path | None:
    """The man directory (holding ``man1``) beside the ``git-theta`` git runs, or the one the setting names;
    None when the setting says to install no page."""
    chosen = settings.env("MAN_DIR")
    if chosen is not None:
        return Path(chosen).absolute() if chosen else None
    exe = shutil.which("git-theta")  # (git looks for git-theta on PATH too; the directory as PATH names it)
    bindir = Path(exe).absolute().parent if exe else Path(sys.executable).parent
    return Path(os.path.normpath(bindir.parent / "share" / "man"))


def _ours(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline() == MARKER
    except OSError:
        return False


def _write(target: Path, pages: dict[str, str]) -> tuple[list[Path], list[Path]]:
    """Write the missing or outdated pages into ``target/man1``: (files written, directories made)."""
    man1 = target / "man1"
    made = []  # the directories mkdir makes, deepest first
    d = man1
    while not d.exists() and d.parent != d:
        made.append(d)
        d = d.parent
    man1.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in pages.items():
        dest = man1 / name
        if dest.exists():
            current = dest.read_text(encoding="utf-8", errors="replace")
            if current in (text, MARKER + text) or not current.startswith(MARKER):
                continue  # up to date, or not ours (pip's, or another tool's): left as it is
        tmp = dest.with_name(f".{name}.tmp{os.getpid()}")
        tmp.write_text(MARKER + text, encoding="utf-8")
        os.replace(tmp, dest)
        written.append(dest)
    return written, made


def shown_page(page: str = "git-theta") -> Path | None:
    """The file ``git help theta`` would show (``man -w`` with the MANPATH git sets); None when man finds no
    page; raises FileNotFoundError when there is no man."""
    try:
        git_man = gitutil.run_text(["--man-path"])
    except GitError:
        git_man = ""
    env = {**os.environ, "MANPATH": f"{git_man}:{os.environ.get('MANPATH', '')}"}
    proc = subprocess.run(["man", "-w", page], env=env, capture_output=True, text=True)
    out = proc.stdout.strip().splitlines()
    return Path(out[0]) if proc.returncode == 0 and out else None


def install(manifest: Path) -> tuple[list[str], list[str]]:
    """Install the pages where man finds them (see the module docstring): (changes, warnings)."""
    target = man_dir()
    if target is None:
        return [], []
    pages = {name: path.read_text(encoding="utf-8") for name, path in sources().items()}
    if set(pages) != set(PAGES):
        return [], ["this installation has no man pages: `git theta --help` will not find one "
                    "(`git theta -h` prints the same help)"]
    changes: list[str] = []
    try:
        written, made = _write(target, pages)
    except OSError:
        target = user_dir()
        written, made = _write(target, pages)
    if written:
        _record(manifest, written, made)
        changes.append(f"wrote the man pages {', '.join(p.name for p in written)} in {target / 'man1'}")
    warnings = []
    try:
        shown = shown_page()
    except FileNotFoundError:
        shown = target / "man1" / "git-theta.1"  # no man here: nothing else to check, nor to say
    if shown is None or not _same_page(shown, pages["git-theta.1"]):
        found = "finds no manual" if shown is None else f"shows another installation's manual, {shown}"
        warnings.append(f"`git theta --help` {found}: man does not look in {target} first; put "
                        f"MANPATH=\"{target}:\" in your environment (`git theta -h` prints the same help)")
    return changes, warnings


def _same_page(path: Path, text: str) -> bool:
    try:
        return path.read_text(encoding="utf-8", errors="replace") in (text, MARKER + text)
    except OSError:  # (compressed pages, for one: another installation's)
        return False


def _record(manifest: Path, files: list[Path], dirs: list[Path]) -> None:
    entries = _read(manifest)
    entries += [str(p) for p in files + dirs if str(p) not in entries]
    manifest.parent.mkdir(parents=True, exist_ok=True)
    tmp = manifest.with_name(f".{manifest.name}.tmp")
    tmp.write_text("".join(e + "\n" for e in entries), encoding="utf-8")
    os.replace(tmp, manifest)


def _read(manifest: Path) -> list[str]:
    try:
        return [line for line in manifest.read_text(encoding="utf-8").splitlines() if line]
    except OSError:
        return []


def uninstall(manifest: Path) -> list[str]:
    """Remove the pages install wrote (those still marked as its own) and the directories it made, if empty."""
    changes = []
    entries = [Path(e) for e in _read(manifest)]
    for path in entries:
        if path.suffix == ".1" and _ours(path):
            path.unlink()
            changes.append(f"removed the man page {path}")
    for path in entries:  # (in the order made: man1, then the directories holding it)
        if path.suffix != ".1":
            try:
                path.rmdir()
            except OSError:
                pass  # not empty (other pages) or gone: left as it is
    manifest.unlink(missing_ok=True)
    return changes
