"""install / uninstall with real git and git-lfs: the drivers work from a shell whose PATH lacks the Python
environment (an IDE's git), a moved environment says what to do, uninstall undoes exactly what install did,
and install protects blobs an older theta stored from `git lfs prune`."""
from __future__ import annotations

import os
import shutil
import sys
from collections import OrderedDict

import pytest

from support.checkpoints import assert_same_checkpoint, blob_oids, make_state, save_pt
from support.gitrepo import ROOT, GitEnv, bare_lfs_objects
from theta.commands import manpages
from theta.commands.install import interpreter_command, launcher_script, this_environment_command
from theta.storage.metadata import loads
from theta.storage.store import KEEP_DIR

BARE_PATH = "/usr/bin:/bin"  # git and git-lfs, and no Python environment


@pytest.fixture
def genv(tmp_path):
    return GitEnv.create(tmp_path)


def bare_env() -> dict:
    assert shutil.which("git", path=BARE_PATH) and shutil.which("git-lfs", path=BARE_PATH)
    assert shutil.which("git-theta", path=BARE_PATH) is None, "this test needs git-theta off the bare PATH"
    return {"PATH": BARE_PATH}


def test_git_works_from_a_shell_without_the_environment(genv, tmp_path):
    repo = genv.init("work")
    v1 = make_state(1, n_layers=1)
    save_pt(repo / "model.pt", v1)
    repo.commit("v1", ".gitattributes", "model.pt")
    env = bare_env()
    v2 = OrderedDict(v1)
    v2["embed.weight"] = v1["embed.weight"] * 2
    save_pt(repo / "model.pt", v2)
    # status runs the clean filter, add/commit store, diff runs the diff driver, checkout the smudge filter
    assert repo.git("status", "--porcelain", extra_env=env).stdout.decode().strip() == "M model.pt"
    repo.git("add", "model.pt", extra_env=env)
    repo.git("commit", "-q", "-m", "v2", extra_env=env)
    diff = repo.git("diff", "HEAD~1", "HEAD", "--", "model.pt", extra_env=env).stdout.decode()
    assert "embed.weight" in diff
    repo.git("checkout", "-q", "HEAD~1", "--", "model.pt", extra_env=env)
    assert_same_checkpoint(repo / "model.pt", v1)
    repo.git("checkout", "-q", "HEAD", "--", "model.pt", extra_env=env)
    assert_same_checkpoint(repo / "model.pt", v2)
    assert repo.git("status", "--porcelain", extra_env=env).stdout.decode() == ""
    # the pre-push hook too: push uploads the blobs
    bare = genv.init("remote.git", theta=False, bare=True)
    repo.git("remote", "add", "origin", f"file://{bare.path}")
    repo.git("push", "-q", "origin", "main", extra_env=env)
    assert blob_oids(repo, "HEAD:model.pt") | blob_oids(repo, "HEAD~1:model.pt") <= bare_lfs_objects(bare.path)
    # the config names the launcher by absolute path, never a bare git-theta
    cmd = repo.out("config", "--local", "filter.theta.process")
    assert cmd.startswith(str(repo.git_common_dir() / "theta" / "bin" / "git-theta")) and cmd.endswith(" filter-process")


def test_a_moved_environment_says_to_reinstall(genv):
    repo = genv.init("work")
    save_pt(repo / "model.pt", make_state(2, n_layers=1))
    repo.commit("v1", ".gitattributes", "model.pt")
    launcher = repo.git_common_dir() / "theta" / "bin" / "git-theta"
    good = launcher.read_text()
    # what install wrote, for an environment that has since been deleted
    launcher.write_text(launcher_script(["/nonexistent/venv/bin/git-theta"]))
    (repo / "model.pt").unlink()
    proc = repo.git("checkout", "--", "model.pt", check=False, extra_env=bare_env())
    err = proc.stderr.decode()
    assert proc.returncode != 0
    assert "/nonexistent/venv/bin/git-theta is gone" in err and "git theta install" in err, err
    repo.theta("install", "--local")
    assert launcher.read_text() == good
    repo.git("checkout", "--", "model.pt", extra_env=bare_env())
    assert repo.status() == ""


