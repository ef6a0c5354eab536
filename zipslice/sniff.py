"""Tell a checkpoint's format from its first bytes, never from its name."""
from __future__ import annotations

import os
import struct

from .errors import NotACheckpointError, UnsupportedCheckpointError

ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
LFS_POINTER = b"version https://git-lfs.github.com/spec/"
THETA_METADATA = b"theta-metadata "  # a git-theta placeholder (theta registers a plugin that reads it)
# torch.save before 1.6 (and later with _use_new_zipfile_serialization=False) writes a bare pickle
# stream starting with its magic number 0x1950a86a20f9469cfc6c as a pickled long. Its opcodes depend
# on the pickle protocol: LONG1 after PROTO (2, 3) or after PROTO + FRAME (4, 5); text LONG for 0 and 1.
_LEGACY_LONG1 = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
_LEGACY_TEXT = b"L119547037146038801333356L\n"
_FRAME = 0x95


def is_legacy_torch(head: bytes) -> bool:
    """Does ``head`` start with the legacy torch magic number, pickled with any protocol 0-5?"""
    if head.startswith(_LEGACY_TEXT):
        return True
    if len(head) < 2 or head[0] != 0x80 or not 2 <= head[1] <= 5:
        return False
    body = head[2:]
    if head[1] >= 4 and body[:1] == bytes([_FRAME]):
        body = body[9:]  # FRAME + 8-byte frame length
    return body.startswith(_LEGACY_LONG1)


def sniff(path: str | os.PathLike) -> str:
    """Return "torch", "safetensors", "hdf5", "sharded" or "torch-legacy"; raise NotACheckpointError otherwise."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(4096)
        size = os.fstat(f.fileno()).st_size
    if size == 0:
        raise NotACheckpointError(path, "the file is empty (0 bytes), not a checkpoint")
    if head.startswith(ZIP_MAGICS):
        return "torch"
    # HDF5 may sit behind a user block of 512 * 2^n bytes.
    if head.startswith(HDF5_MAGIC):
        return "hdf5"
    with open(path, "rb") as f:
        for off in (512, 1024, 2048, 4096, 8192):
            if off >= size:
                break
            f.seek(off)
            if f.read(8) == HDF5_MAGIC:
                return "hdf5"
    if head.startswith(LFS_POINTER):
        raise NotACheckpointError(
            path, "this is a Git LFS pointer file, not the checkpoint; run `git lfs pull` (or `git lfs install`) "
                  "to fetch its content")
    if head.startswith(THETA_METADATA):
        raise NotACheckpointError(
            path, "this is a git-theta placeholder (the metadata of a checkpoint versioned with git-theta), not "
                  "the checkpoint; in its repository run `git theta checkout PATH` (or `git theta pull` in a clone "
                  "made without theta); zipslice reads it in place when theta is installed")
    if is_legacy_torch(head):
        return "torch-legacy"
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        # A header length past the end still means safetensors (truncated): the reader says so precisely.
        # Text whose 9th byte is "{" gives a huge n (its 8th byte is printable), hence the bound.
        if head[8:9] == b"{" and 0 < n < 1 << 32:
            return "safetensors"
    stripped = head.lstrip()
    low = stripped[:200].lower()
    if low.startswith((b"<!doctype html", b"<html", b"<head", b"<?xml")):
        raise NotACheckpointError(path, "this is an HTML/XML page (a failed download?), not a checkpoint")
    if stripped.startswith(b"{") and b"weight_map" in head:
        return "sharded"
    if head[:1] == b"\x80":
        raise UnsupportedCheckpointError(
            path, "this is a bare pickle, not a torch zip checkpoint; only the zip format (torch>=1.6) is read")
    raise NotACheckpointError(path, f"unrecognised file: first bytes {head[:16]!r} match no checkpoint format")
