"""A version Git-Theta committed, as a lazy checkpoint: what :func:`theta.load_from_git` returns for it.

:class:`GitThetaCheckpoint` has the API of :func:`zipslice.load` over the checkpoint Git-Theta checks out for
that metadata (:class:`theta.peers.gittheta.files.GitThetaFile`): its names, nesting, dtypes and shapes known
from the metadata and the blobs' headers, each group rebuilt from its blobs when it is read. Nothing is written.
"""
from __future__ import annotations

import math
import os

from zipslice import dtypes
from zipslice.base import LazyCheckpoint
from zipslice.errors import ZipsliceError
from zipslice.info import TensorInfo, contiguous_stride

from theta.base.errors import ThetaDependencyError, ThetaError
from theta.model.lazy import reduce_as_checkpoint
from theta.peers.gittheta.files import GitThetaFile


class GitThetaCheckpoint(LazyCheckpoint):
    """The checkout of Git-Theta metadata ``gtf``, read lazily (``name``: how errors name it, e.g. ``REV:PATH``).
    The LFS objects it needs that are not local are fetched when it opens (a Git-Theta group's dtype is known
    from its blobs' headers)."""

    format = "torch"

    def __init__(self, gtf: GitThetaFile, name: str):
        super().__init__(name)
        self.gtf = gtf
        self.structure = gtf.structure
        try:
            gtf.fetch()
            found = [(key, dtypes.from_numpy(gtf.dtype(key)).name) for key in gtf.names()]
        except ThetaDependencyError:  # (already one line: which package, which extra)
            raise
        except ThetaError as e:
            raise ZipsliceError(self.path, str(e)) from None
        for key, dt in found:
            shape = gtf.shape(key)
            self._infos[key] = TensorInfo(
                name=key, dtype=dt, shape=shape, stride=contiguous_stride(shape), storage=key, storage_offset=0,
                offset=None, span_nbytes=dtypes.get(dt).itemsize * math.prod(shape),
                file=self.path)

    def __reduce_ex__(self, protocol):
        return reduce_as_checkpoint(self, self.structure, protocol)

    def _read_span(self, info: TensorInfo) -> bytes:
        if self._closed:
            raise ZipsliceError(self.path, "checkpoint is closed")
        try:
            return bytes(dtypes.le_bytes(self.gtf.value(info.name)))
        except ThetaDependencyError:  # (already one line: which package, which extra)
            raise
        except ThetaError as e:
            raise ZipsliceError(self.path, str(e), info.name) from None

    def data_file_bytes(self) -> int:
        return sum(i.span_nbytes for i in self._infos.values())

    def dropping_behind(self) -> bool:
        return False


def open_version(data: bytes, spec: str, rel: str, top: "str | os.PathLike", store) -> GitThetaCheckpoint:
    """``REV:PATH``'s Git-Theta metadata ``data`` (``rel``: PATH from the top of the work tree ``top``)."""
    return GitThetaCheckpoint(GitThetaFile(data, rel, top, store, label=spec), spec)