# a launcher as an older install wrote it, starting git's filter process light to reach a warm filter server
# (theta.warm, since removed): {target}, {python} and {root} filled in as that install filled them
LIGHT_START_LAUNCHER = """#!/bin/sh
# git-theta launcher (written by `git theta install`; `git theta uninstall` removes it)
# git runs theta's filter, merge and diff drivers through this file, so they work from any PATH (an IDE's
# or a GUI's git, cron): it runs the git-theta of the Python environment that installed it.
if [ -x {target} ]; then
    if [ "$#" = 1 ] && [ "$1" = filter-process ] && [ "${{GIT_THETA_WARM:-1}}" != 0 ] \\
            && [ "${{GIT_THETA_LIGHT_START:-1}}" != 0 ] && [ -x {python} ] \\
            && [ -f {root}/theta/warm/launch.py ]; then
        # git waits for the filter's handshake: start light, hand git's pipes to a warm server (theta.warm)
        exec {python} -S -c 'import sys
del sys.path[0]
sys.path.append(sys.argv[1])
try:
    from theta.warm.launch import main
except ImportError:  # (a PYTHONPATH naming a theta older than this launcher: its console script, as before)
    import os
    os.execv(sys.argv[2], sys.argv[2:] + ["filter-process"])
main(sys.argv[2:])' {root} {target}
    fi
    exec {target} "$@"
fi
echo "git-theta: {target} is gone: the Python environment that installed git-theta was moved or deleted." >&2
echo "git-theta: run \\`git theta install\\` again from an environment where git-theta is installed." >&2
exit 127
"""


def test_a_launcher_from_the_light_start_days_still_works_and_install_replaces_it(genv):
    """A repository installed while the launcher started the filter light keeps working with it (the light
    start's module is gone: the launcher runs the console script), and `git theta install` writes today's."""
    repo = genv.init("work")
    launcher = repo.git_common_dir() / "theta" / "bin" / "git-theta"
    good = launcher.read_text()
    target = this_environment_command()
    assert len(target) == 1, "this test needs git-theta's console script"
    launcher.write_text(LIGHT_START_LAUNCHER.format(target=target[0], python=sys.executable, root=ROOT))
    v = make_state(3, n_layers=1)
    save_pt(repo / "model.pt", v)
    repo.commit("v1", ".gitattributes", "model.pt")
    (repo / "model.pt").unlink()
    repo.git("checkout", "--", "model.pt", extra_env=bare_env())
    assert_same_checkpoint(repo / "model.pt", v)
    assert repo.status() == ""
    assert repo.theta("install", "--local").stdout.decode() == f"wrote the launcher {launcher}\n"
    assert launcher.read_text() == good == launcher_script(target)


HOSTILE_MODULES = ("theta/__init__.py", "json.py", "struct.py", "os.py", "site.py", "numpy.py", "_socket.py")


@pytest.mark.parametrize("start", ["console script", "interpreter"])
def test_modules_in_the_work_tree_are_never_imported(genv, tmp_path, start):
    """git runs the filter in the work tree, which a clone's author wrote: a `json.py` or a `theta/` there must
    never be imported, whichever form the launcher runs: console script or interpreter (`-c`, never `-m`)."""
    repo = genv.init("work", track=("*.pt",))
    owned = tmp_path / "imported.txt"
    for name in HOSTILE_MODULES:
        (repo / name).parent.mkdir(exist_ok=True)
        (repo / name).write_text(f"open({str(owned)!r}, 'a').write({name!r} + '\\n')\nraise SystemExit(3)\n")
    command = interpreter_command() if start == "interpreter" else this_environment_command()
    launcher = repo.git_common_dir() / "theta" / "bin" / "git-theta"
    launcher.write_text(launcher_script(command))
    v = make_state(1)
    save_pt(repo / "model.pt", v)
    repo.commit("v1", ".gitattributes", "model.pt")
    v2 = OrderedDict(v)
    v2["embed.weight"] = v["embed.weight"] * 2
    save_pt(repo / "model.pt", v2)
    repo.commit("v2", "model.pt")
    (repo / "model.pt").unlink()
    repo.git("checkout", "--", "model.pt")
    assert_same_checkpoint(repo / "model.pt", v2)
    assert not owned.exists(), owned.read_text()


def _snapshot(repo, scope_file):
    hooks = repo.git_common_dir() / "hooks"
    return scope_file.read_bytes(), {p.name: (p.read_bytes(), os.access(p, os.X_OK)) for p in hooks.iterdir()}


def test_local_uninstall_restores_exactly_what_was_there(genv):
    repo = genv.init("r", theta=False)
    repo.git("lfs", "install", "--local")  # git-lfs set up first, as many repositories are
    config = repo.git_common_dir() / "config"
    before = _snapshot(repo, config)
    repo.theta("install", "--local")
    assert "git-theta pre-push" in (repo.git_common_dir() / "hooks" / "pre-push").read_text()
    assert (repo.git_common_dir() / "hooks" / "pre-push.theta-chained").exists()
    out = repo.theta("uninstall", "--local").stdout.decode()
    assert "unset filter.theta.process (local)" in out and "restored the pre-push hook" in out
    assert _snapshot(repo, config) == before
    assert not (repo.git_common_dir() / "theta" / "bin" / "git-theta").exists()
    again = repo.theta("uninstall", "--local")
    assert again.stdout == b"" and "was not installed" in again.stderr.decode()


