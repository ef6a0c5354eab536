"""The ``zipslice`` command: ls, show, info, convert, diff, completion.

Style (shared with ``git theta``, see :mod:`zipslice.clistyle`): ``-h`` everywhere, ``--version``, ``--json``
on every listing, ``-q`` for scripts; names are printed whole, last on their line, in natural order where
sorted. Errors (zipslice's own, a missing file or tensor, a bad option) print one line on stderr and exit
with status 2; ``diff`` exits 1 when the checkpoints differ (like diff(1)), 0 when they do not. Progress
bars appear on stderr only when stderr is a terminal.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import typer

from . import clistyle, dtypes, formats
from .clistyle import JSON_OPTION, QUIET_OPTION, columns, emit_json, natural_key, note, one_of, set_quiet
from .errors import MissingDependencyError, ZipsliceError
from .progress import Bar, human_bytes as human

EXIT_ERROR = 2
CAST_DTYPES = ("bfloat16", "float16", "float32")
SORT_ORDERS = ("file", "name", "size")


def _version() -> str:
    from .version import package_version

    return package_version()


app = clistyle.make_app(
    "zipslice", "Inspect, compare, slice and convert checkpoints (torch zip, safetensors, HDF5, sharded) "
                "without loading them whole.", version=_version)


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _heading(line: str) -> None:
    """A table's header line: bold on a terminal, and left out with -q (scripts want the rows only)."""
    if not clistyle.is_quiet():
        clistyle.out_console().print(line, style="bold", markup=False)


def _line(text: str) -> None:
    sys.stdout.write(text + "\n")


PATH_ARG = typer.Argument(..., metavar="PATH", help="A checkpoint: .pt/.bin, .safetensors, .h5, or a *.index.json.")


# -- ls --------------------------------------------------------------------------------------------

@app.command("ls")
def ls_cmd(path: Path = PATH_ARG,
           sort: str = typer.Option("file", "--sort", metavar="ORDER",
                                    help="Row order: file (as stored), name (natural: layer.2 before layer.10) "
                                         "or size (largest first).", **one_of(SORT_ORDERS, "sort order")),
           as_json: bool = JSON_OPTION, quiet: bool = QUIET_OPTION) -> None:
    """List tensors: dtype, shape, size, file offset and name. Reads only the index.

    The name comes last on each line and is never cut, so it can be copied into `zipslice show`.
    """
    import zipslice

    set_quiet(quiet)
    with zipslice.load(path) as lsd:
        infos = lsd.infos()
        views = {(i.file, i.storage, i.storage_offset, i.shape, i.stride): i.nbytes for i in infos}
        total, tied = sum(views.values()), len(infos) - len(views)  # tied weights counted once
        if sort == "name":
            infos.sort(key=lambda i: natural_key(i.name))
        elif sort == "size":
            infos.sort(key=lambda i: (-i.nbytes, natural_key(i.name)))
        if as_json:
            rows = [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "stride": list(i.stride),
                     "nbytes": i.nbytes, "offset": i.offset, "file": i.file, "storage": i.storage,
                     "is_parameter": i.is_parameter, "requires_grad": i.requires_grad} for i in infos]
            emit_json({"path": lsd.path, "format": lsd.format, "tensors": rows,
                       "total": {"tensors": len(infos), "nbytes": total, "tied": tied,
                                 "params": sum(i.numel for i in infos)}})
            return
        table = [["dtype", "shape", "size", "offset", "name"]]
        table += [[i.dtype, _shape(i.shape), human(i.nbytes), "-" if i.offset is None else str(i.offset),
                   clistyle.printable(i.name)] for i in infos]
        lines = columns(table, right=(2, 3))
        _heading(lines[0])
        for line in lines[1:]:
            _line(line)
        if not clistyle.is_quiet():
            _line(f"{len(infos)} tensors" + (f" ({tied} tied)" if tied else "") +
                  f", {sum(i.numel for i in infos):,} elements, {human(total)} ({lsd.format}: {lsd.path})")


# -- info ------------------------------------------------------------------------------------------

