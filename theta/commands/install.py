"""`git theta install` / `uninstall`: the git configuration (filter, merge and diff drivers), the launcher
they run, and the per-repository hooks.

Like `git lfs install`, the drivers go to the global config by default (``--local``: this repository only).
Hooks are per repository: `install` run inside a repository installs them there, and the filter installs
them by itself the first time it runs in a repository that lacks them (e.g. during `git clone`'s checkout).
Running it twice changes nothing. Git-Theta's own keys for the same drivers (``filter.theta.clean =
git-theta-filter clean %f``...) are replaced, and install says so; those it finds in the repository's own
config, where they would override the global ones, are removed.

**The launcher.** git runs the drivers from whatever process runs git: an IDE, a GUI client, cron, a shell
where the Python environment that installed theta is not active. So the config never names a bare
``git-theta`` (found on PATH, or not): it names a small POSIX sh launcher written by install, which execs
that environment's ``git-theta`` by absolute path, and, when the environment has moved or been deleted,
says so and to re-run `git theta install`. Global install: ``$XDG_DATA_HOME/git-theta/bin/git-theta``
(default ``~/.local/share/...``); ``--local``: ``<git-common-dir>/theta/bin/git-theta``.

**The manual.** The global install also puts the man pages where ``man`` finds them, so `git theta --help`
works in an editable install too (:mod:`theta.commands.manpages`).

`uninstall` removes exactly what install added: the config keys (and their sections once empty), the
launcher, the man pages it wrote, and in the current repository theta's hooks, putting back each hook theta had chained
(``<hook>.theta-chained``). git-lfs's own setup, which install may have run, stays: other tools rely on it.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import typer

from theta.base.errors import GitError
from theta.git import repo as gitutil
from theta.commands import hooks, manpages
from zipslice.clistyle import QUIET_OPTION, say, set_quiet

# what each key runs, with "git-theta" standing for the launcher
SETTINGS = {
    "filter.theta.process": "git-theta filter-process",
    "filter.theta.clean": "git-theta clean %f",
    "filter.theta.smudge": "git-theta smudge %f",
    "filter.theta.required": "true",
    "merge.theta.name": "theta model merge",
    "merge.theta.driver": "git-theta merge-driver %O %A %B %L %P",
    "diff.theta.command": "git-theta diff-driver",
    # `git log -p` / `git show` do not run external diff drivers; textconv gives them one line per group
    "diff.theta.textconv": "git-theta diff-textconv",
}
SECTIONS = ("filter.theta", "merge.theta", "diff.theta")
# what Git-Theta's `git theta install` writes (0.1.0 to its newest: the global config by default, any scope with
# its --scope): the same driver names, running Git-Theta's programs
GIT_THETA_SETTINGS = {
    "filter.theta.clean": "git-theta-filter clean %f",
    "filter.theta.smudge": "git-theta-filter smudge %f",
    "filter.theta.required": "true",
    "merge.theta.name": "Merge Models with Git-Theta",
    "merge.theta.driver": "git-theta-merge %O %A %B %P",
    "diff.theta.command": "git-theta-diff",
}
LAUNCHER_MARKER = "# git-theta launcher"


@dataclass
class InstallReport:
    changed: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def man_manifest() -> Path:
    """The list of the man pages (and directories) the global install wrote (:mod:`theta.commands.manpages`)."""
    return launcher_path(False).parent.parent / "man-pages"


def launcher_path(local: bool, cwd=None) -> Path:
    """Where install writes the launcher for this scope."""
    if local:
        return gitutil.theta_dir(cwd) / "bin" / "git-theta"
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "git-theta" / "bin" / "git-theta"


def this_environment_command() -> list[str]:
    """How to run this environment's git-theta by absolute path: its console script when there is one
    (next to the interpreter, as pip installs it), else the interpreter running the CLI (never ``-m``: it puts
    the working directory, a repository's untrusted work tree, first on ``sys.path``)."""
    for exe in (Path(sys.executable).parent / "git-theta", Path(sys.argv[0]) if sys.argv else None):
        if exe is not None and exe.name == "git-theta" and exe.is_file() and os.access(exe, os.X_OK):
            return [str(exe.absolute())]
    return interpreter_command()


def interpreter_command() -> list[str]:
    """This interpreter running theta's command line, with nothing importable from the working directory."""
    return [sys.executable, "-c", "import sys; del sys.path[0]; from theta.commands.cli import main; "
                                  "sys.exit(main())"]


def launcher_script(command: list[str]) -> str:
    """The launcher running ``command`` (:func:`this_environment_command`)."""
    target = command[0]
    run = " ".join(shlex.quote(c) for c in command)
    return f"""#!/bin/sh
{LAUNCHER_MARKER} (written by `git theta install`; `git theta uninstall` removes it)
# git runs theta's filter, merge and diff drivers through this file, so they work from any PATH (an IDE's
# or a GUI's git, cron): it runs the git-theta of the Python environment that installed it.
if [ -x {shlex.quote(target)} ]; then
    exec {run} "$@"
fi
echo "git-theta: {target} is gone: the Python environment that installed git-theta was moved or deleted." >&2
echo "git-theta: run \\`git theta install\\` again from an environment where git-theta is installed." >&2
exit 127
"""


def settings_for(launcher: Path) -> dict[str, str]:
    """The config values install writes, running ``launcher``."""
    word = shlex.quote(str(launcher))
    return {k: (word + v[len("git-theta"):] if v.startswith("git-theta ") or v == "git-theta" else v)
            for k, v in SETTINGS.items()}


def install(local: bool = False, cwd=None) -> InstallReport:
    report = InstallReport()
    scope = "local" if local else "global"
    if local and not gitutil.in_repository(cwd):
        raise GitError("git theta install --local must run inside a git repository")
    launcher = launcher_path(local, cwd)
    if _write_if_changed(launcher, launcher_script(this_environment_command())):
        report.changed.append(f"wrote the launcher {launcher}")
    for key, value in settings_for(launcher).items():
        old = gitutil.config_get(key, cwd, scope=scope)
        if old != value:
            gitutil.config_set(key, value, cwd, scope=scope)
            report.changed.append(f"replaced Git-Theta's {key} ({old}) with theta's ({scope})"
                                  if is_git_thetas(key, old) else f"set {key} ({scope})")
    if not local and gitutil.in_repository(cwd):
        _drop_git_thetas_local_keys(cwd, report)
    if not local:  # (the pages belong to the environment, like the global drivers; not to one repository)
        changed, warnings = manpages.install(man_manifest())
        report.changed.extend(changed)
        report.warnings.extend(warnings)
    if gitutil.in_repository(cwd):
        if not hooks.is_installed(cwd):
            _install_git_lfs(cwd, local, report)
        report.changed.extend(hooks.install_hooks(cwd))
        adopted = _protect_existing_blobs(cwd)
        if adopted:
            report.changed.append(f"protected {adopted} blob(s) stored before theta kept its own name for them")
    elif not local:
        _install_git_lfs(cwd, False, report)
    return report


def is_git_thetas(key: str, value: str | None) -> bool:
    """Is ``value`` what Git-Theta's install writes for ``key``, and not theta's too ("required = true")?"""
    return value is not None and value == GIT_THETA_SETTINGS.get(key) and value != SETTINGS.get(key)


def _drop_git_thetas_local_keys(cwd, report: InstallReport) -> None:
    """Unset the keys Git-Theta's `install --scope repository` left in this repository's config: they would
    shadow the global ones just written (git-theta-merge and git-theta-diff are Git-Theta's programs)."""
    for key in GIT_THETA_SETTINGS:
        old = gitutil.config_get(key, cwd, scope="local")
        if is_git_thetas(key, old):
            gitutil.config_unset(key, cwd, scope="local")
            report.changed.append(f"removed Git-Theta's {key} ({old}) from this repository's config, where it "
                                  f"overrode theta's global one")
    for section in SECTIONS:
        gitutil.config_remove_section_if_empty(section, cwd, scope="local")


def uninstall(local: bool = False, cwd=None) -> InstallReport:
    """Undo :func:`install` for ``scope`` (and this repository's hooks when run inside one)."""
    report = InstallReport()
    scope = "local" if local else "global"
    in_repo = gitutil.in_repository(cwd)
    if local and not in_repo:
        raise GitError("git theta uninstall --local must run inside a git repository")
    for key in SETTINGS:
        if gitutil.config_unset(key, cwd, scope=scope):
            report.changed.append(f"unset {key} ({scope})")
    for section in SECTIONS:
        gitutil.config_remove_section_if_empty(section, cwd, scope=scope)
    if not local:
        report.changed.extend(manpages.uninstall(man_manifest()))
    launcher = launcher_path(local, cwd)
    if launcher.exists() and LAUNCHER_MARKER in launcher.read_text(errors="replace"):
        launcher.unlink()
        report.changed.append(f"removed the launcher {launcher}")
        with contextlib.suppress(OSError):
            launcher.parent.rmdir()  # bin/, when empty
            if not local:
                launcher.parent.parent.rmdir()  # ~/.local/share/git-theta, when empty
    if in_repo:
        done, warnings = hooks.uninstall_hooks(cwd)
        report.changed.extend(done)
        report.warnings.extend(warnings)
    return report


def _write_if_changed(path: Path, text: str) -> bool:
    try:
        if path.read_text() == text and os.access(path, os.X_OK):
            return False
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return True


def _protect_existing_blobs(cwd) -> int:
    """Give theta's protected name to every needed blob that only git-lfs's name holds (a repository used
    with a theta that kept none): from now on `git lfs prune` cannot delete them."""
    from theta.base.errors import MetadataError
    from theta.storage import retention
    from theta.storage.store import LfsStore

    store = LfsStore.for_repo(cwd or ".")
    if not store.objects_dir.is_dir():
        return 0
    try:
        needed = retention.needed_refs(retention.scan_needed(cwd), cwd)
    except MetadataError:
        return 0  # fsck names the unreadable text; install still protects what `has` touches later
    count = 0
    for ref in needed.values():
        keep = store.keep_path(ref)
        if keep is not None and not keep.exists() and store.has(ref):
            count += 1
    return count


def _install_git_lfs(cwd, local: bool, report: InstallReport) -> None:
    """git-lfs's own filter and hooks (for plain LFS files); theta's blobs travel through the git-lfs client."""
    args = ["lfs", "install"] + (["--local"] if local else [])
    if not local and not gitutil.in_repository(cwd) and gitutil.config_get("filter.lfs.process", cwd, scope="global"):
        return  # already installed globally
    try:
        gitutil.run(args, cwd)
    except GitError as e:
        report.warnings.append(f"`git {' '.join(args)}` failed ({e}); "
                               "theta works without git-lfs's hooks, plain LFS files may not push")
    else:
        report.changed.append("ran git " + " ".join(args))


# -- the verbs ------------------------------------------------------------------------------------

def install_command(local: bool = typer.Option(False, "--local", help="Configure this repository only."),
            quiet: bool = QUIET_OPTION) -> None:
    """Configure git for theta (global by default, with the man pages `git theta --help` shows) and install
    this repository's hooks."""
    set_quiet(quiet)
    report = install(local=local)
    for line in report.changed:
        say(line)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if not report.changed:
        say("git-theta is already installed")


def uninstall_command(local: bool = typer.Option(False, "--local", help="This repository's configuration only."),
              ) -> None:
    """Remove what `git theta install` added: config keys, the launcher, the man pages it wrote, this
    repository's theta hooks (restoring the hooks theta had chained). Blobs and .gitattributes are left as
    they are."""
    report = uninstall(local=local)
    for line in report.changed:
        print(line)
    for line in report.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if not report.changed:
        print("git-theta was not installed here", file=sys.stderr)
