"""Test layout: tests/<package or kind>/test_*.py; shared helpers in tests/support (imported as `support`)."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))                 # the checkout's packages, before any installed copy
sys.path.insert(1, str(ROOT / "tests"))       # `import support`
os.environ.setdefault("GIT_TERMINAL_PROMPT", "0")
