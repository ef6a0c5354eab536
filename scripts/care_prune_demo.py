#!/usr/bin/env python3
"""What `git lfs prune` and `git theta prune` do to a theta repository, measured with the real tools.

Builds the repository of tests/e2e/test_care_prune.py (unpushed branch and commits, two stash entries, a
second worktree with a commit and a staged version, a staged version, a reflog-only commit, an orphan blob,
v1 pushed to a giftless LFS server on 127.0.0.1), then prints, for each prune, how many objects git-lfs's
directory and theta's protected directory hold and how many needed blobs are still intact. The same run
is repeated with theta's protection removed first (what a theta without it, and the issue, measured).

    python3 scripts/care_prune_demo.py
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "e2e")]

from support.lfs_server import GiftlessServer  # noqa: E402
from test_care_prune import Scenario, keep_oids, lost  # noqa: E402

from theta.storage.store import KEEP_DIR  # noqa: E402


def row(label: str, sc: Scenario) -> str:
    repo = sc.repo
    return (f"| {label:<44} | {len(repo.lfs_objects()):>11} | {len(keep_oids(repo)):>13} | "
            f"{len(sc.needed) - len(lost(repo, sc.needed)):>3} / {len(sc.needed):<3} |")


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="care-demo-"))
    try:
        header = ("| step                                         | lfs/objects | theta-objects | needed intact |\n"
                  "|---|---:|---:|---:|")
        for protected in (False, True):
            base = tmp / ("protected" if protected else "unprotected")
            with GiftlessServer(base / "lfs-store") as server:
                sc = Scenario(base, server)
                if not protected:
                    shutil.rmtree(sc.repo.git_common_dir() / "lfs" / KEEP_DIR)
                print(f"\n{'with' if protected else 'WITHOUT'} theta's protected name "
                      f"({len(sc.needed)} blobs needed; {len(sc.pushed_only)} only by pushed v1, "
                      f"{len(sc.orphan)} orphan)\n")
                print(header)
                print(row("after building the scenario", sc))
                for args in ((), ("--verify-remote",), ("--force",)):
                    sc.repo.git("lfs", "prune", *args)
                    print(row(f"git lfs prune {' '.join(args)}".strip(), sc))
                if not protected:
                    continue
                for args in (("--dry-run",), ("--verify-remote",), ()):
                    rep = json.loads(sc.repo.theta("prune", "--json", *args).stdout)
                    print(row(f"git theta prune {' '.join(args)}".strip(), sc)
                          + f" deleted {len(rep['deleted'])}, freed {rep['freed']} B"
                          + (f", kept {len(rep['unverified'])} unverified" if rep["unverified"] else ""))
                code = sc.repo.theta("fsck", check=False).returncode
                print(f"\ngit theta fsck (server still up, nothing fetched): exit {code}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
