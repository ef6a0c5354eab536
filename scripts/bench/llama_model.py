#!/usr/bin/env python3
"""The Llama-3-8B-shaped checkpoint and its versions (``write_version``, ``Dims``, ``LLAMA3_8B_4L``...): its
one home is tests/support/llama_model.py, shared with the tests and loaded here by file name (as harness.py
loads tests/support/memcg.py: putting tests/ on sys.path would let its folders named zipslice/ and theta/
shadow the packages). Run it to write versions from a shell:

    python3 scripts/bench/llama_model.py --out /tmp/data --versions base,finetune
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # (the model module imports zipslice)


def _load():
    name = "theta_bench_llama_model"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "support" / "llama_model.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: dataclasses looks the module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


_model = _load()
globals().update({k: v for k, v in vars(_model).items() if not k.startswith("__")})

if __name__ == "__main__":
    sys.exit(_model.main())
