"""What rebuilding groups may cost, checked from metadata before any blob is read.

Metadata comes from repositories others wrote; theta.storage.schema checked each field on its own. This
module checks what needs the update-type registry and arithmetic over a whole group or file:

- **chains**: every step type is installed; ``steps[0]`` is self-contained and every later step is
  incremental (a chain never restarts: theta writes ``[step]`` for a self-contained step); the last step's
  value has the group's dtype and shape;
- **work per group**: the values a chain materialises (one per step) total at most
  ``WORK_FACTOR`` x the group's bytes (1 MiB at least), and one step's parts decode to at most
  ``PARTS_FACTOR`` x (its input + its output) + ``PARTS_SLACK`` bytes, checked on the blob's header
  before decoding (:func:`theta.storage.codec.decode_parts`), which itself never allocates more than zstd's
  maximum ratio (32768x) times the blob;
- **work per file**: a checkout producing more than ``max_output`` bytes (``theta.maxCheckoutBytes``,
  default :data:`DEFAULT_MAX_OUTPUT`) is refused before it starts.

So rebuilding a group costs at most WORK_FACTOR x its declared bytes in values plus 32768 x the bytes of
the blobs it read, and a checkout at most WORK_FACTOR x a declared total that is itself capped.
"""
from __future__ import annotations

import math

from zipslice import dtypes

from theta.base.errors import ChainError, IntegrityError, MetadataError, UpdateTypeError
from theta.storage import codec
from theta.updates import get, step_layout

DEFAULT_MAX_OUTPUT = 1 << 40   # 1 TiB: more than any single checkpoint file of a released model
WORK_FACTOR = 64               # values materialised by one chain, per byte of the group (= schema.MAX_STEPS)
WORK_FLOOR = 1 << 20           # ... counted as at least 1 MiB (a chain of small groups costs little anyway)
PARTS_FACTOR = 16              # decoded parts of one step, per byte of its input + output value
PARTS_SLACK = 1 << 20


def layout_bytes(step, group) -> int:
    """Bytes of the value ``step`` produces in ``group``'s chain (its recorded layout, else the group's)."""
    dtype_name, shape = step_layout(step, group)
    return math.prod(shape) * dtypes.get(dtype_name).itemsize


def group_bytes(group) -> int:
    return math.prod(group.shape) * dtypes.get(group.dtype).itemsize


def where(file: str | None, group: str | None, step: int | None = None, oid: str | None = None) -> str:
    """'FILE: group NAME: step I (blob OID)' for the start of a message."""
    parts = [file or "metadata"]
    if group is not None:
        parts.append(f"group {group!r}")
    if step is not None:
        parts.append(f"step {step}" + (f" (blob {oid})" if oid else ""))
    elif oid:
        parts.append(f"blob {oid}")
    return ": ".join(parts)


def check_group(group, file: str | None = None) -> None:
    """Refuse a chain that is malformed or would cost more than the limits above (ChainError)."""
    steps = group.steps
    if not steps:
        raise ChainError(f"{where(file, group.name)}: the group has no steps", file=file, group=group.name)
    work = 0
    for i, step in enumerate(steps):
        try:
            ut = get(step.type)
        except UpdateTypeError as e:
            raise ChainError(f"{where(file, group.name, i, step.blob.oid)}: {e}", file=file, group=group.name,
                             oid=step.blob.oid) from None
        if bool(ut.incremental) != (i > 0):
            why = ("needs a previous value but is first" if ut.incremental else
                   "is self-contained but not first (a chain never restarts)")
            raise ChainError(f"{where(file, group.name, i, step.blob.oid)}: step type {step.type!r} {why}",
                             file=file, group=group.name, oid=step.blob.oid)
        try:
            work += layout_bytes(step, group)
        except (MetadataError, KeyError) as e:
            raise ChainError(f"{where(file, group.name, i, step.blob.oid)}: bad layout: {e}", file=file,
                             group=group.name, oid=step.blob.oid) from None
    last_dtype, last_shape = step_layout(steps[-1], group)
    if last_dtype != group.dtype or tuple(last_shape) != tuple(group.shape):
        raise ChainError(f"{where(file, group.name)}: the last step produces {last_dtype}{list(last_shape)}, "
                         f"the group is {group.dtype}{list(group.shape)}", file=file, group=group.name)
    limit = WORK_FACTOR * max(group_bytes(group), WORK_FLOOR)
    if work > limit:
        raise ChainError(f"{where(file, group.name)}: rebuilding the chain of {len(steps)} steps would "
                         f"materialise {work} bytes, over {WORK_FACTOR}x the group's size ({limit} bytes)",
                         file=file, group=group.name)


def parts_budget(input_bytes: int, output_bytes: int) -> int:
    """The most bytes one step's parts may decode to (checked on the blob's headers before decoding)."""
    return PARTS_FACTOR * (input_bytes + output_bytes) + PARTS_SLACK


def output_bytes(meta) -> int:
    """Bytes of tensor data a checkout of ``meta`` writes (aliases share their group's storage)."""
    if getattr(meta, "opaque", None) is not None:
        return meta.opaque.size
    return sum(group_bytes(g) for g in meta.groups.values())


def check_output(meta, file: str | None, max_output: int = DEFAULT_MAX_OUTPUT) -> int:
    """The checkout's output bytes; MetadataError before any work when over ``max_output``."""
    total = output_bytes(meta)
    if total > max_output:
        raise MetadataError(f"{file or 'metadata'}: declares {total} bytes of tensors, over the limit of "
                            f"{max_output} bytes (theta.maxCheckoutBytes / GIT_THETA_MAX_CHECKOUT_BYTES); "
                            "refusing to rebuild it", file=file)
    return total


def located(e: IntegrityError, file: str | None, group: str | None, step: int | None = None,
            oid: str | None = None) -> IntegrityError:
    """The same kind of error, its message prefixed with where it happened (unless it already says)."""
    message = str(e)
    prefix = where(file, group, step, oid)
    if file and message.startswith(file):
        return e
    out = type(e).__new__(type(e))
    IntegrityError.__init__(out, f"{prefix}: {message}", file=file, group=group, oid=oid or e.oid)
    return out


def check_parts_fit(blobs: dict, previous, kind: str, output_bytes: int | None = None) -> None:
    """Before decoding a step's part blobs straight from the store (``apply_blob``): their decoded size must
    be within :func:`parts_budget` of the value they apply to (a forged header cannot make theta allocate
    more). UpdateTypeError otherwise."""
    have = previous.nbytes if previous is not None else 0
    total = 0
    for name, blob in blobs.items():
        dt, shape = codec.array_info(blob)
        total += math.prod(shape) * dt.itemsize
    if total > parts_budget(have, have if output_bytes is None else output_bytes):
        raise UpdateTypeError(f"{kind} update parts would decode to {total} bytes, more than a step on a value of "
                              f"{have} bytes may")
