"""The ``zipslice`` command: ls, show, convert, diff.

Errors (zipslice's own, a missing file, a missing key, a bad option value) print one line on stderr and
exit with status 2; ``diff`` exits 1 when the checkpoints differ (like diff(1)), 0 when they do not.
Progress bars appear on stderr only when stderr is a terminal.
"""
from __future__ import annotations

import json
import math
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import click
import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from . import dtypes
from .progress import Bar, human_bytes as human
from .errors import ZipsliceError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Inspect, compare and convert checkpoints (torch zip, safetensors, HDF5) without loading "
                       "them whole.")
EXIT_ERROR = 2


class Format(str, Enum):
    torch = "torch"
    safetensors = "safetensors"
    hdf5 = "hdf5"


class CastDType(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def _out() -> Console:
    # a pipe or file gets wide rows (a table is only as wide as its content) rather than folded names
    return Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200)


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# -- ls --------------------------------------------------------------------------------------------

@app.command("ls")
def ls_cmd(path: Path = typer.Argument(..., help="checkpoint file"),
           as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """List tensors: name, dtype, shape, size, file offset (reads only the index)."""
    import zipslice

    with zipslice.load(path) as lsd:
        infos = lsd.infos()
        views = {(i.file, i.storage, i.storage_offset, i.shape, i.stride): i.nbytes for i in infos}
        total, tied = sum(views.values()), len(infos) - len(views)  # tied weights counted once
        if as_json:
            rows = [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape), "stride": list(i.stride),
                     "nbytes": i.nbytes, "offset": i.offset, "storage": i.storage,
                     "is_parameter": i.is_parameter, "requires_grad": i.requires_grad} for i in infos]
            print(json.dumps({"path": lsd.path, "format": lsd.format, "tensors": rows,
                              "total": {"tensors": len(infos), "nbytes": total, "tied": tied,
                                        "params": sum(i.numel for i in infos)}}, indent=1))
            return
        table = Table(title=f"{lsd.path} ({lsd.format})", show_footer=True)
        table.add_column("name", footer=f"{len(infos)} tensors" + (f" ({tied} tied)" if tied else ""),
                         overflow="fold")
        table.add_column("dtype")
        table.add_column("shape", footer=f"{sum(i.numel for i in infos):,} elements")
        table.add_column("size", justify="right", footer=human(total))
        table.add_column("offset", justify="right")
        for i in infos:
            table.add_row(i.name, i.dtype, _shape(i.shape), human(i.nbytes), "-" if i.offset is None else str(i.offset))
        _out().print(table)


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


def tensor_stats(lsd, key: str) -> tuple[dict, str]:
    """Streamed statistics of one tensor and what they describe ("values" or "|z|" for complex)."""
    from .diff import as_values, iter_chunks

    info = lsd.info(key)
    dt = dtypes.get(info.dtype)
    stats = RunningStats()
    for raw in iter_chunks(lsd, key):
        v = as_values(raw, info.dtype)
        if dt.kind == "complex":
            v = np.abs(v.astype(np.complex128))
        elif dt.kind == "float" and v.dtype.kind != "f":
            v = v.astype(np.float32)  # ml_dtypes floats (bfloat16, float8): widen, exactly, to a numpy float
        elif dt.kind == "bool":
            v = v.view(np.uint8)
        stats.add(v)
    return stats.as_dict(), "|z|" if dt.kind == "complex" else "values"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


@app.command("show")
def show_cmd(path: Path = typer.Argument(..., help="checkpoint file"),
             key: str = typer.Argument(..., help="tensor name (as listed by `zipslice ls`)"),
             as_json: bool = typer.Option(False, "--json", help="machine-readable output")) -> None:
    """Metadata of one tensor and statistics of its values, streamed in chunks."""
    import zipslice

    with zipslice.load(path) as lsd:
        info = lsd.info(key)
        stats, over = tensor_stats(lsd, key)
        meta = {"name": info.name, "dtype": info.dtype, "shape": list(info.shape), "stride": list(info.stride),
                "storage_offset": info.storage_offset, "offset": info.offset, "nbytes": info.nbytes,
                "storage": info.storage, "is_parameter": info.is_parameter, "requires_grad": info.requires_grad}
        if as_json:
            clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in stats.items()}
            print(json.dumps({**meta, "stats_of": over, "stats": clean}, indent=1))
            return
        table = Table(show_header=False, title=f"{lsd.path} [{key}]")
        table.add_column("field", style="bold")
        table.add_column("value", overflow="fold")
        for k, v in meta.items():
            table.add_row(k, _shape(v) if isinstance(v, list) else ("-" if v is None else str(v)))
        for k in ("min", "max", "mean", "std"):
            table.add_row(f"{k} of {over}" if over != "values" else k, "-" if stats[k] is None else _fmt(stats[k]))
        table.add_row("NaN / +Inf / -Inf", f"{stats['nan']} / {stats['posinf']} / {stats['neginf']}")
        _out().print(table)


