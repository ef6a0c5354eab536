"""Crafted (hostile) repositories: theta metadata written by hand and committed with git plumbing.

    evil = Attacker.create(genv)
    ref = evil.blob({"values": np.zeros(16, np.float32)})          # a real theta blob, on the remote
    evil.commit({"model.pt": meta_text([group_line("w", "float32", [16], ref)])})
    evil.push()
    res = victim_clone(genv, evil.url, "clone")                    # time limit + memory cap

The attacker's repository has no theta installed: what it commits is exactly the bytes given
(``git hash-object -w --no-filters``, ``update-index --cacheinfo``, ``write-tree``, ``commit-tree``). Blobs
are written where git-lfs's file transfer finds them on the ``file://`` remote (``<bare>/lfs/objects``),
as a real server would hold them. The victim has theta installed globally, as a user would.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from theta.storage import codec
from theta.storage.store import BlobRef

from support.gitrepo import GitEnv, Repo
from support.limits import Limited, run_limited

ATTRIBUTES = "*.pt filter=theta diff=theta merge=theta -text\n"
LSH = {"family": "e2lsh-fold", "k": 16, "pool": 65536, "seed": 20240917, "w": 1e-06}
CLONE_TIMEOUT = 60.0
CLONE_MEMORY = 1 << 30


def line(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def value_hash(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr).view(np.uint8).tobytes()).hexdigest()


def step(kind: str, ref: BlobRef | dict, value_sha: str, params: dict | None = None) -> dict:
    oid, size = (ref.oid, ref.size) if isinstance(ref, BlobRef) else (ref["oid"], ref["size"])
    return {"type": kind, "oid": oid, "size": size, "params": params or {}, "hash": value_sha}


def group_line(name: str, dtype: str, shape, steps: list[dict], group_hash: str | None = None, **extra) -> dict:
    g = {"group": name, "dtype": dtype, "shape": list(shape) if isinstance(shape, (list, tuple)) else shape,
         "hash": group_hash if group_hash is not None else steps[-1]["hash"], "lsh": None, "param": False,
         "grad": False, "steps": steps}
    g.update(extra)
    return g


def meta_text(groups: list[dict], order: list[str] | None = None, structure=None, file_meta: dict | None = None,
              fmt: str = "torch", version: int = 1, extra_lines: list[str] = ()) -> str:
    """A metadata text from raw JSON objects (no validation: this is the attacker's pen)."""
    names = order if order is not None else [g["group"] for g in groups]
    lines = [f"theta-metadata {version}",
             line({"checkpoint": {"format": fmt, "lsh": LSH, "metadata": file_meta or {}}}),
             line({"structure": structure}),
             line({"order": names}),
             *[line(g) for g in sorted(groups, key=lambda g: str(g.get("group")))],
             *extra_lines]
    return "\n".join(lines) + "\n"


@dataclass
class Attacker:
    repo: Repo
    bare: Path

    @classmethod
    def create(cls, genv: GitEnv, name: str = "evil") -> "Attacker":
        bare = genv.init(f"{name}-remote.git", theta=False, bare=True)
        repo = genv.init(f"{name}-work", theta=False)
        repo.git("remote", "add", "origin", f"file://{bare.path}")
        return cls(repo, bare.path)

    @property
    def url(self) -> str:
        return f"file://{self.bare}"

    def raw_blob(self, data: bytes) -> BlobRef:
        """``data`` as an LFS object on the remote, under its true sha256."""
        ref = BlobRef(hashlib.sha256(data).hexdigest(), len(data))
        p = self.bare / "lfs" / "objects" / ref.oid[:2] / ref.oid[2:4] / ref.oid
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        return ref

    def blob(self, parts: dict[str, np.ndarray]) -> BlobRef:
        """A genuine theta blob of ``parts`` on the remote."""
        return self.raw_blob(codec.encode_parts(parts))

    def dense(self, name: str, arr: np.ndarray, dtype: str | None = None) -> dict:
        """A well-formed group line holding ``arr`` as one dense step."""
        from zipslice import dtypes

        ref = self.blob({"values": arr})
        h = value_hash(arr)
        return group_line(name, dtype or dtypes.from_numpy(arr.dtype).name, arr.shape, [step("dense", ref, h)])

    def commit(self, files: dict[str, "str | bytes"], message: str = "crafted",
               attributes: str | None = ATTRIBUTES) -> str:
        """A commit holding exactly ``files`` (and .gitattributes), made with plumbing, on top of HEAD."""
        r = self.repo
        if attributes is not None:
            files = {".gitattributes": attributes, **files}
        for path, data in files.items():
            raw = data.encode() if isinstance(data, str) else data
            sha = r.git("hash-object", "-w", "--no-filters", "--stdin", input=raw).stdout.decode().strip()
            r.git("update-index", "--add", "--cacheinfo", f"100644,{sha},{path}")
        tree = r.out("write-tree")
        parent = r.git("rev-parse", "-q", "--verify", "HEAD", check=False).stdout.decode().strip()
        args = ["commit-tree", tree, "-m", message] + (["-p", parent] if parent else [])
        commit = r.out(*args)
        r.git("update-ref", "refs/heads/main", commit)
        return commit

    def push(self) -> None:
        self.repo.git("push", "-q", "-f", "origin", "main")


def flip_byte(path: Path, at: int) -> None:
    """Flip the lowest bit of byte ``at`` of a stored (read-only) object, keeping its size."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def install_theta_globally(genv: GitEnv) -> None:
    genv.run(["git", "theta", "install"], cwd=genv.home)


def victim_clone(genv: GitEnv, url: str, name: str, timeout: float = CLONE_TIMEOUT,
                 memory: int | None = CLONE_MEMORY, extra_env: dict | None = None) -> tuple[Limited, Repo]:
    """``git clone`` as a user with theta installed would run it, under a time limit and a memory cap."""
    install_theta_globally(genv)
    dest = genv.home.parent / name
    res = run_limited(["git", "clone", "-q", url, str(dest)], cwd=genv.home, env={**genv.env, **(extra_env or {})},
                      timeout=timeout, memory=memory)
    return res, Repo(dest, genv)


def limited_git(repo: Repo, *args: str, timeout: float = CLONE_TIMEOUT, memory: int | None = CLONE_MEMORY,
                extra_env: dict | None = None, input: bytes | None = None) -> Limited:
    return run_limited(["git", *args], cwd=repo.path, env={**repo.env.env, **(extra_env or {})},
                       timeout=timeout, memory=memory, input=input)


def outside_store_reads(repo: Repo) -> list[str]:
    """Files of the victim's LFS store that are not named by their own sha256 (nothing may land there)."""
    bad = []
    d = repo.git_common_dir() / "lfs" / "objects"
    for p in d.glob("??/??/*"):
        if p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest() != p.name:
            bad.append(str(p))
    return bad


def leftovers(repo: Repo) -> list[str]:
    """Temp files theta could have left: in lfs/tmp and in .git/theta/tmp (what belongs to no live process)."""
    common = repo.git_common_dir()
    found = [str(p) for p in (common / "lfs" / "tmp").glob("*")] if (common / "lfs" / "tmp").exists() else []
    scratch = common / "theta" / "tmp"
    if scratch.exists():
        from theta.base import scratch as sc

        for p in scratch.iterdir():
            pid, _, start = p.name.partition("-")
            if not (pid.isdigit() and start.isdigit() and sc.alive(int(pid), int(start))):
                found.append(str(p))
    return found

