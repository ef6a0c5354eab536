"""numpy's matmul as a rule on shapes: the shape ``R @ C`` has, known before any data is read.

Git-Theta defines a low-rank update as ``R @ C + previous`` with numpy's matmul, so its factors of an N-d
parameter are stacks of matrices: a conv weight [16, 3, 3, 3] takes R [16, 3, 3, r] and C [r, 3] (or any pair
numpy broadcasts to it). Factors come from files (side-loaded update data, committed blobs): their shapes are
checked against the group's with :func:`matmul_shape` before anything is multiplied, so a hostile pair can
neither make a product larger than the group nor run longer than the group's size allows.
"""
from __future__ import annotations


def matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of ``np.matmul`` of arrays shaped ``a`` and ``b``; ValueError (what is wrong) when numpy would
    refuse them. A 1-d ``a`` is a row (its dimension then dropped), a 1-d ``b`` a column; the dimensions before
    the last two broadcast."""
    a, b = tuple(int(d) for d in a), tuple(int(d) for d in b)
    if not a or not b:
        raise ValueError(f"matmul needs at least one dimension on each side, got shapes {a} and {b}")
    a2 = a if len(a) > 1 else (1,) + a
    b2 = b if len(b) > 1 else b + (1,)
    if a2[-1] != b2[-2]:
        raise ValueError(f"R's last dimension ({a2[-1]}) is not C's {'first' if len(b) < 3 else 'second to last'} "
                         f"({b2[-2]}): shapes {a} and {b}")
    batch = broadcast(a2[:-2], b2[:-2])
    return batch + (a2[-2],) * (len(a) > 1) + (b2[-1],) * (len(b) > 1)


def broadcast(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcast of two shapes (aligned on the right; a 1 stretches); ValueError when they clash."""
    n = max(len(x), len(y))
    x, y = (1,) * (n - len(x)) + tuple(x), (1,) * (n - len(y)) + tuple(y)
    out = []
    for i, (p, q) in enumerate(zip(x, y)):
        if p != q and 1 not in (p, q):
            raise ValueError(f"batch dimensions {x} and {y} do not broadcast (dimension {i}: {p} and {q})")
        out.append(q if p == 1 else p)
    return tuple(out)