# -- convert ---------------------------------------------------------------------------------------

@app.command("convert")
def convert_cmd(src: Path = typer.Argument(..., help="checkpoint to read (any supported format)"),
                dst: Path = typer.Argument(..., help="file to write (replaced atomically)"),
                to: Optional[Format] = typer.Option(None, "--to", help="output format (default: from DST's extension)"),
                dtype: Optional[CastDType] = typer.Option(None, "--dtype", help="cast floating tensors to this dtype"),
                no_layout: bool = typer.Option(False, "--no-layout",
                                               help="write a flat dict; drop nesting, ties and non-tensor values")) -> None:
    """Convert one tensor at a time; nesting, ties and non-tensor values survive (see docs)."""
    from .convert import convert

    with Bar(f"{src.name} → {dst.name}") as bar:
        progress = bar.advance if bar.active else None
        r = convert(src, dst, to=to.value if to else None, dtype=dtype.value if dtype else None,
                    progress=progress, keep_layout=not no_layout)
    cast = f", {r.cast} cast to {dtype.value}" if dtype else ""
    print(f"wrote {r.dst} ({r.format}, {r.tensors} tensors, {human(r.nbytes)}{cast})")


# -- diff ------------------------------------------------------------------------------------------

@app.command("diff")
def diff_cmd(a: Path = typer.Argument(..., help="first checkpoint"),
             b: Path = typer.Argument(..., help="second checkpoint (any format)"),
             as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
             show_all: bool = typer.Option(False, "--all", help="list unchanged tensors too")) -> None:
    """Per tensor: added / removed / changed (dtype, shape, elements changed, max abs diff). Exit 1 if they differ."""
    from .diff import diff

    with Bar(f"{a.name} ↔ {b.name}") as bar:
        progress = bar.advance if bar.active else None
        report = diff(a, b, progress=progress)
    if as_json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        table = Table(title=f"{report.a} → {report.b}")
        for col in ("status", "name", "dtype", "shape", "changed", "max |a-b|"):
            numeric = col in ("changed", "max |a-b|")
            table.add_column(col, overflow="fold", justify="right" if numeric else "left", no_wrap=numeric)
        for t in report.tensors:
            if t.status == "same" and not show_all:
                continue
            da, db = t.dtype
            sa, sb = (_shape(s) if s is not None else None for s in t.shape)
            dtype_txt = da or db if da == db or None in (da, db) else f"{da} → {db}"
            shape_txt = sa or sb if sa == sb or None in (sa, sb) else f"{sa} → {sb}"
            changed = "-" if t.n_changed is None else f"{t.n_changed:,}/{t.numel:,}"
            mad = "-" if t.max_abs_diff is None else _fmt(t.max_abs_diff)
            table.add_row(t.status, t.name, dtype_txt, shape_txt, changed, mad)
        for e in report.extras:
            if e.status != "same" or show_all:
                table.add_row(e.status, e.name, "(value)", "", "", f"{e.a!r} → {e.b!r}" if e.status == "changed" else "")
        console = _out()
        if table.rows:
            console.print(table)
        c = report.counts()
        console.print(f"{c['changed']} changed, {c['added']} added, {c['removed']} removed, {c['same']} same; "
                      f"{sum(e.status != 'same' for e in report.extras)} non-tensor value(s) differ")
    if not report.identical:
        raise typer.Exit(1)


# -- entry point -----------------------------------------------------------------------------------

def _one_line(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    return str(e) or type(e).__name__


# typer >= 0.2x vendors its own click; catch both its classes and click's
_ABORTS = tuple({click.exceptions.Abort, getattr(typer, "Abort", click.exceptions.Abort)})
_EXITS = tuple({click.exceptions.Exit, getattr(typer, "Exit", click.exceptions.Exit)})
_USAGE_ERRORS = tuple({click.ClickException, getattr(typer, "TyperException", click.ClickException)})


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app and turn expected failures into one line on stderr."""
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="zipslice", standalone_mode=False)
    except _ABORTS:
        print("zipslice: aborted", file=sys.stderr)
        sys.exit(130)
    except _EXITS as e:
        sys.exit(e.exit_code)
    except _USAGE_ERRORS as e:  # bad arguments: click's usage message and status 2
        e.show()
        sys.exit(getattr(e, "exit_code", EXIT_ERROR))
    except (ZipsliceError, OSError, KeyError, ValueError) as e:
        print(f"zipslice: error: {_one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_ERROR)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
