"""theta's public API (theta/__init__.py): every name in __all__ resolves, and importing theta stays cheap."""
import subprocess
import sys
from pathlib import Path

import theta
import theta.model.clean
import theta.merges.plan
import theta.storage.metadata

ROOT = Path(__file__).resolve().parents[2]


def test_every_public_name_resolves_to_the_object_it_documents():
    assert theta.__all__ == ["__version__", *theta._EXPORTS]  # the literal list and the loader agree
    for name in theta.__all__:
        assert getattr(theta, name) is not None, name
    assert set(theta.__all__) <= set(dir(theta))
    # renamed re-exports are the very objects of their home modules, not copies
    assert theta.loads_metadata is theta.storage.metadata.loads
    assert theta.dumps_metadata is theta.storage.metadata.dumps
    assert theta.execute_merge is theta.merges.plan.execute
    assert theta.clean_checkpoint is theta.model.clean.clean_checkpoint


def test_unknown_names_raise_attribute_error():
    try:
        theta.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("theta.no_such_name resolved")


def test_importing_theta_loads_no_model_layer_until_a_name_is_used():
    code = ("import sys, theta, theta.git.repo; "
            "print(sorted(m for m in sys.modules if m.startswith(('theta.model.clean', 'theta.model.smudge', 'numpy')))); "
            "theta.CleanOptions; print('theta.model.clean' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    before, after = out.stdout.splitlines()
    assert before == "[]"
    assert after == "True"
