"""`git theta install`: the git configuration (filter, merge and diff drivers) and the per-repository hooks.

Like `git lfs install`, the drivers go to the global config by default (``--local``: this repository only).
Hooks are per repository: `install` run inside a repository installs them there, and the filter installs
them by itself the first time it runs in a repository that lacks them (e.g. during `git clone`'s checkout).
Running it twice changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from theta.errors import GitError
from theta.git import repo as gitutil
from theta.commands import hooks

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


@dataclass
class InstallReport:
    changed: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def install(local: bool = False, cwd=None) -> InstallReport:
    report = InstallReport()
    scope = "local" if local else "global"
    if local and not gitutil.in_repository(cwd):
        raise GitError("git theta install --local must run inside a git repository")
    for key, value in SETTINGS.items():
        if gitutil.config_get(key, cwd, scope=scope) != value:
            gitutil.config_set(key, value, cwd, scope=scope)
            report.changed.append(f"set {key} ({scope})")
    if gitutil.in_repository(cwd):
        if not hooks.is_installed(cwd):
            _install_git_lfs(cwd, local, report)
        report.changed.extend(hooks.install_hooks(cwd))
    elif not local:
        _install_git_lfs(cwd, False, report)
    return report


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
