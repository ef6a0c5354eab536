"""theta: version ML checkpoints in git parameter group by parameter group, with groups stored in Git LFS.

Most people use theta through git (``git theta install``, ``git theta track``, then plain ``git add``,
``git checkout``, ``git merge``). The names below are the Python API for doing the same work without git:
clean a checkpoint into metadata, rebuild it, diff and merge versions, and find the installed plugins:

    import theta

    store = theta.LfsStore.for_repo(".")                  # git-lfs's local object store of this repository
    meta = theta.clean_checkpoint("model.pt", store)      # groups stored as blobs; metadata returned
    text = theta.dumps_metadata(meta)                     # the text git stores in place of the checkpoint
    theta.smudge_checkpoint(theta.loads_metadata(text), store, "copy.pt")

    sha = theta.save_to_git(model.state_dict(), "model.pt", "epoch 3")   # a commit, no file written
    weights = theta.load_from_git(sha, "model.pt")        # that version, lazily

This module is the package's public face only: it imports nothing from the layers below until a name is
first used, so ``git theta`` commands that need none of them start fast. Everything else under ``theta.``
is internal and may change between versions.
"""
from __future__ import annotations

import importlib

# (not `from typing import ...`: typing costs ~10 ms, and git's filter process imports this package before it
# answers git's handshake; the annotations are strings)
TYPE_CHECKING = False

# public name -> (module, attribute in that module)
_EXPORTS: dict[str, tuple[str, str]] = {
    # any committed version of a tracked checkpoint, lazily, with zipslice.load's API (theta.model.lazy)
    "load": ("theta.model.lazy", "load"),
    # commits from Python without writing the checkpoint (Git-Theta's names), and from a Trainer (transformers)
    "save_to_git": ("theta.inprocess.commit", "save_to_git"),
    "load_from_git": ("theta.inprocess.commit", "load_from_git"),
    "ThetaTrainerCallback": ("theta.inprocess.trainer", "ThetaTrainerCallback"),
    # clean: checkpoint -> metadata (+ blobs); smudge: metadata (+ blobs) -> checkpoint
    "clean_checkpoint": ("theta.model.clean", "clean_checkpoint"),
    "CleanOptions": ("theta.model.clean", "CleanOptions"),
    "CleanStats": ("theta.model.clean", "CleanStats"),
    "smudge_checkpoint": ("theta.model.smudge", "smudge_checkpoint"),
    # storage: the blob store and the metadata text
    "LfsStore": ("theta.storage.store", "LfsStore"),
    "BlobRef": ("theta.storage.store", "BlobRef"),
    "CheckpointMeta": ("theta.storage.metadata", "CheckpointMeta"),
    "GroupMeta": ("theta.storage.metadata", "GroupMeta"),
    "loads_metadata": ("theta.storage.metadata", "loads"),
    "dumps_metadata": ("theta.storage.metadata", "dumps"),
    "is_metadata": ("theta.storage.metadata", "is_metadata"),
    # diff: two versions, group by group
    "diff_sides": ("theta.model.diff", "diff_sides"),
    "MetaSide": ("theta.model.diff", "MetaSide"),
    "CheckpointSide": ("theta.model.diff", "CheckpointSide"),
    "FileDiff": ("theta.model.diff", "FileDiff"),
    # merge: plan from metadata, then execute group by group
    "plan_merge": ("theta.merges.plan", "plan_merge"),
    "execute_merge": ("theta.merges.plan", "execute"),
    "MergePlan": ("theta.merges.plan", "MergePlan"),
    # plugins: update types and merge strategies (entry points theta.updates / theta.merges)
    "update_types": ("theta.updates", "names"),
    "get_update_type": ("theta.updates", "get"),
    "UpdateType": ("theta.updates", "UpdateType"),
    "Encoded": ("theta.updates", "Encoded"),
    "reconstruct": ("theta.updates.rebuild", "reconstruct"),
    "merge_strategies": ("theta.merges", "names"),
    "get_merge_strategy": ("theta.merges", "get"),
    "MergeStrategy": ("theta.merges", "MergeStrategy"),
    # the base of every error theta raises on purpose (subclasses: theta.base.errors)
    "ThetaError": ("theta.base.errors", "ThetaError"),
}

__all__ = [
    "__version__",
    "load",
    "save_to_git", "load_from_git", "ThetaTrainerCallback",
    "clean_checkpoint", "CleanOptions", "CleanStats", "smudge_checkpoint",
    "LfsStore", "BlobRef", "CheckpointMeta", "GroupMeta", "loads_metadata", "dumps_metadata", "is_metadata",
    "diff_sides", "MetaSide", "CheckpointSide", "FileDiff",
    "plan_merge", "execute_merge", "MergePlan",
    "update_types", "get_update_type", "UpdateType", "Encoded", "reconstruct",
    "merge_strategies", "get_merge_strategy", "MergeStrategy",
    "ThetaError",
]

if TYPE_CHECKING:  # for type checkers and the API reference; at run time names load on first use
    from theta.model.clean import CleanOptions, CleanStats, clean_checkpoint
    from theta.model.diff import CheckpointSide, FileDiff, MetaSide, diff_sides
    from theta.base.errors import ThetaError
    from theta.model.lazy import load
    from theta.inprocess.commit import load_from_git, save_to_git
    from theta.inprocess.trainer import ThetaTrainerCallback
    from theta.merges import MergeStrategy
    from theta.merges import get as get_merge_strategy
    from theta.merges import names as merge_strategies
    from theta.merges.plan import MergePlan, plan_merge
    from theta.merges.plan import execute as execute_merge
    from theta.model.smudge import smudge_checkpoint
    from theta.storage.metadata import CheckpointMeta, GroupMeta, is_metadata
    from theta.storage.metadata import dumps as dumps_metadata
    from theta.storage.metadata import loads as loads_metadata
    from theta.storage.store import BlobRef, LfsStore
    from theta.updates import Encoded, UpdateType
    from theta.updates.rebuild import reconstruct
    from theta.updates import get as get_update_type
    from theta.updates import names as update_types


def __getattr__(name: str) -> object:
    """Load a public name on first use (PEP 562) and keep it in the module for the next lookup."""
    if name == "__version__":  # one version for the distribution (zipslice-theta), from its package metadata
        from zipslice.version import package_version

        return package_version()
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'theta' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | {"__version__"})
