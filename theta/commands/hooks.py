"""theta's git hooks: pre-push uploads the LFS blobs referenced by the theta metadata in the pushed commits;
post-checkout and post-index-change write the checkpoints a git command left as placeholders.

git-lfs's own pre-push hook only sees LFS pointer files; theta's metadata files are not pointers, so theta
adds its own hook. post-checkout's exit status becomes that of checkout, switch, restore and clone (githooks(5)):
theta's writes the checkpoints there, so such a command fails when one cannot be written
(:mod:`theta.commands.filter.handoff`, :mod:`theta.commands.filter.checkout_hooks`). An existing hook (git-lfs's, or the
user's) is never overwritten: it is kept as ``<hook>.theta-chained`` and run after theta's with the same
arguments (and stdin, for pre-push).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from theta.base.errors import MetadataError, ThetaError
from theta.git import repo as gitutil

if TYPE_CHECKING:
    from theta.storage.store import BlobRef

MARKER = "# git-theta pre-push hook"
CHAINED = "pre-push.theta-chained"
CHAINED_SUFFIX = ".theta-chained"       # <hook>.theta-chained: the hook theta's hook replaced, and runs
SIGNATURE = "(written by `git theta install`)"  # in every hook theta writes
ZERO = "0" * 40


def hook_script() -> str:
    py = shlex.quote(sys.executable)
    return f"""#!/bin/sh
{MARKER} (written by `git theta install`)
# Uploads the Git LFS objects of theta-tracked checkpoints, then runs the hook that was here before
# (kept as {CHAINED}, e.g. git-lfs's pre-push).
if command -v git-theta >/dev/null 2>&1; then
    exec git-theta pre-push "$@"
fi
if [ -x {py} ] && {py} -c "import theta" 2>/dev/null; then
    exec {py} -m theta.commands.cli pre-push "$@"
fi
echo >&2 "This repository is configured for git-theta but 'git-theta' was not found on your PATH."
echo >&2 "Install it, or remove .git/hooks/pre-push (the previous hook is .git/hooks/{CHAINED})."
exit 2
"""


# The hooks that write the checkpoints a git command left as placeholders (theta.commands.filter.handoff): the shell
# starts theta only when a filter handed out placeholders in this work tree (handed-*) or some were left
# (placeholders.json), and post-index-change only for `git reset` (its parent's command line, where /proc says).
_WHEN = {
    "post-checkout": 'true',
    "post-index-change": '[ "$1" = 1 ] && case " $(tr "\\000" " " </proc/$PPID/cmdline 2>/dev/null)" in '
                         '" "|*" reset "*) true ;; *) false ;; esac',
}
_WHY = {
    "post-checkout": "git makes this hook's exit status the exit status of checkout, switch, restore and clone",
    "post-index-change": "after `git reset --hard`; git ignores this hook's exit status",
}


def writing_hook_script(name: str) -> str:
    """The post-checkout / post-index-change hook: write the placeholders' checkpoints, then run the chained
    hook (its failure fails the hook when ours did not)."""
    py = shlex.quote(sys.executable)
    return f"""#!/bin/sh
# git-theta {name} hook {SIGNATURE}
# Writes the checkpoints git checked out as placeholders ({_WHY[name]}),
# then runs the hook that was here before (kept as {name}{CHAINED_SUFFIX}).
status=0
if {_WHEN[name]}; then
    dir=$(git rev-parse --git-path theta 2>/dev/null)
    if [ -n "$dir" ] && {{ [ -e "$dir/placeholders.json" ] || ls "$dir"/handed-* >/dev/null 2>&1; }}; then
        if command -v git-theta >/dev/null 2>&1; then
            git-theta {name} "$@"; status=$?
        elif [ -x {py} ] && {py} -c "import theta" 2>/dev/null; then
            {py} -m theta.commands.cli {name} "$@"; status=$?
        else
            echo >&2 "git-theta: 'git-theta' is not on your PATH: checkpoints left as placeholders stay so;"
            echo >&2 "git-theta: install it, or remove .git/hooks/{name}"
            status=2
        fi
    fi
fi
chained="$(dirname "$0")/{name}{CHAINED_SUFFIX}"
if [ -x "$chained" ]; then
    "$chained" "$@"; chained_status=$?
    [ "$status" -eq 0 ] && status=$chained_status
