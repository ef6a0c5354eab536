"""A tiny third-party-style format plugin used by test_formats_registry: a single .npy array."""
import numpy as np

from zipslice.base import LazyCheckpoint
from zipslice.info import TensorInfo, contiguous_stride


def detect(head: bytes) -> bool:
    return head.startswith(b"\x93NUMPY")


class NpyCheckpoint(LazyCheckpoint):
    format = "npy-test"

    def __init__(self, path):
        super().__init__(path)
        arr = np.load(self.path, mmap_mode="r")
        shape = tuple(arr.shape)
        self._infos["array"] = TensorInfo(
            name="array", dtype="float32", shape=shape, stride=contiguous_stride(shape), storage="array",
            storage_offset=0, offset=int(arr.offset), span_nbytes=int(arr.nbytes), file=self.path)
        del arr
