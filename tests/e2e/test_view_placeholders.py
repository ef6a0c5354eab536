"""Views through the bigger-than-RAM checkout path, with real git and git-lfs.

GIT_THETA_MATERIALIZE_ABOVE=0 sends every checkout through the placeholder path: git writes the metadata text,
and the filter process materialises the checkpoint when git is done. With a view configured, every git verb
that writes the work tree must leave the VIEW there (the view format's library reads the committed tensors),
`git status` clean without even starting the filter (theta recorded the view's stat in the index), and the
repository in the committed format.
"""
from __future__ import annotations

import pytest
import torch

from support import formats
from support.formats import same_bits
from support.gitrepo import GitEnv, Repo
from theta.storage.metadata import loads

# committed format, view format (one streamed writer, one written through a temp file)
# slow suite: the default run covers views at every verb (test_format_views) and the placeholder path at every
# verb (test_bigger_than_ram, test_checkout_failures); these cases cover the two together
CASES = [pytest.param("safetensors", "torch", marks=pytest.mark.slow),
         pytest.param("torch", "hdf5", marks=pytest.mark.slow)]
NAME = {"safetensors": "model.safetensors", "torch": "model.pt"}


@pytest.fixture
def genv(tmp_path):
    env = GitEnv.create(tmp_path)
    env.env["GIT_THETA_MATERIALIZE_ABOVE"] = "0"  # every theta file goes through the placeholder path
    env.run(["git", "theta", "install"], cwd=env.home)  # global, so a clone's checkout runs theta
    return env


def state(seed: int, base: dict | None = None, change: str | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if base is None:
        return {f"layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(4)} | \
               {"head.bias": torch.randn(16, generator=g).to(torch.float16)}
    return {**base, change: torch.randn(*base[change].shape, generator=g).to(base[change].dtype)}


def assert_view(repo: Repo, path: str, view: str, committed: str, want: dict, unread: bool = True) -> None:
    """The work tree holds the view of ``want``, git status is clean and -- ``unread``: after a verb theta
    materialised the file for -- git trusted the stat data theta recorded without starting the filter."""
    f = repo / path
    assert not f.read_bytes().startswith(b"theta-metadata"), f"{path} is still a placeholder"
    assert formats.sniff(f) == view
    got = formats.read(f, view)
    assert sorted(got) == sorted(want) and all(same_bits(got[k], want[k]) for k in want)
    proc = repo.git("status", "--porcelain", extra_env={"GIT_TRACE": "1"})
    assert proc.stdout.decode() == ""
    if unread:
        assert "filter-process" not in proc.stderr.decode(), proc.stderr.decode()[-2000:]
    assert not (repo.git_common_dir() / "index.lock").exists()
    assert loads(repo.show(f"HEAD:{path}")).format == committed


@pytest.mark.parametrize("committed,view", CASES)
def test_every_verb_leaves_the_view(genv, committed, view):
    repo = genv.init("work")
    path = NAME[committed]
    (repo / ".gitattributes").write_text((repo / ".gitattributes").read_text() + f"{path} theta-format={view}\n")
    v1 = state(1)
    formats.write(repo / path, committed, v1)
    (repo / "notes.txt").write_text("v1\n")
    repo.commit("v1", ".gitattributes", path, "notes.txt")
    repo.git("branch", "exp")

    def check(want, unread=True):
        assert_view(repo, path, view, committed, want, unread)

    (repo / path).unlink()  # the work tree still holds the file as written, in the committed format
    repo.git("checkout", "--", path)                           # checkout of a path
    check(v1)
    v2 = state(2, v1, "layers.0.weight")                       # edit in the view, commit: committed format
    formats.edit(repo / path, "layers.0.weight", v2["layers.0.weight"], view)
    repo.git("commit", "-qam", "v2")
    check(v2, unread=False)  # a file edited in the second git recorded it is racily clean: git may re-read it
    repo.git("switch", "-q", "exp")                            # switch
    check(v1)
    v3 = state(3, v1, "layers.3.weight")
    formats.edit(repo / path, "layers.3.weight", v3["layers.3.weight"], view)
    (repo / "notes.txt").write_text("v3\n")
    repo.git("commit", "-qam", "v3")
    repo.git("checkout", "-q", "main")                         # checkout of a branch
    check(v2)
    repo.git("checkout", "-q", "HEAD~1")                       # checkout of a commit
    check(v1)
    repo.git("checkout", "-q", "main")

    formats.edit(repo / path, "head.bias", torch.zeros(16, dtype=torch.float16), view)
    repo.git("restore", path)                                  # restore
    check(v2)
    formats.edit(repo / path, "head.bias", torch.zeros(16, dtype=torch.float16), view)
    repo.git("reset", "-q", "--hard")                          # reset --hard
    check(v2)
    repo.git("reset", "-q", "--hard", "HEAD~1")
    check(v1)
    repo.git("reset", "-q", "--hard", "ORIG_HEAD")
    check(v2)

    v4 = {**v2, "head.bias": torch.zeros(16, dtype=torch.float16)}
    formats.edit(repo / path, "head.bias", v4["head.bias"], view)
    repo.git("stash", "-q")                                    # stash: the view of HEAD again
    check(v2)
    repo.git("stash", "pop", "-q")                             # pop: the edit, still as the view
    assert formats.sniff(repo / path) == view
    got = formats.read(repo / path, view)
    assert all(same_bits(got[k], v4[k]) for k in v4) and repo.status() == f"M {path}"
    repo.git("reset", "-q", "--hard")
    check(v2)

    merged = {**v2, "layers.3.weight": v3["layers.3.weight"]}
    repo.git("cherry-pick", "exp")                             # cherry-pick (a three-way merge of groups)
    check(merged)
    repo.git("reset", "-q", "--hard", "HEAD~1")
    repo.git("merge", "-q", "--no-edit", "exp")                # merge
    check(merged)
    repo.git("reset", "-q", "--hard", "HEAD~1")
    repo.git("checkout", "-q", "exp")                          # rebase exp onto main
    repo.git("rebase", "-q", "main")
    check(merged)
    assert (repo / "notes.txt").read_text() == "v3\n"
    repo.git("checkout", "-q", "main")
    check(v2)

    bare = genv.init("remote.git", theta=False, bare=True)     # clone
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    repo.git("push", "-q", "origin", "main", "exp")
    clone = genv.clone(f"file://{bare.path}", "clone")
    assert_view(clone, path, view, committed, v2)
    clone.git("checkout", "-q", "exp")
    assert_view(clone, path, view, committed, merged)

    # a clone whose checkout left placeholders (GIT_THETA_SKIP_SMUDGE), finished by `git theta pull`
    genv.run(["git", "clone", "-q", f"file://{bare.path}", str(genv.home.parent / "later")], cwd=genv.home,
             extra_env={"GIT_THETA_SKIP_SMUDGE": "1"})
    later = Repo(genv.home.parent / "later", genv)
    assert (later / path).read_bytes().startswith(b"theta-metadata")
    later.theta("pull")
    assert_view(later, path, view, committed, v2)
