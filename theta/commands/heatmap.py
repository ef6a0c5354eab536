"""The pictures of a checkpoint's history (:mod:`theta.model.history`): an HTML page and a PNG image.

The page is one self-contained file: an HTML table (a row per group, folded by layer; a column per commit), its
colours computed here, a style sheet, and a short script of its own that folds and unfolds layers (no network,
no library; ``page.html#unfold=model.layers.3,model.layers.7`` opens with those layers unfolded). Each cell
carries its figures in ``data-`` attributes (full precision) and a ``title`` shown on hover (rounded).

Colour: ``log10(‖Δ‖/‖old‖)`` on the viridis scale between the decades that hold the history's smallest and
largest change; unchanged groups are light grey; added, removed, reshaped and retyped groups are white with a
mark (``+``, ``−``, ``↔``, ``T``; a layer's mark over its colour when some of its groups also changed in place);
a change whose size is unknown (no norms, no signatures) shows ``?``.

The PNG (:func:`write_png`) draws the same folded rows with matplotlib, imported only then (the ``plot``
extra).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path

from theta.model.history import STRUCTURAL, Cell, FoldedCell, History

# matplotlib's viridis at 0, 0.1, ..., 1 (the PNG uses matplotlib's own table: the same colours)
VIRIDIS = ("#440154", "#482475", "#414487", "#355f8d", "#2a788e", "#21918c", "#22a884", "#44bf70", "#7ad151",
           "#bddf26", "#fde725")
UNCHANGED = "#e8e8e8"
ABSENT = "#ffffff"
MARKS = {"added": "+", "removed": "\u2212", "reshaped": "\u2194", "retyped": "T"}
UNKNOWN = "?"


@dataclass(frozen=True)
class Scale:
    """Decades of the colour scale: ``10**lo`` .. ``10**hi``."""

    lo: int
    hi: int

    def position(self, rel: float) -> float:
        """Where ``rel`` (> 0) falls on the scale, 0..1 (clamped)."""
        if math.isinf(rel):
            return 1.0
        return min(1.0, max(0.0, (math.log10(rel) - self.lo) / (self.hi - self.lo)))

    def colour(self, rel: float) -> str:
        return _interpolate(self.position(rel))


def scale_of(values) -> Scale:
    """The decades that hold every finite positive value (at least one decade; 1e-6..1 when there is none)."""
    finite = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not finite:
        return Scale(-6, 0)
    lo, hi = math.floor(math.log10(min(finite))), math.ceil(math.log10(max(finite)))
    return Scale(lo, hi if hi > lo else lo + 1)


def _interpolate(t: float) -> str:
    x = t * (len(VIRIDIS) - 1)
    i = min(int(x), len(VIRIDIS) - 2)
    f = x - i
    a, b = _rgb(VIRIDIS[i]), _rgb(VIRIDIS[i + 1])
    return "#" + "".join(f"{round(p + (q - p) * f):02x}" for p, q in zip(a, b))


def _rgb(hexcolour: str) -> tuple[int, int, int]:
    return int(hexcolour[1:3], 16), int(hexcolour[3:5], 16), int(hexcolour[5:7], 16)


def human(n: int | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _num(x: float | None) -> str:
    return "" if x is None else repr(float(x))


def _g(x: float | None) -> str:
    if x is None:
        return "unknown"
    if math.isinf(x):
        return "inf"
    return f"{x:.4g}"


# ------------------------------------------------------------------------------------------------- cells

def cell_look(status: str, rel: float | None, scale: Scale) -> tuple[str, str]:
    """(background colour, mark) of a cell."""
    if status == "absent":
        return ABSENT, ""
    if status in STRUCTURAL:
        return ABSENT, MARKS[status]
    if status == "unchanged":
        return UNCHANGED, ""
    if rel is None:
        return UNCHANGED, UNKNOWN
    if rel == 0:
        return _interpolate(0.0), ""
    return scale.colour(rel), ""


def folded_look(f: FoldedCell, scale: Scale) -> tuple[str, str, str]:
    """(status, background colour, mark) of a layer: the mark of a structural change, over the colour of its
    groups' change when some of them changed in place too."""
    st = folded_status(f)
    colour, mark = cell_look(st, f.relative, scale)
    if st in STRUCTURAL and f.statuses.get("modified") and f.relative is not None:
        colour = cell_look("modified", f.relative, scale)[0]
    return st, colour, mark


