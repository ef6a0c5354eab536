"""tempo stays optional: zipslice and theta never import it, and tempo imports transformers only when a
model already did."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("package", ["zipslice", "theta"])
def test_package_does_not_import_tempo(package):
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "tempo" or n.startswith("tempo.") for n in names), path


def test_import_tempo_does_not_import_transformers():
    pytest.importorskip("torch")
    code = "import sys, tempo, torch; tempo.patch(torch.nn.GELU()); assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