@app.command("info")
def info_cmd(path: Path = PATH_ARG, as_json: bool = JSON_OPTION) -> None:
    """Summary of a checkpoint: format, files, tensor count and size by dtype, metadata, non-tensor values."""
    import zipslice

    with zipslice.load(path) as lsd:
        infos = lsd.infos()
        by_dtype: dict[str, list[int]] = {}
        for i in infos:
            n = by_dtype.setdefault(i.dtype, [0, 0, 0])
            n[0] += 1
            n[1] += i.numel
            n[2] += i.nbytes
        files = sorted({i.file for i in infos}, key=natural_key) or [lsd.path]
        extras = {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
                  for k, v in lsd.extras.items()}
        data = {"path": lsd.path, "format": lsd.format, "files": files,
                "bytes_on_disk": sum(os.path.getsize(f) for f in files if os.path.isfile(f)),
                "tensors": len(infos), "elements": sum(i.numel for i in infos),
                "nbytes": sum(i.nbytes for i in infos),
                "dtypes": {d: {"tensors": n[0], "elements": n[1], "nbytes": n[2]}
                           for d, n in sorted(by_dtype.items(), key=lambda kv: -kv[1][2])},
                "metadata": dict(lsd.metadata or {}), "values": extras,
                "nested": lsd.structure is not None}
        if as_json:
            emit_json(data)
            return
    rows = [["format", data["format"]], ["files", str(len(files))],
            ["on disk", human(data["bytes_on_disk"])], ["tensors", f"{data['tensors']:,}"],
            ["elements", f"{data['elements']:,}"], ["tensor bytes", human(data["nbytes"])]]
    rows += [[f"  {d}", f"{v['tensors']} tensors, {v['elements']:,} elements, {human(v['nbytes'])}"]
             for d, v in data["dtypes"].items()]
    rows += [[f"metadata {clistyle.printable(k)}", _clip(v)] for k, v in data["metadata"].items()]
    rows += [[f"value {clistyle.printable(k)}", _clip(repr(v))] for k, v in data["values"].items()]
    _heading(data["path"])
    for line in columns(rows):
        _line(line)


def _clip(text: str, limit: int = 200) -> str:
    text = clistyle.printable(str(text))
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters; --json has all)"


# -- show ------------------------------------------------------------------------------------------

