"""zipslice.optional: a missing optional package is one line naming it, its extra and what works without it."""
import pickle
import sys
import tomllib
from pathlib import Path

import pytest

from zipslice import optional
from zipslice.errors import MissingDependencyError

ROOT = Path(__file__).resolve().parents[2]


def test_every_extra_named_installs_its_package():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in optional.EXTRAS.items():
        assert any(req.startswith(module) for req in extras[extra]), (module, extra)
    assert any(req.startswith("torch") for req in extras["tempo"])


def test_a_missing_package_is_one_line_and_a_module_not_found_error(monkeypatch):
    for name in ("matplotlib", "matplotlib.pyplot"):  # what `import matplotlib` meets without the package,
        monkeypatch.setitem(sys.modules, name, None)  # even after another test imported it
    with pytest.raises(MissingDependencyError) as e:
        optional.require("matplotlib.pyplot", "--png needs it", "--html draws the same heat map")
    assert str(e.value) == ('matplotlib is not installed, and --png needs it: pip install "zipslice-theta[plot]" '
                            "(without matplotlib, --html draws the same heat map)")
    assert isinstance(e.value, ModuleNotFoundError) and e.value.name == "matplotlib"
    again = pickle.loads(pickle.dumps(e.value))  # (raised in a worker process, it crosses back whole)
    assert type(again) is MissingDependencyError and str(again) == str(e.value) and again.extra == "plot"


def test_a_broken_install_raises_its_own_error(tmp_path, monkeypatch):
    """Only the package's own absence is a missing extra; a package that fails to import says why itself."""
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("import a_module_nobody_has\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as e:
        optional.require("brokenpkg", "a test needs it")
    assert type(e.value) is ModuleNotFoundError and e.value.name == "a_module_nobody_has"


def test_a_present_package_is_returned():
    assert optional.require("json", "nothing") is sys.modules["json"]