def folded_status(f: FoldedCell) -> str:
    """One status for a layer: the structural change of any of its groups, else modified/unchanged/absent."""
    for s in STRUCTURAL:
        if f.statuses.get(s):
            return s
    if f.statuses.get("modified"):
        return "modified"
    return "unchanged" if f.statuses.get("unchanged") else "absent"


def group_title(name: str, commit: str, c: Cell) -> str:
    lines = [f"{name} @ {commit}: {c.status}"]
    if c.status == "modified" or (c.status == "unchanged" and c.base is not None):
        rel = c.relative
        lines.append(f"\u2016\u0394\u2016/\u2016old\u2016 = {_g(rel)}" + (f" ({c.how})" if c.how else ""))
        lines.append(f"\u2016\u0394\u2016 = {_g(c.change)}, \u2016old\u2016 = {_g(c.base)}")
        if c.changed is not None and c.numel:
            lines.append(f"elements changed: {c.changed:,} of {c.numel:,} ({100 * c.changed / c.numel:.1f}%)")
    if c.status != "absent":
        lines.append(f"stored: {c.stored or '-'}" + (f", {human(c.stored_bytes)}" if c.stored_bytes else ""))
    return "\n".join(lines)


def layer_title(name: str, commit: str, f: FoldedCell, size: int) -> str:
    changed = f.changed_groups
    kinds = ", ".join(f"{n} {s}" for s, n in sorted(f.statuses.items()) if s not in ("unchanged", "absent"))
    lines = [f"{name} @ {commit}: {changed} of {size} groups changed" + (f" ({kinds})" if kinds else "")]
    if f.relative is not None:
        lines.append(f"\u2016\u0394\u2016/\u2016old\u2016 over the layer = {_g(f.relative)}"
                     + (f" ({', '.join(sorted(f.how))})" if f.how else ""))
    if f.stored:
        lines.append("stored: " + ", ".join(f"{s} \u00d7{n}" for s, n in sorted(f.stored.items()))
                     + (f"; {human(f.stored_bytes)}" if f.stored_bytes else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- pages

_STYLE = """
body{font:13px/1.35 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 4px}
.sub{color:#555;margin:0 0 10px}
.legend{display:flex;gap:18px;align-items:center;flex-wrap:wrap;margin:6px 0 12px}
.legend .bar{display:inline-flex;align-items:center;gap:6px}
.legend .ramp{width:220px;height:12px;border:1px solid #999}
.legend .sw{display:inline-block;width:14px;height:14px;border:1px solid #bbb;text-align:center;line-height:14px;
 font-size:11px;vertical-align:middle;margin-right:3px}
.controls button{font:inherit;margin-right:6px}
table.heat{border-collapse:separate;border-spacing:1px}
table.heat th{font-weight:normal;text-align:left;white-space:nowrap;padding:0 6px 0 0;
 font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
table.heat thead th.commit{vertical-align:bottom;padding:0;width:26px;max-width:26px}
table.heat thead th.commit div{writing-mode:vertical-rl;transform:rotate(180deg);white-space:nowrap;
 max-height:330px;overflow:hidden;text-overflow:ellipsis;padding:2px 0;font-family:inherit}
table.heat thead th.commit .id{font-weight:bold}
td.cell{width:26px;min-width:26px;height:16px;padding:0;text-align:center;font-size:11px;font-weight:bold;
 color:#333;border:1px solid transparent;cursor:default}
td.cell.marked{border-color:#999;text-shadow:0 0 2px #fff,0 0 2px #fff}
tr.layer th{cursor:pointer;font-weight:600}
tr.layer th .toggle{display:inline-block;width:1em;color:#666}
tr.group.child th{padding-left:20px;color:#444}
tr.group[hidden]{display:none}
tfoot th{font-family:inherit !important;color:#555}
tfoot td{font-size:10px;color:#333;text-align:center;padding:2px 0;vertical-align:bottom}
tfoot td div.v{writing-mode:vertical-rl;transform:rotate(180deg);white-space:nowrap;display:inline-block}
.notes{color:#8a5a00;margin-top:10px}
.bars td{padding:1px 6px 1px 0;white-space:nowrap}
.bars td.name{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.bars .track{width:360px;height:14px;background:#f6f6f6;position:relative}
.bars .fill{height:14px;position:absolute;left:0;top:0}
.bars .fig{font-variant-numeric:tabular-nums;color:#333}
.bars tr.layer td.name{font-weight:600;cursor:pointer}
.bars tr.child td.name{padding-left:20px}
.bars tr[hidden]{display:none}
"""

_SCRIPT = """
(function(){
  function toggle(key, open){
    var head=document.querySelector('tr.layer[data-layer="'+CSS.escape(key)+'"]');
    if(!head) return;
    if(open===undefined) open=head.getAttribute('aria-expanded')!=='true';
    head.setAttribute('aria-expanded', open?'true':'false');
    head.querySelector('.toggle').textContent=open?'\\u25be':'\\u25b8';
    document.querySelectorAll('tr.child[data-parent="'+CSS.escape(key)+'"]').forEach(function(r){r.hidden=!open;});
  }
  document.querySelectorAll('tr.layer').forEach(function(r){
    r.querySelector('.name, th').addEventListener('click', function(){toggle(r.dataset.layer);});
  });
  function all(open){document.querySelectorAll('tr.layer').forEach(function(r){toggle(r.dataset.layer, open);});}
  var u=document.getElementById('unfold'), f=document.getElementById('fold');
  if(u) u.addEventListener('click', function(){all(true);});
  if(f) f.addEventListener('click', function(){all(false);});
  var m=/^#unfold=(.+)$/.exec(location.hash);
  if(m) decodeURIComponent(m[1]).split(',').forEach(function(k){toggle(k, true);});
})();
"""


def _legend(scale: Scale) -> str:
    stops = ", ".join(f"{c} {100 * i / (len(VIRIDIS) - 1):.0f}%" for i, c in enumerate(VIRIDIS))
    marks = "".join(f'<span><span class="sw" style="background:{ABSENT}">{html.escape(m)}</span>{s}</span>'
                    for s, m in MARKS.items())
    return (f'<div class="legend"><span class="bar">\u2016\u0394\u2016/\u2016old\u2016 '
            f'1e{scale.lo} <span class="ramp" style="background:linear-gradient(90deg, {stops})"></span> '
            f'1e{scale.hi}</span>'
            f'<span><span class="sw" style="background:{UNCHANGED}"></span>unchanged</span>{marks}'
            f'<span><span class="sw" style="background:{UNCHANGED}">{UNKNOWN}</span>changed, size unknown</span>'
            f'</div>')


def _page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="generator" content="git theta">'
            f'<title>{html.escape(title)}</title><style>{_STYLE}</style></head>\n<body>\n{body}\n'
            f'<script>{_SCRIPT}</script>\n</body></html>\n')


def _td(colour: str, mark: str, title: str, attrs: dict) -> str:
    data = "".join(f' data-{k}="{html.escape(str(v), quote=True)}"' for k, v in attrs.items())
    cls = "cell marked" if mark and mark != UNKNOWN else "cell"
    return (f'<td class="{cls}" style="background:{colour}" title="{html.escape(title, quote=True)}"{data}>'
            f'{html.escape(mark)}</td>')


def _cell_attrs(c: Cell, commit: int) -> dict:
    return {"commit": commit, "status": c.status, "stored": c.stored, "bytes": c.stored_bytes,
            "change": _num(c.change), "base": _num(c.base), "rel": _num(c.relative),
            "changed": "" if c.changed is None else c.changed, "how": c.how or ""}


def _all_relatives(h: History) -> list[float | None]:
    out = [c.relative for row in h.cells for c in row if c.status == "modified"]
    for row in h.rows():
        if row.layer:
            out += [h.folded(row, k).relative for k in range(len(h.commits))]
    return out


def log_page(h: History, title: str | None = None) -> str:
    """The page of a history: the heat map, its legend and per-commit totals."""
    scale = scale_of(_all_relatives(h))
    n = len(h.commits)
    rows = h.rows()
    head = ['<tr><th class="corner">group</th>']
    for k, c in enumerate(h.commits):
        tip = f"{c.id}\n{c.subject}\n{c.author}, {c.date}"
        head.append(f'<th class="commit" data-commit="{k}" data-id="{c.id}" title="{html.escape(tip, quote=True)}">'
                    f'<div><span class="id">{c.id[:7]}</span> {html.escape(c.date[:10])} '
                    f'{html.escape(c.subject[:40])}</div></th>')
    head.append("</tr>")
    body = []
    for row in rows:
        if row.layer:
            body.append(f'<tr class="layer" data-layer="{html.escape(row.name, quote=True)}" aria-expanded="false">'
                        f'<th class="name"><span class="toggle">\u25b8</span>{html.escape(row.name)} '
                        f'<span class="n">({len(row.members)})</span></th>')
            for k, c in enumerate(h.commits):
                f = h.folded(row, k)
                st, colour, mark = folded_look(f, scale)
                attrs = {"commit": k, "status": st, "changed-groups": f.changed_groups, "bytes": f.stored_bytes,
                         "rel": _num(f.relative)}
                body.append(_td(colour, mark, layer_title(row.name, c.id[:7], f, len(row.members)), attrs))
            body.append("</tr>")
        for i in row.members:
            name = h.groups[i]
            child = row.layer
            cls = "group child" if child else "group"
            parent = f' data-parent="{html.escape(row.name, quote=True)}" hidden' if child else ""
            body.append(f'<tr class="{cls}" data-group="{html.escape(name, quote=True)}"{parent}>'
                        f'<th>{html.escape(name[len(row.name) + 1:] if child else name)}</th>')
            for k, commit in enumerate(h.commits):
                c = h.cells[k][i]
                colour, mark = cell_look(c.status, c.relative, scale)
                body.append(_td(colour, mark, group_title(name, commit.id[:7], c), _cell_attrs(c, k)))
            body.append("</tr>")
    foot = []
    for label, key, vertical in (("groups changed", "changed", False), ("bytes stored", "stored", True),
                                 ("a fresh clone fetches", "fetch", True)):
        foot.append(f'<tr class="total" data-total="{key}"><th>{label}</th>')
        for k, t in enumerate(h.totals):
            v = getattr(t, key)
            shown = f'<div class="v">{html.escape(human(v))}</div>' if vertical else str(v)
            tip = f"{label}: {v:,}" + (f" bytes ({human(v)})" if vertical else "")
            foot.append(f'<td data-commit="{k}" data-value="{v}" title="{html.escape(tip)}">{shown}</td>')
        foot.append("</tr>")
    layers = sum(1 for r in rows if r.layer)
    sub = (f"{n} commit{'s' if n != 1 else ''} that changed it, oldest first; {len(h.groups)} groups"
           f"{f' ({layers} layers, click one to unfold it)' if layers else ''}. Colour: how much each group "
           f"changed against the commit before (\u2016new \u2212 old\u2016 / \u2016old\u2016, log scale). "
           f"Hover a cell for its figures and how the commit stored it.")
    notes = "".join(f"<div>{html.escape(x)}</div>" for x in h.notes)
    controls = ('<div class="controls"><button id="unfold" type="button">unfold all</button>'
                '<button id="fold" type="button">fold all</button></div>' if layers else "")
    content = (f'<h1>{html.escape(h.path)}</h1><p class="sub">{html.escape(sub)}</p>{_legend(scale)}{controls}'
               f'<table class="heat" data-groups="{len(h.groups)}" data-commits="{n}" data-layers="{layers}">'
               f'<thead>{"".join(head)}</thead><tbody>{"".join(body)}</tbody><tfoot>{"".join(foot)}</tfoot></table>'
               + (f'<div class="notes">{notes}</div>' if notes else ""))
    return _page(title or f"theta log: {h.path}", content)


@dataclass
class MergeRow:
    """What a merge did to one group: ``decision`` in words, and the strategy configured for it now."""

    decision: str
    strategy: str = ""


def diff_page(h: History, old_label: str, merge: dict[str, MergeRow] | None = None) -> str:
    """The page of one pair (``h`` has one commit, compared with ``old_label``): a bar per group, folded by
    layer; with ``merge`` (the new side is a merge commit), what the merge did to each group."""
    assert len(h.commits) == 1
    scale = scale_of(_all_relatives(h))
    c = h.commits[0]
    cells = h.cells[0]
    out = ['<table class="bars" data-groups="%d"><thead><tr><th>group</th><th>status</th>'
           '<th>\u2016\u0394\u2016/\u2016old\u2016 (log scale)</th><th></th><th>stored</th>%s</tr></thead><tbody>'
           % (len(h.groups), "<th>merge</th>" if merge is not None else "")]

    def bar(status: str, rel: float | None, mark: str, colour: str) -> str:
        if status == "modified" and rel is not None and rel > 0:
            w = max(1.0, 100 * scale.position(rel))
            return (f'<div class="track"><div class="fill" style="width:{w:.1f}%;background:{colour}"></div></div>')
        return f'<div class="track" style="background:{colour if status == "unchanged" else "#f6f6f6"}">' \
               f'<b>{html.escape(mark)}</b></div>'

    for row in h.rows():
        if row.layer:
            f = h.folded(row, 0)
            st, colour, mark = folded_look(f, scale)
            out.append(f'<tr class="layer" data-layer="{html.escape(row.name, quote=True)}" aria-expanded="false" '
                       f'data-status="{st}" data-rel="{_num(f.relative)}" '
                       f'title="{html.escape(layer_title(row.name, c.id[:7], f, len(row.members)), quote=True)}">'
                       f'<td class="name"><span class="toggle">\u25b8</span>{html.escape(row.name)} '
                       f'({len(row.members)})</td><td>{f.changed_groups} changed</td>'
                       f'<td>{bar(st, f.relative, mark, colour)}</td><td class="fig">{_g(f.relative)}</td>'
                       f'<td>{human(f.stored_bytes)}</td>{"<td></td>" if merge is not None else ""}</tr>')
        for i in row.members:
            name, cell = h.groups[i], cells[i]
            colour, mark = cell_look(cell.status, cell.relative, scale)
            attrs = "".join(f' data-{k}="{html.escape(str(v), quote=True)}"' for k, v in _cell_attrs(cell, 0).items())
            child = row.layer
            shown = name[len(row.name) + 1:] if child else name
            parent = f' data-parent="{html.escape(row.name, quote=True)}" hidden' if child else ""
            m = merge.get(name) if merge is not None else None
            mtd = "" if merge is None else (
                f'<td class="merge" data-decision="{html.escape(m.decision if m else "", quote=True)}">'
                f'{html.escape(m.decision if m else "")}'
                f'{html.escape(f" ({m.strategy})") if m and m.strategy else ""}</td>')
            out.append(f'<tr class="bar{" child" if child else ""}" data-group="{html.escape(name, quote=True)}"'
                       f'{parent}{attrs} '
                       f'title="{html.escape(group_title(name, c.id[:7], cell), quote=True)}">'
                       f'<td class="name">{html.escape(shown)}</td><td>{cell.status}</td>'
                       f'<td>{bar(cell.status, cell.relative, mark, colour)}</td>'
                       f'<td class="fig">{_g(cell.relative) if cell.status == "modified" else ""}</td>'
                       f'<td>{html.escape(cell.stored)}{(" " + human(cell.stored_bytes)) if cell.stored_bytes else ""}'
                       f'</td>{mtd}</tr>')
    out.append("</tbody></table>")
    t = h.totals[0]
    layers = sum(1 for r in h.rows() if r.layer)
    sub = (f"{old_label} \u2192 {c.id[:10]} ({c.subject}): {t.changed} of {len(h.groups)} groups differ; "
           f"{human(t.stored)} stored by the new side; a fresh clone of it fetches {human(t.fetch)}.")
    controls = ('<div class="controls"><button id="unfold" type="button">unfold all</button>'
                '<button id="fold" type="button">fold all</button></div>' if layers else "")
    merge_note = ""
    if merge is not None:
        merge_note = ('<p class="sub">The new side is a merge commit: the last column says, per group, which '
                      'parent its value comes from, as its metadata shows (theta does not record the strategy '
                      'a merge used; the one configured now is named where a value differs from both parents).</p>')
    notes = "".join(f"<div>{html.escape(x)}</div>" for x in h.notes)
    body = (f'<h1>{html.escape(h.path)}</h1><p class="sub">{html.escape(sub)}</p>{merge_note}{_legend(scale)}'
            f'{controls}{"".join(out)}' + (f'<div class="notes">{notes}</div>' if notes else ""))
    return _page(f"theta diff: {h.path}", body)


# ------------------------------------------------------------------------------------------------- PNG

def write_png(h: History, path: str | Path, dpi: int = 120) -> None:
    """The heat map of ``h``, layers folded, as a PNG (matplotlib: the ``plot`` extra)."""
    import matplotlib  # imported here: only --png needs it, and it is an optional extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap, LogNorm, to_rgba

    rows = h.rows()
    n = len(h.commits)
    scale = scale_of(_all_relatives(h))
    grid = [[to_rgba(ABSENT)] * n for _ in rows]
    marks = []
    for r, row in enumerate(rows):
        for k in range(n):
            if row.layer:
                _, colour, mark = folded_look(h.folded(row, k), scale)
            else:
                c = h.cells[k][row.members[0]]
                colour, mark = cell_look(c.status, c.relative, scale)
            grid[r][k] = to_rgba(colour)
            if mark:
                marks.append((k, r, mark))
    width = min(40.0, max(7.0, 3.2 + 0.3 * n))
    height = min(60.0, max(3.5, 2.0 + 0.22 * len(rows)))
    fig, ax = plt.subplots(figsize=(width, height))
    ax.imshow(grid, aspect="auto", interpolation="nearest")
    for x, y, m in marks:
        ax.text(x, y, m, ha="center", va="center", fontsize=7, color="#333")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r.name + (f" ({len(r.members)})" if r.layer else "") for r in rows], fontsize=7,
                       family="monospace")
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{c.id[:7]} {c.subject[:24]}" for c in h.commits], rotation=60, ha="right", fontsize=7)
    ax.set_xticks([x - 0.5 for x in range(1, n)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    ax.set_title(f"{h.path}: \u2016\u0394\u2016/\u2016old\u2016 per group and commit", fontsize=9)
    cmap = ListedColormap(list(VIRIDIS))
    sm = plt.cm.ScalarMappable(norm=LogNorm(10.0 ** scale.lo, 10.0 ** scale.hi),
                               cmap=matplotlib.colors.LinearSegmentedColormap.from_list("v", cmap.colors))
    fig.colorbar(sm, ax=ax, fraction=0.03, pad=0.01)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