class RunningStats:
    """min, max, mean, std (correction=1, like torch.std) over finite values, NaN/Inf counts; chunk by chunk.

    Chunks are merged with Chan et al.'s pairwise update, so one float64 chunk is in memory at a time.
    """

    def __init__(self) -> None:
        self.count = self.nan = self.posinf = self.neginf = 0
        self.mean = self.m2 = 0.0
        self.min: Any = None
        self.max: Any = None

    def add(self, v: np.ndarray) -> None:
        if v.dtype.kind == "f":
            self.nan += int(np.count_nonzero(np.isnan(v)))
            self.posinf += int(np.count_nonzero(v == np.inf))
            self.neginf += int(np.count_nonzero(v == -np.inf))
            v = v[np.isfinite(v)]
        if v.size == 0:
            return
        lo, hi = v.min(), v.max()
        if v.dtype.kind in "iub":  # exact extremes for integers
            lo, hi = int(lo), int(hi)
        else:
            lo, hi = float(lo), float(hi)
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)
        w = v.astype(np.float64)
        n_b = w.size
        mean_b = float(w.mean())
        m2_b = float(np.square(w - mean_b).sum())
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean += delta * n_b / n
        self.m2 += m2_b + delta * delta * self.count * n_b / n
        self.count = n

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else float("nan")

    def as_dict(self) -> dict:
        return {"count": self.count, "min": self.min, "max": self.max,
                "mean": self.mean if self.count else float("nan"), "std": self.std,
                "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf}


def _stat_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Carrier values as numbers statistics can use (|z| for complex, float32 for ml_dtypes floats)."""
    from .diff import as_values

    dt = dtypes.get(dtype)
    v = as_values(raw, dtype)
    if dt.kind == "complex":
        return np.abs(v.astype(np.complex128))
    if dt.kind == "float" and v.dtype.kind != "f":
        return v.astype(np.float32)  # ml_dtypes floats (bfloat16, float8): widen, exactly, to a numpy float
    if dt.kind == "bool":
        return v.view(np.uint8)
    return v


def tensor_stats(lsd, key: str) -> tuple[dict, str]:
    """Streamed statistics of one tensor and what they describe ("values" or "|z|" for complex)."""
    from .diff import iter_chunks

    info = lsd.info(key)
    stats = RunningStats()
    for raw in iter_chunks(lsd, key):
        stats.add(_stat_values(raw, info.dtype))
    return stats.as_dict(), "|z|" if dtypes.get(info.dtype).kind == "complex" else "values"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _values_as_json(arr: np.ndarray, dtype: str) -> Any:
    dt = dtypes.get(dtype)
    if dt.kind == "complex":
        c = arr.astype(np.complex128)
        return np.stack([c.real, c.imag], axis=-1).tolist()
    if dt.kind == "float":
        return arr.astype(np.float64).tolist()  # exact for every float dtype up to float64
    return arr.tolist()


@app.command("show")
def show_cmd(path: Path = PATH_ARG,
             key: str = typer.Argument(..., metavar="NAME", help="Tensor name, as `zipslice ls` prints it."),
             rows: Optional[str] = typer.Option(None, "--rows", metavar="A:B",
                                                help="Print the values of rows A to B-1 (first dimension)."),
             index: Optional[str] = typer.Option(None, "--slice", metavar="INDEX",
                                                 help="Print the values of a slice, numpy style: '0:10, ::2' or "
                                                      "'..., 3'. Reads only the bytes the slice needs."),
             as_json: bool = JSON_OPTION) -> None:
    """Metadata of one tensor and statistics of its values (streamed), or the values of a slice of it.

    Statistics are streamed in chunks of 2^20 elements: min, max, mean and std over the finite values (std with
    correction 1, like torch.std), and the NaN / +Inf / -Inf counts; integer min and max are exact; complex
    tensors report |z|. With --rows or --slice, only the slice is read (see the guide, "Reading part of a
    tensor"), its values are printed after the table and the statistics describe the slice.
    """
    import zipslice
    from .slicing import parse_index

    if rows is not None and index is not None:
        raise typer.BadParameter("give --rows or --slice, not both", param_hint="'--rows' / '--slice'")
    spec = None
    if rows is not None or index is not None:
        text = rows if rows is not None else index
        try:
            spec = parse_index(text)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="'--rows'" if rows is not None else "'--slice'") from None
        if rows is not None and (len(spec) != 1 or not isinstance(spec[0], slice)):
            raise typer.BadParameter(f"{rows!r} is not a row range; write A:B", param_hint="'--rows'")
    with zipslice.load(path) as lsd:
        info = lsd.info(key)
        meta = {"name": info.name, "dtype": info.dtype, "shape": list(info.shape), "stride": list(info.stride),
                "storage_offset": info.storage_offset, "offset": info.offset, "nbytes": info.nbytes,
                "file": info.file, "storage": info.storage, "is_parameter": info.is_parameter,
                "requires_grad": info.requires_grad}
        values = None
        if spec is not None:
            try:
                raw = lsd.get_slice(key).raw(spec)
            except IndexError as e:
                raise typer.BadParameter(f"{e}", param_hint="'--rows'" if rows is not None else "'--slice'") from None
            values = raw
            stats = RunningStats()
            if raw.size:
                stats.add(_stat_values(raw.reshape(-1), info.dtype))
            stats_d, over = stats.as_dict(), "|z|" if dtypes.get(info.dtype).kind == "complex" else "values"
        else:
            stats_d, over = tensor_stats(lsd, key)
    if as_json:
        doc = {**meta, "stats_of": over, "stats": stats_d}
        if values is not None:
            doc["slice"] = rows if rows is not None else index
            doc["slice_shape"] = list(values.shape)
            doc["values"] = _values_as_json(values.view(dtypes.get(info.dtype).to_numpy())
                                            if dtypes.get(info.dtype).numpy else values, info.dtype)
        emit_json(doc)
        return
    table = [[k, _shape(v) if isinstance(v, list) else _fmt(v)] for k, v in meta.items() if k != "name"]
    label = (lambda k: k) if over == "values" else (lambda k: f"{k} of {over}")
    if values is not None:
        table.append(["slice", f"{rows if rows is not None else index} -> {_shape(values.shape)}"])
        label = (lambda k: f"{k} of slice") if over == "values" else (lambda k: f"{k} of slice |z|")
    table += [[label(k), _fmt(stats_d[k])] for k in ("min", "max", "mean", "std")]
    table.append(["NaN / +Inf / -Inf", f"{stats_d['nan']} / {stats_d['posinf']} / {stats_d['neginf']}"])
    _heading(clistyle.printable(info.name))
    for line in columns(table):
        _line(line)
    if values is not None:
        dt = dtypes.get(info.dtype)
        shown = values.view(dt.to_numpy()) if dt.numpy else values
        width = os.get_terminal_size().columns if sys.stdout.isatty() else 120
        _line(np.array2string(shown, max_line_width=width, threshold=1000, edgeitems=4))


# -- convert ---------------------------------------------------------------------------------------

def _parse_size(text: str | None) -> int | None:
    if text is None:
        return None
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0:
        raise typer.BadParameter(f"{text!r} is not a size; write e.g. 5GB, 500MiB or 1000000",
                                 param_hint="'--shard-size'")
    return int(value * units[unit])


@app.command("convert")
def convert_cmd(src: Path = typer.Argument(..., metavar="SRC", help="Checkpoint to read (any supported format)."),
                dst: Path = typer.Argument(..., metavar="DST",
                                           help="File to write, replaced atomically; a sharded checkpoint is "
                                                "written through its index, e.g. model.safetensors.index.json."),
                to: Optional[str] = typer.Option(None, "--to", metavar="FORMAT",
                                                 help="Output format: torch, safetensors, hdf5, sharded or a plugin's "
                                                      "(default: from DST's name).", **one_of(formats.writable, "format")),
                dtype: Optional[str] = typer.Option(None, "--dtype", metavar="DTYPE",
                                                    help="Cast floating tensors to bfloat16, float16 or float32.",
                                                    **one_of(CAST_DTYPES, "dtype to cast to")),
                shard_size: Optional[str] = typer.Option(None, "--shard-size", metavar="SIZE",
                                                         help="Largest shard of a sharded output (default 5GB)."),
                no_layout: bool = typer.Option(False, "--no-layout",
                                               help="Write a flat dict: drop nesting, ties and non-tensor values."),
                quiet: bool = QUIET_OPTION) -> None:
    """Convert a checkpoint one tensor at a time; nesting, ties and non-tensor values survive (see the docs).

    DST is written beside its final name and renamed over it once complete. Casting rounds to nearest even,
    like torch. A flat format gets a zipslice.layout metadata entry only when the torch file holds more than
    a plain dict of tensors (see the formats reference).
    """
    import zipslice
    from .convert import convert

    set_quiet(quiet)
    fmt = to
    if fmt is None:
        try:
            fmt = zipslice.format_for_path(dst)
        except ValueError:
            raise typer.BadParameter(f"cannot tell the output format from the name {str(dst)!r}; "
                                     f"pass --to {'|'.join(formats.writable())}", param_hint="'DST'") from None
    max_shard = _parse_size(shard_size)
    if max_shard is not None and fmt != "sharded":
        raise typer.BadParameter("only for a sharded output (DST named *.index.json, or --to sharded)",
                                 param_hint="'--shard-size'")
    if fmt == "sharded" and not str(dst).endswith(".index.json"):
        raise typer.BadParameter(f"a sharded checkpoint is written through its index: name DST like "
                                 f"model.safetensors.index.json, not {str(dst)!r}", param_hint="'DST'")
    with Bar(f"{src.name} → {dst.name}", enabled=not clistyle.is_quiet()) as bar:
        progress = bar.advance if bar.active else None
        r = convert(src, dst, to=fmt, dtype=dtype, progress=progress, keep_layout=not no_layout,
                    max_shard_bytes=max_shard)
    cast = f", {r.cast} cast to {dtype}" if dtype else ""
    note(f"wrote {r.dst} ({r.format}, {r.tensors} tensors, {human(r.nbytes)}{cast})")


# -- diff ------------------------------------------------------------------------------------------

@app.command("diff")
def diff_cmd(a: Path = typer.Argument(..., metavar="A", help="First checkpoint."),
             b: Path = typer.Argument(..., metavar="B", help="Second checkpoint (any format)."),
             show_all: bool = typer.Option(False, "--all", help="List unchanged tensors too."),
             as_json: bool = JSON_OPTION, quiet: bool = QUIET_OPTION) -> None:
    """Per tensor, in natural name order: added, removed or changed (dtype, shape, elements changed, max |a-b|).

    The two files may be of any formats; values are compared in chunks, so a huge tensor is never in memory
    twice. A dtype change counts as changed even when every value converts exactly. Non-tensor values
    (epoch counters, ...) are compared too. Exit status 0 when the checkpoints hold the same values, 1 when
    they differ.
    """
    from .diff import diff

    set_quiet(quiet)
    with Bar(f"{a.name} ↔ {b.name}", enabled=not clistyle.is_quiet()) as bar:
        progress = bar.advance if bar.active else None
        report = diff(a, b, progress=progress)
    report.tensors.sort(key=lambda t: natural_key(t.name))
    report.extras.sort(key=lambda e: natural_key(e.name))
    if as_json:
        emit_json(report.to_json())
    else:
        table = [["status", "dtype", "shape", "changed", "max |a-b|", "name"]]
        for t in report.tensors:
            if t.status == "same" and not show_all:
                continue
            da, db = t.dtype
            sa, sb = (_shape(s) if s is not None else None for s in t.shape)
            dtype_txt = da or db if da == db or None in (da, db) else f"{da} → {db}"
            shape_txt = sa or sb if sa == sb or None in (sa, sb) else f"{sa} → {sb}"
            changed = "-" if t.n_changed is None else f"{t.n_changed:,}/{t.numel:,}"
            table.append([t.status, dtype_txt, shape_txt, changed, _fmt(t.max_abs_diff), clistyle.printable(t.name)])
        for e in report.extras:
            if e.status != "same" or show_all:
                change = f"{e.a!r} → {e.b!r}" if e.status == "changed" else ""
                table.append([e.status, "(value)", "", "", clistyle.printable(change), clistyle.printable(e.name)])
        lines = columns(table, right=(3, 4))
        if len(lines) > 1:
            _heading(lines[0])
            for line in lines[1:]:
                _line(line)
        c = report.counts()
        if not clistyle.is_quiet():
            _line(f"{c['changed']} changed, {c['added']} added, {c['removed']} removed, {c['same']} same; "
                  f"{sum(e.status != 'same' for e in report.extras)} non-tensor value(s) differ")
    if not report.identical:
        raise typer.Exit(1)


# -- completion ------------------------------------------------------------------------------------

@app.command("completion")
def completion_cmd(shell: str = typer.Argument(..., metavar="SHELL", help="bash, zsh or fish.",
                                               **one_of(clistyle.SHELLS, "shell"))) -> None:
    """Print the shell completion script; e.g. `zipslice completion bash >> ~/.bashrc` (see the docs)."""
    sys.stdout.write(clistyle.completion_script("zipslice", shell))


# -- entry point -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app; expected failures become one line on stderr (status 2)."""
    errors = (ZipsliceError, MissingDependencyError, OSError, KeyError, ValueError)
    sys.exit(clistyle.run(app, "zipslice", argv, user_errors=errors, error_status=EXIT_ERROR))


if __name__ == "__main__":
    main()
