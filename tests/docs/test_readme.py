"""The README stays a short front door: its quick-start commands exist, and every link it has resolves."""
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_short():
    assert len(README.splitlines()) <= 250


def test_the_two_quick_start_commands_exist_and_run():
    for script in ("scripts/run-demo.sh", "scripts/run-tests.sh"):
        assert f"./{script}" in README
        assert os.access(ROOT / script, os.X_OK), script


def test_every_relative_link_resolves():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    relative = [link for link in links if "://" not in link]
    assert relative, "the README links into docs/"
    missing = [link for link in relative if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
