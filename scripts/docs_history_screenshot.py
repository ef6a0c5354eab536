#!/usr/bin/env python3
"""Make the pictures of `git theta log` shown in docs/guide/merging.md: a small Llama-named model committed
through git theta in a history of typical changes, its page (`git theta log --html`) captured by headless
Chromium, and its PNG (`git theta log --png`).

    python3 scripts/docs_history_screenshot.py            # writes docs/images/theta-log-page.png, theta-log.png

Needs Chromium (`apt-get install chromium`, or $CHROMIUM) and matplotlib (the `plot` extra). The repository is
made in a temporary directory with its own HOME; nothing else is touched.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from harness import git_env, sh, this_checkout_first  # noqa: E402

PATH = "model.safetensors"
LAYERS, D, VOCAB = 6, 64, 512


def model(rng) -> dict[str, np.ndarray]:
    m = {"model.embed_tokens.weight": rng.normal(0, .02, (VOCAB, D)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj.weight", (D, D)), ("self_attn.k_proj.weight", (D // 2, D)),
                            ("self_attn.v_proj.weight", (D // 2, D)), ("self_attn.o_proj.weight", (D, D)),
                            ("mlp.up_proj.weight", (4 * D, D)), ("mlp.down_proj.weight", (D, 4 * D))):
            m[p + name] = rng.normal(0, .02, shape).astype(np.float32)
        m[p + "input_layernorm.weight"] = np.ones(D, np.float32)
    m["model.norm.weight"] = np.ones(D, np.float32)
    m["lm_head.weight"] = rng.normal(0, .02, (VOCAB, D)).astype(np.float32)
    return m


def tune(m, rng, prefixes, scale):
    for k in m:
        if k.startswith(prefixes):
            m[k] = m[k] + rng.normal(0, scale, m[k].shape).astype(np.float32)


def history(repo: Path, env: dict) -> None:
    rng = np.random.default_rng(7)
    m = model(rng)

    def commit(msg):
        save_file(m, str(repo / PATH))
        sh(["git", "add", PATH], repo, env)
        sh(["git", "commit", "-q", "-m", msg], repo, env)

    commit("pretrained checkpoint")
    tune(m, rng, ("model.",), 2e-4)
    commit("fine-tune all layers, lr 1e-5")
    tune(m, rng, ("model.layers.4.", "model.layers.5."), 2e-3)
    commit("fine-tune the top two layers")
    m["model.layers.2.self_attn.o_proj.weight"][:4] += 0.05
    commit("patch four rows of layer 2's attention")
    extra = rng.normal(0, .02, (32, D)).astype(np.float32)
    m["model.embed_tokens.weight"] = np.concatenate([m["model.embed_tokens.weight"], extra])
    m["lm_head.weight"] = np.concatenate([m["lm_head.weight"], extra])
    commit("add 32 tokens to the vocabulary")
    m["model.layers.0.self_attn.q_proj.bias"] = np.zeros(D, np.float32)
    del m["model.norm.weight"]
    commit("a bias for layer 0's queries; drop the final norm")
    tune(m, rng, ("model.layers.",), 5e-4)
    commit("fine-tune again, lr 3e-5")


def screenshot(chromium: str, page: Path, out: Path, width: int, height: int, unfold: str) -> None:
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={out}",
                        page.resolve().as_uri() + f"#unfold={unfold}"],
                       check=True, capture_output=True, timeout=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    a = ap.parse_args()
    chromium = os.environ.get("CHROMIUM") or next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                                                                "google-chrome")) if p), None)
    if chromium is None:
        raise SystemExit("needs Chromium: apt-get install chromium (or set CHROMIUM)")
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="theta-docs-") as tmp:
        work = Path(tmp)
        env = git_env(work / "home", pythonpath=True)
        env["PYTHONPATH"] = this_checkout_first(env)
        env.update({"GIT_AUTHOR_DATE": "2025-03-01T12:00:00Z", "GIT_COMMITTER_DATE": "2025-03-01T12:00:00Z"})
        repo = work / "repo"
        sh(["git", "init", "-q", repo], work, env)
        for cmd in (["git", "config", "user.name", "Theta Docs"], ["git", "config", "user.email", "docs@example.com"],
                    ["git", "theta", "install", "--local"], ["git", "theta", "track", "*.safetensors"],
                    ["git", "add", ".gitattributes"], ["git", "commit", "-q", "-m", "track checkpoints"]):
            sh(cmd, repo, env)
        history(repo, env)
        page = work / "history.html"
        sh(["git", "theta", "log", "-q", "--html", page, "--png", a.out / "theta-log.png", "--", PATH], repo, env)
        screenshot(chromium, page, a.out / "theta-log-page.png", 1100, 900, "model.layers.2")
    for name in ("theta-log-page.png", "theta-log.png"):
        print(f"wrote {a.out / name} ({(a.out / name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