def test_uninstall_puts_back_a_user_hook(genv, tmp_path):
    repo = genv.init("r", theta=False)
    hook = repo.git_common_dir() / "hooks" / "pre-push"
    hook.write_text("#!/bin/sh\necho user hook\n")
    hook.chmod(0o755)
    repo.theta("install", "--local")
    assert "git-theta" in hook.read_text()
    repo.theta("uninstall", "--local")
    assert hook.read_text() == "#!/bin/sh\necho user hook\n" and os.access(hook, os.X_OK)
    assert not hook.with_name("pre-push.theta-chained").exists()


def test_global_uninstall_round_trip(genv):
    genv.run(["git", "lfs", "install"], cwd=genv.home)
    gitconfig = genv.home / ".gitconfig"
    before = gitconfig.read_bytes()
    genv.run(["git", "theta", "install"], cwd=genv.home)
    launcher = genv.home / ".local" / "share" / "git-theta" / "bin" / "git-theta"
    assert launcher.exists() and str(launcher) in gitconfig.read_text()
    genv.run(["git", "theta", "uninstall"], cwd=genv.home)
    assert gitconfig.read_bytes() == before
    assert not (genv.home / ".local" / "share" / "git-theta").exists()


def test_global_install_writes_the_man_pages_and_uninstall_removes_only_those(genv, tmp_path):
    """The pages go to the man directory (here named by GIT_THETA_MAN_DIR, by default the one beside the
    git-theta on PATH: tests/install), marked as install's; a page install did not write is never touched."""
    man = tmp_path / "prefix" / "share" / "man"   # none of it exists yet
    env = {"GIT_THETA_MAN_DIR": str(man), "MANPAGER": "cat", "PAGER": "cat"}
    out = genv.run(["git", "theta", "install"], cwd=genv.home, extra_env=env)
    assert f"wrote the man pages git-theta.1, zipslice.1 in {man / 'man1'}" in out.stdout.decode().splitlines()
    page = (man / "man1" / "git-theta.1").read_text()
    assert page == manpages.MARKER + (manpages.CHECKOUT_PAGES / "git-theta.1").read_text()
    if shutil.which("man"):
        # man does not look in that directory (nothing on PATH leads to it): install says so, and what to do
        assert out.stderr.decode() == (f"warning: `git theta --help` finds no manual: man does not look in {man} "
                                       f'first; put MANPATH="{man}:" in your environment (`git theta -h` prints '
                                       f"the same help)\n")
        shown = genv.run(["git", "help", "theta"], cwd=genv.home, extra_env={**env, "MANPATH": f"{man}:"})
        assert "GIT-THETA(1)" in shown.stdout.decode() and "written by" not in shown.stdout.decode()
    out = genv.run(["git", "theta", "uninstall"], cwd=genv.home, extra_env=env).stdout.decode().splitlines()
    assert f"removed the man page {man / 'man1' / 'git-theta.1'}" in out
    assert not (tmp_path / "prefix").exists()  # the directories install made went with the pages
    # someone else's zipslice.1 (pip's, another tool's): install adds only its own page, uninstall removes only it
    (man / "man1").mkdir(parents=True)
    (man / "man1" / "zipslice.1").write_text(".TH OTHER 1\n")
    assert "wrote the man pages git-theta.1 in" in genv.run(["git", "theta", "install"], cwd=genv.home,
                                                             extra_env=env).stdout.decode()
    genv.run(["git", "theta", "uninstall"], cwd=genv.home, extra_env=env)
    assert [p.name for p in (man / "man1").iterdir()] == ["zipslice.1"]
    assert (man / "man1" / "zipslice.1").read_text() == ".TH OTHER 1\n"
    assert not (genv.home / ".local" / "share" / "git-theta").exists()


def test_install_protects_blobs_an_older_theta_stored(genv, tmp_path):
    """An older theta kept no second name: `git lfs prune` then deletes every blob (the issue's data loss).
    `git theta install` gives them theta's name; after that `git lfs prune` cannot lose them."""
    def setup(name):
        repo = genv.init(name)
        sd = make_state(4, n_layers=1)
        save_pt(repo / "model.pt", sd)
        repo.commit("v1", ".gitattributes", "model.pt")
        shutil.rmtree(repo.git_common_dir() / "lfs" / KEEP_DIR)  # as an older theta left it
        return repo, sd, {r.oid for r in loads(repo.show("HEAD:model.pt")).blob_refs()}

    old, _, oids = setup("old")
    proc = old.git("lfs", "prune")
    assert f"{len(oids)} local objects, 0 retained" in (proc.stdout + proc.stderr).decode()
    assert not (oids & old.lfs_objects())  # the data loss the issue measured
    (old / "model.pt").unlink()
    assert old.git("checkout", "--", "model.pt", check=False).returncode != 0

    repo, sd, oids = setup("upgraded")
    out = repo.theta("install", "--local").stdout.decode()
    assert f"protected {len(oids)} blob(s)" in out
    repo.git("lfs", "prune", "--force")
    assert not (oids & repo.lfs_objects())
    (repo / "model.pt").unlink()
    repo.git("checkout", "--", "model.pt")
    assert_same_checkpoint(repo / "model.pt", sd)
