"""theta's layers (docs/design/architecture.md): imports only point down, and no module imports itself back.

Read from the source with ast (every import, including those inside functions), so a new upward or
circular import fails here rather than in review.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THETA = ROOT / "theta"

# rank of each layer: a module may import modules of its own rank or lower
LAYERS = {
    "theta.commands": 6,
    "theta.settings": 5,
    "theta.model": 4, "theta.merges": 4, "theta.peers": 4,
    "theta.updates": 3,
    # commits from Python (save_to_git, the Trainer callback): entry points, like the commands
    "theta.inprocess": 6,
    "theta.storage": 2,
    "theta.git": 1,
    "theta.base": 0,
}
# theta/__init__.py is the public API: it re-exports names from every layer (loaded lazily), so it sits above
# them all, and no module of theta may import it (a module importing `theta` itself would import upward).
FACADE = "theta"
FACADE_RANK = max(LAYERS.values()) + 1


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> tuple[str, int]:
    if module == FACADE:
        return "theta (public API)", FACADE_RANK
    found = [k for k in LAYERS if module == k or module.startswith(k + ".")]
    if not found:
        raise LookupError(f"{module} is in no layer: put it in a layer's folder, or give its folder a rank in LAYERS")
    best = max(found, key=len)
    return best, LAYERS[best]


def imports_of(path: Path, top: str = "theta") -> set[str]:
    """The modules of package ``top`` that the module at ``path`` imports."""
    tree = ast.parse(path.read_text(), str(path))
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == top}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != top:
                continue
            for a in node.names:  # `from theta.storage import codec` imports the module theta.storage.codec
                sub = f"{mod}.{a.name}"
                out.add(sub if (ROOT / (sub.replace(".", "/") + ".py")).exists()
                        or (ROOT / sub.replace(".", "/")).is_dir() else mod)
    return out


MODULES = sorted(THETA.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    me = module_name(path)
    my_layer, my_rank = layer_of(me)
    upward = []
    for imported in imports_of(path):
        layer, rank = layer_of(imported)
        if rank > my_rank:
            upward.append(f"{imported} ({layer}, rank {rank})")
    assert not upward, f"{me} ({my_layer}, rank {my_rank}) imports upward: {', '.join(sorted(upward))}"


def test_every_module_is_in_a_layer():
    """No catch-all: a new top-level module or folder must be given its place on purpose."""
    lost = []
    for path in MODULES:
        try:
            layer_of(module_name(path))
        except LookupError as e:
            lost.append(str(e))
    assert not lost, "; ".join(lost)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at its top or inside functions alike)."""
    paths = sorted((root / package).rglob("*.py"))
    graph = {module_name(p): {i for i in imports_of(p, package)} for p in paths}
    return {m: {i for i in deps if i in graph and i != m} for m, deps in graph.items()}


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if seen.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in seen:
                visit(d)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    return cycles


@pytest.mark.parametrize("package", ["theta", "zipslice", "tempo"])
def test_no_import_cycles(package):
    """Not even through imports inside functions, nor between a package and its own submodules: a package that
    imports a submodule which imports the package back is a cycle too."""
    cycles = cycles_in(import_graph(ROOT, package))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_every_git_subprocess_goes_through_the_git_layer():
    offenders = []
    for path in MODULES:
        if module_name(path).startswith("theta.git"):
            continue
        text = path.read_text()
        if '["git"' in text or "['git'" in text:
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"modules running git themselves (use theta.git.repo): {offenders}"


def test_every_exception_class_lives_in_errors():
    offenders = []
    for path in MODULES:
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception", "Conflict"))
                    for b in node.bases):
                offenders.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert not offenders, f"exception classes outside theta/base/errors.py: {offenders}"
