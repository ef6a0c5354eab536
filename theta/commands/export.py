"""`git theta export REV:PATH OUT`: write any committed version of a checkpoint without touching the work tree."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from theta.git import repo as gitutil
from theta.base.errors import ThetaError
from zipslice import clistyle, formats
from zipslice.clistyle import QUIET_OPTION, note, set_quiet


_SHARD_SUFFIX = {"safetensors": ".safetensors", "torch": ".bin", "hdf5": ".h5"}


def export(spec: str, out: str | os.PathLike, fmt: str | None = None, cwd=None, progress: bool | None = None,
           max_shard_bytes: int | None = None) -> str:
    """Rebuild ``spec`` (``REV:PATH``, or ``:PATH`` for the index) into ``out``; returns the format written.

    ``out`` named ``*.index.json`` writes a sharded checkpoint (:func:`theta.model.smudge.smudge_sharded`): shards
    of at most ``max_shard_bytes`` beside it in the format its name gives (``model.safetensors.index.json``:
    safetensors shards); ``fmt``, if given, must be that format. Returns ``"<format> shards"`` then.
    """
    from theta.storage.transfer import fetch_missing
    from theta.storage.metadata import is_metadata, loads
    from theta.model.smudge import smudge_checkpoint, smudge_sharded
    from theta.storage.store import LfsStore

    if ":" not in spec:
        raise ThetaError(f"{spec!r}: give REV:PATH (e.g. HEAD~1:model.pt)")
    sharded_out = os.fspath(out).endswith(".index.json")
    if sharded_out:
        shard_fmt = _shard_format(out)
        if fmt is not None and fmt != shard_fmt:
            raise ThetaError(f"{out}: an index named so lists {shard_fmt} shards, not {fmt}; name it "
                             f"NAME{_SHARD_SUFFIX.get(fmt, '.<ext>')}.index.json for {fmt} shards")
    elif max_shard_bytes is not None:
        raise ThetaError(f"{out}: --max-shard-size needs a sharded output, named NAME.safetensors.index.json")
    data = gitutil.read_blob(spec, cwd)
    if data is None:
        raise ThetaError(f"{spec}: no such file in git")
    if not is_metadata(data):
        raise ThetaError(f"{spec} is not a theta-tracked checkpoint (no theta metadata)")
    meta = loads(data, file=spec)
    store = LfsStore.for_repo(cwd or ".")
    fetch_missing(cwd or ".", meta.blob_refs(), store=store)
    show = sys.stderr.isatty() if progress is None else progress
    if sharded_out:
        for shard in smudge_sharded(meta, store, out, max_shard_bytes, progress=show, name=spec):
            default_mode(shard)
        default_mode(out)
        return f"{shard_fmt} shards"
    smudge_checkpoint(meta, store, os.fspath(out), fmt=fmt, progress=show)
    default_mode(out)
    return fmt or meta.format


def _shard_format(index) -> str:
    from zipslice.sharded import shard_format

    try:
        return shard_format(index)
    except ValueError as e:
        raise ThetaError(str(e)) from None


def default_mode(path) -> None:
    """The writers publish through mkstemp (mode 0600); give the exported file the usual 0666 & ~umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


# -- the verb -------------------------------------------------------------------------------------

def export_command(spec: str = typer.Argument(..., metavar="REV:PATH", help="A committed checkpoint, e.g. HEAD~2:model.pt."),
           out: Path = typer.Argument(..., metavar="OUT", help="Output file."),
           to: Optional[str] = typer.Option(None, "--to", metavar="FORMAT",
                                            help="torch, safetensors or hdf5 (default: as committed).",
                                            **clistyle.one_of(formats.one_file_writable, "format")),
           max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", metavar="SIZE",
                                                        help="Largest shard of a sharded OUT (default 5GB)."),
           quiet: bool = QUIET_OPTION) -> None:
    """Write a committed version of a checkpoint to OUT without touching the working tree.

    OUT named NAME.safetensors.index.json (or NAME.bin.index.json, NAME.h5.index.json) writes a sharded
    checkpoint: the index and shards NAME-00001-of-0000N.safetensors beside it, as transformers lays them out.
    """
    from theta.settings import parse_size

    set_quiet(quiet)
    limit = None
    if max_shard_size is not None:
        limit = parse_size(max_shard_size, "--max-shard-size")
        if limit <= 0:
            raise ThetaError(f"--max-shard-size {max_shard_size!r}: a shard must be allowed at least one byte")
    fmt = export(spec, out, to, max_shard_bytes=limit)
    note(f"wrote {out} ({fmt})")
