import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GIT_TERMINAL_PROMPT", "0")
