"""theta: version ML checkpoints in git parameter group by parameter group, with groups stored in Git LFS."""
__version__ = "0.1.0"


def load(path, rev=None, *, fetch=True):
    """Open a theta-tracked checkpoint lazily, with the API of ``zipslice.load`` -- any committed version.

    ``theta.load("model.pt", rev="HEAD~3")`` reads that version's groups straight from the blob store (missing
    blobs fetched on demand), never writing the file; ``rev=None`` opens the work-tree file (a placeholder
    reads the version it stands for). See :mod:`theta.lazy`.
    """
    from theta.lazy import load as _load

    return _load(path, rev, fetch=fetch)
