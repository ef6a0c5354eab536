"""Test layout: tests/<package or kind>/test_*.py; shared helpers in tests/support (imported as `support`)."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))                 # the checkout's packages, before any installed copy
sys.path.insert(1, str(ROOT / "tests"))       # `import support`
os.environ.setdefault("GIT_TERMINAL_PROMPT", "0")

# Property tests: the default run replays the same examples every time (a red CI names a real regression, not a
# new random draw); HYPOTHESIS_PROFILE=explore draws new ones on each run.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("deterministic", derandomize=True, database=None)
_hypothesis_settings.register_profile("explore", derandomize=False)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