fi
exit $status
"""


HOOKS = {"pre-push": hook_script, "post-checkout": lambda: writing_hook_script("post-checkout"),
         "post-index-change": lambda: writing_hook_script("post-index-change")}


def _ours(path: Path, name: str) -> bool:
    try:
        text = path.read_text(errors="replace")
    except (FileNotFoundError, IsADirectoryError):
        return False
    return MARKER in text if name == "pre-push" else f"git-theta {name} hook" in text


def is_installed(cwd=None) -> bool:
    hooks = gitutil.hooks_dir(cwd)
    return all(_ours(hooks / name, name) for name in HOOKS)


def install_hooks(cwd=None) -> list[str]:
    """Install theta's hooks (pre-push; post-checkout and post-index-change, which write placeholders'
    checkpoints), each chaining to the hook that was there. Idempotent. Returns what it did."""
    hooks = gitutil.hooks_dir(cwd)
    done = []
    for name, script in HOOKS.items():
        hook = hooks / name
        if _ours(hook, name):
            continue
        hooks.mkdir(parents=True, exist_ok=True)
        if hook.exists() or hook.is_symlink():
            chained = hooks / (name + CHAINED_SUFFIX)
            # e.g. `git lfs update --force` rewrote git-lfs's hook over ours: the chain already holds it
            if chained.exists() and _same_content(chained, hook):
                os.unlink(chained)
            if chained.exists():
                raise ThetaError(f"{hook} exists and so does {chained}; merge them by hand, then rerun "
                                 "`git theta install`")
            os.replace(hook, chained)
            done.append(f"kept the existing {name} hook as {chained.name} (theta's hook runs it)")
        tmp = hook.with_name(f".{name}.theta.tmp")
        tmp.write_text(script())
        tmp.chmod(0o755)
        os.replace(tmp, hook)
        done.append(f"installed {hook}")
    return done


def is_theta_hook(path: Path) -> bool:
    try:
        text = path.read_text(errors="replace")
    except (FileNotFoundError, IsADirectoryError):
        return False
    return MARKER in text or SIGNATURE in text


def uninstall_hooks(cwd=None) -> tuple[list[str], list[str]]:
    """Remove every hook theta wrote in this repository and put back the hook each one had chained.

    Returns (what was done, warnings). A hook that is not theta's is left alone, and so is its
    ``.theta-chained`` file unless it is an exact copy (e.g. `git lfs update --force` rewrote git-lfs's hook
    over theta's; the chained copy is then redundant).
    """
    hooks = gitutil.hooks_dir(cwd)
    done, warnings = [], []
    if not hooks.is_dir():
        return done, warnings
    for chained in sorted(hooks.glob("*" + CHAINED_SUFFIX)):
        hook = chained.with_name(chained.name[: -len(CHAINED_SUFFIX)])
        if is_theta_hook(hook):
            os.replace(chained, hook)
            done.append(f"restored the {hook.name} hook theta had chained")
        elif hook.exists() and _same_content(hook, chained):
            os.unlink(chained)
            done.append(f"removed {chained.name} (a copy of the current {hook.name} hook)")
        elif not hook.exists():
            os.replace(chained, hook)
            done.append(f"restored the {hook.name} hook theta had chained")
        else:
            warnings.append(f"{chained} is left: {hook.name} is no longer theta's hook, so merge them by hand")
    for hook in sorted(hooks.iterdir()):
        if hook.is_file() and not hook.name.endswith(CHAINED_SUFFIX) and is_theta_hook(hook) \
                and not (hook.with_name(hook.name + CHAINED_SUFFIX)).exists():
            # a theta hook that chained nothing (or whose chain was just restored over it: then it is gone)
            os.unlink(hook)
            done.append(f"removed theta's {hook.name} hook")
    return done, warnings


def ensure_installed_quietly(cwd=None) -> None:
    """Called by the filter: install the hook in a repository that lacks it (e.g. a fresh clone).

    Only in the repository's own hooks directory; a shared core.hooksPath is left to `git theta install`.
    """
    if gitutil.config_get("core.hooksPath", cwd):
        return
    if not is_installed(cwd):
        try:
            lines = install_hooks(cwd)
            installed = [Path(line.split(" ", 1)[1]) for line in lines if line.startswith("installed ")]
            if len(installed) > 1:  # one line: a clone prints it
                lines = [line for line in lines if not line.startswith("installed ")] + [
                    f"installed the {', '.join(p.name for p in installed)} hooks in {installed[0].parent}"]
            for line in lines:
                print(f"git-theta: {line}", file=sys.stderr)
        except (ThetaError, OSError) as e:
            print(f"git-theta: warning: could not install the pre-push hook: {e}", file=sys.stderr)


# -- the hook itself -----------------------------------------------------------------------------------
def parse_push_lines(stdin: bytes) -> list[tuple[str, str, str, str]]:
    out = []
    for line in stdin.decode().splitlines():
        parts = line.split()
        if len(parts) == 4:
            out.append((parts[0], parts[1], parts[2], parts[3]))
    return out


def blobs_to_push(cwd, remote: str, lines: list[tuple[str, str, str, str]], names: set[str] | None = None
                  ) -> "list[BlobRef]":
    """Every blob referenced by theta metadata in commits being pushed that the remote does not have yet;
    ``names``, if given, receives the paths of the checkpoints whose blobs they are."""
    from theta.storage.metadata import MAX_METADATA_BYTES, is_metadata, loads  # (numpy: hooks stay light)

    tips = [local for _, local, _, _ in lines if local != ZERO]
    if not tips:
        return []
    excludes = [f"--remotes={remote}"] + [r for _, _, _, r in lines if r != ZERO and gitutil.rev_exists(r, cwd)]
    listing = gitutil.run(["rev-list", "--objects", *tips, "--not", *excludes], cwd).decode()
    path_of = dict(line.split(" ", 1) for line in listing.splitlines() if " " in line)  # trees and blobs have paths
    shas = list(path_of)
    infos = gitutil.batch_check(shas, cwd)
    refs: "dict[str, BlobRef]" = {}
    with gitutil.CatFile(cwd) as cat:
        for info in infos:
            if info is None or info.type != "blob" or info.size > MAX_METADATA_BYTES:
                continue
            _, data = cat.read(info.sha)
            if is_metadata(data):
                try:
                    meta = loads(data, file=f"blob {info.sha}")
                except MetadataError as e:  # someone else's broken metadata: its blobs cannot be named
                    print(f"git-theta: warning: {e}; its blobs are not uploaded", file=sys.stderr)
                    continue
                fresh = False
                for ref in meta.blob_refs():
                    fresh |= ref.oid not in refs
                    refs[ref.oid] = ref
                if fresh and names is not None:
                    names.add(path_of.get(info.sha, info.sha))
    return list(refs.values())


def run_pre_push(remote: str, url: str, stdin: bytes, cwd=None) -> int:
    from theta.storage.transfer import push_blobs

    lines = parse_push_lines(stdin)
    names: set[str] = set()
    refs = blobs_to_push(cwd, remote, lines, names)
    if refs:
        files = sorted(names)
        label = f"theta push {files[0]}" + (f" (+{len(files) - 1} files)" if len(files) > 1 else "") if files else None
        n = push_blobs(cwd or ".", remote, refs, progress=label)  # a bar only when stderr is a terminal
        print(f"git-theta: offered {n} blob(s) to the LFS server of {remote}", file=sys.stderr)
    chained = gitutil.hooks_dir(cwd) / CHAINED
    if chained.exists() and os.access(chained, os.X_OK):
        return subprocess.run([str(chained), remote, url], input=stdin, cwd=cwd).returncode
    return 0


def _same_content(a: Path, b: Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False


# -- the verbs git runs (hidden) ---------------------------------------------------------------------

def post_commit() -> None:
    """Git-Theta's post-commit hook body: theta needs none (blobs to push are found from the pushed commits)."""
    print("theta needs no post-commit hook: `git push` uploads the blobs the pushed commits reference "
          "(pre-push hook installed by `git theta install`); you can delete Git-Theta's .git/hooks/post-commit",
          file=sys.stderr)


def pre_push(remote: str = typer.Argument(..., metavar="REMOTE"), url: str = typer.Argument("", metavar="URL")) -> None:
    """The pre-push hook: upload blobs referenced by pushed commits, then run the chained hook."""
    raise typer.Exit(run_pre_push(remote, url, sys.stdin.buffer.read()))


def post_checkout(previous: str = typer.Argument("", metavar="PREVIOUS"), new: str = typer.Argument("", metavar="NEW"),
                  branch: str = typer.Argument("", metavar="FLAG")) -> None:
    """The post-checkout hook: write the checkpoints left as placeholders; exit 1 when one cannot be."""
    # (imported here: the filter imports this module at its start, and writes placeholders only at its end)
    from theta.commands.filter.checkout_hooks import post_checkout as write_left

    raise typer.Exit(write_left())


def post_index_change(worktree: str = typer.Argument("0", metavar="WORKTREE"),
                      skip: str = typer.Argument("0", metavar="SKIP_WORKTREE")) -> None:
    """The post-index-change hook: after `git reset`, write the checkpoints left as placeholders."""
    from theta.commands.filter.checkout_hooks import post_index_change as write_left

    raise typer.Exit(write_left(worktree == "1"))
