"""`git theta log` and `git theta diff --html` on a real repository: the figures of the picture are those of
`git theta diff --json` for each commit and its parent; the page is self-contained; the PNG is an image of the
heat map; a real headless Chromium renders the page, unfolds a layer on a click and shows a heat map."""
from __future__ import annotations

import io
import json
import math
import os
import re
import struct
import sys
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from safetensors.numpy import save_file

from theta.commands.app import run
from theta.commands.diff_driver import diff_command
from theta.commands.pictures import history_json
from theta.model.history import file_history
from theta.storage.tracked import list_tracked

from support.browser import Browser
from support.gitrepo import GitEnv

LAYERS = 4
D = 64
PATH = "model.safetensors"


def llama(rng, layers=LAYERS, d=D) -> dict[str, np.ndarray]:
    """A small checkpoint named like a Llama (layers of q/k/up projections and a norm)."""
    m = {"model.embed_tokens.weight": rng.normal(0, .02, (256, d)).astype(np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        m[p + "self_attn.q_proj.weight"] = rng.normal(0, .02, (d, d)).astype(np.float32)
        m[p + "self_attn.k_proj.weight"] = rng.normal(0, .02, (d // 2, d)).astype(np.float32)
        m[p + "mlp.up_proj.weight"] = rng.normal(0, .02, (2 * d, d)).astype(np.float32)
        m[p + "input_layernorm.weight"] = np.ones(d, np.float32)
    m["model.norm.weight"] = np.ones(d, np.float32)
    m["lm_head.weight"] = rng.normal(0, .02, (256, d)).astype(np.float32)
    return m


def tune(m, prefix, rng, scale=1e-3):
    for k in list(m):
        if k.startswith(prefix):
            m[k] = m[k] + rng.normal(0, scale, m[k].shape).astype(m[k].dtype)


@pytest.fixture(scope="module")
def hrepo(tmp_path_factory):
    """A history: a base model, fine-tunes (one stored dense on request), a sparse edit, a group added and one
    removed, a vocabulary grown, a retyped group, a second checkpoint, and a merge of two branches that both
    changed one group (merged by `average`)."""
    base = tmp_path_factory.mktemp("history")
    env = GitEnv.create(base)
    repo = env.init("work")
    repo.git("config", "theta.keyframeRatio", "inf")  # the step types auto chains, each shown by the log
    rng = np.random.default_rng(0)
    m = llama(rng)

    def commit(msg, *extra):
        save_file(m, str(repo / PATH))
        repo.git("add", PATH, *extra)
        repo.git("commit", "-q", "-m", msg)

    commit("base model")
    tune(m, "model.layers.0.", rng)
    commit("tune layer 0")
    tune(m, "model.layers.1.", rng, 2e-3)
    save_file(m, str(repo / PATH))
    repo.theta("add", "--update-type", "dense", PATH)   # stored without looking at the previous value
    repo.git("commit", "-q", "-m", "tune layer 1, dense")
    m["model.layers.3.mlp.up_proj.weight"][:3] += 0.5
    save_file({"adapter.a": rng.normal(0, 1, (8, 8)).astype(np.float32)}, str(repo / "adapter.safetensors"))
    commit("sparse edit, an adapter", "adapter.safetensors")
    m["model.extra.bias"] = np.zeros(D, np.float32)
    del m["model.norm.weight"]
    m["model.layers.2.input_layernorm.weight"] = m["model.layers.2.input_layernorm.weight"].astype(np.float16)
    commit("add, remove, retype")
    m["lm_head.weight"] = np.concatenate([m["lm_head.weight"], rng.normal(0, .02, (8, D)).astype(np.float32)])
    commit("grow vocab")
    repo.git("config", "theta.merge.strategy", "average")
    repo.git("checkout", "-q", "-b", "side")
    side = dict(m)
    tune(side, "model.layers.2.self_attn", rng)
    side["lm_head.weight"] = side["lm_head.weight"] + np.float32(0.01)
    save_file(side, str(repo / PATH))
    repo.commit("side: tune layer 2 and the head", PATH)
    repo.git("checkout", "-q", "main")
    tune(m, "model.layers.3.self_attn", rng)
    m["lm_head.weight"] = m["lm_head.weight"] - np.float32(0.01)
    commit("main: tune layer 3 and the head")
    repo.git("merge", "-q", "--no-edit", "side")
    return repo


def theta_json(repo, *args) -> dict:
    return json.loads(repo.theta(*args).stdout)


@contextmanager
def in_repo(repo):
    """The repository's environment (its own HOME and git config) for a call made in this process."""
    with mock.patch.dict(os.environ, repo.env.env, clear=True):
        yield


def run_theta(repo, *args) -> tuple[int, str, str]:
    """`git theta ARGS` run in this process (its code, without starting one): status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    with in_repo(repo), mock.patch.object(sys, "argv", ["git-theta", *args]), \
            mock.patch.object(sys, "stdout", out), mock.patch.object(sys, "stderr", err):
        os.chdir(repo.path)
        try:
            status = run(list(args))
        finally:
            os.chdir(old)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def logged(hrepo) -> dict:
    """`git theta log --json` of the model (through the command line)."""
    doc = theta_json(hrepo, "log", "--json", "--", PATH)
    assert len(doc["files"]) == 1
    return doc["files"][0]


def log_doc(repo, *args) -> dict:
    """The same in this process (``args``: revisions)."""
    with in_repo(repo):
        return json.loads(json.dumps(history_json(file_history(PATH, list(args), repo.path, exact=False))))


_diffs: dict = {}


def diff_groups(repo, old, new, *flags) -> tuple[dict, dict]:
    """`git theta diff --json [flags] OLD NEW -- PATH` (in this process, once per question): groups by name,
    counts."""
    key = (str(repo.path), old, new, flags)
    if key not in _diffs:
        buf = io.StringIO()
        with in_repo(repo):
            diff_command([old, new], [PATH], estimate="--estimate" in flags, out=buf, cwd=repo.path, as_json=True)
        files = json.loads(buf.getvalue())["files"]
        _diffs[key] = ({g["name"]: g for g in files[0]["groups"]}, files[0]["counts"]) if files else ({}, {})
    return _diffs[key]


def close(a, b, rel=1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def test_log_figures_are_those_of_git_theta_diff(hrepo, logged):
    """Per commit and group: the status of `git theta diff --json` against the parent; for a change whose norms
    clean recorded, the same |Δ|, |old| and changed elements (recorded to 6 digits); for a group stored without
    looking at its previous value (stored dense on request; merged), the LSH estimate `git theta diff
    --estimate` gives."""
    doc = logged
    subjects = [c["subject"] for c in doc["commits"]]
    assert subjects[0] == "base model" and subjects[-1].startswith("Merge branch 'side'")
    assert len(subjects) == 9
    seen = {"recorded": 0, "estimated": 0}
    for c in doc["commits"][1:]:
        parent = c["parents"][0]
        groups, counts = diff_groups(hrepo, parent, c["id"])
        est, _ = diff_groups(hrepo, parent, c["id"], "--estimate")
        cells = c["cells"]
        assert {n for n, cell in cells.items() if cell["status"] != "unchanged"} == set(groups), c["subject"]
        assert sum(1 for cell in cells.values() if cell["status"] == "unchanged") == counts["unchanged"]
        assert c["totals"]["changed"] == len(groups)
        for name, g in groups.items():
            cell = cells[name]
            assert cell["status"] == g["status"], (c["subject"], name)
            if g["status"] != "modified":
                continue
            st = g["stats"]
            if cell["how"] == "recorded":
                assert close(cell["change"], st["l2"]) and close(cell["base"], st["old_l2"]), (c["subject"], name)
                assert close(cell["relative"], st["relative"]) and cell["changed"] == st["changed"]
            else:
                assert cell["how"] == "estimated" and cell["change"] == est[name]["estimate_l2"]
                assert close(cell["base"], st["old_l2"])  # the parent's recorded norm
            seen[cell["how"]] += 1
    assert seen["recorded"] >= 10 and seen["estimated"] == 5  # layer 1's four groups stored dense; the merged head


def test_log_exact_reads_what_is_not_recorded_bit_for_bit(hrepo):
    with in_repo(hrepo):
        doc = json.loads(json.dumps(history_json(file_history(PATH, ["HEAD~5"], hrepo.path, exact=True,
                                                              max_count=1))))
    dense = next(c for c in doc["commits"] if c["subject"] == "tune layer 1, dense")
    groups, _ = diff_groups(hrepo, dense["parents"][0], dense["id"])
    assert len(groups) == 4
    for name, g in groups.items():
        cell = dense["cells"][name]
        assert cell["how"] == "computed"
        assert (cell["change"], cell["base"], cell["changed"]) == (g["stats"]["l2"], g["stats"]["old_l2"],
                                                                    g["stats"]["changed"])


def test_log_stored_types_bytes_and_totals(hrepo, logged):
    doc = logged
    by = {c["subject"]: c for c in doc["commits"]}
    base = by["base model"]
    assert {cell["status"] for cell in base["cells"].values()} == {"added"}
    assert base["totals"]["stored"] == base["totals"]["fetch"] > 0
    assert {cell["stored"] for n, cell in by["tune layer 1, dense"]["cells"].items()
            if n.startswith("model.layers.1.")} == {"dense"}
    assert by["tune layer 0"]["cells"]["model.layers.0.self_attn.q_proj.weight"]["stored"] == "delta"
    assert by["sparse edit, an adapter"]["cells"]["model.layers.3.mlp.up_proj.weight"]["stored"] == "sparse"
    assert by["grow vocab"]["cells"]["lm_head.weight"]["status"] == "reshaped"
    cells = by["add, remove, retype"]["cells"]
    assert (cells["model.extra.bias"]["status"], cells["model.norm.weight"]["status"],
            cells["model.layers.2.input_layernorm.weight"]["status"]) == ("added", "removed", "retyped")
    for c in doc["commits"]:
        # the commit's new blobs are its groups' (a blob two groups share, as the base's norms of ones, once)
        stored = sum(cell["stored_bytes"] for cell in c["cells"].values())
        assert c["totals"]["stored"] == stored if c["subject"] != "base model" else 0 < c["totals"]["stored"] < stored
        # a fresh clone of the commit fetches what `git theta ls-files` counts as stored for the file
        with in_repo(hrepo):
            files = list_tracked(c["id"], cwd=hrepo.path)
        assert c["totals"]["fetch"] == next(f.stored for f in files if f.path == PATH)
    # the rows: model order, every group any commit had
    assert doc["groups"][:3] == ["lm_head.weight", "model.embed_tokens.weight", "model.extra.bias"]
    assert doc["groups"][-1] == "model.norm.weight"  # removed, kept where it was


def test_log_text_and_range(hrepo):
    status, out, _ = run_theta(hrepo, "log", "-n", "2", "--", PATH)
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == PATH and len(lines) == 3
    assert "groups changed" in lines[1] and lines[2].endswith("Merge branch 'side'")
    doc = log_doc(hrepo, "HEAD~3..HEAD~1")
    assert [c["subject"] for c in doc["commits"]] == ["grow vocab", "main: tune layer 3 and the head"]


def test_log_html_is_one_self_contained_page(hrepo, logged, tmp_path):
    out = tmp_path / "history.html"
    status, text, _ = run_theta(hrepo, "log", "--html", str(out), "--", PATH)
    assert status == 0 and f"wrote {out}" in text
    page = out.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<link" not in page and "<script src" not in page and "@import" not in page
    groups, commits = len(logged["groups"]), len(logged["commits"])
    assert (groups, commits) == (4 * LAYERS + 4, 9)
    assert f'data-groups="{groups}" data-commits="{commits}" data-layers="{LAYERS}"' in page
    assert page.count('<tr class="group') == groups
    assert len(re.findall(r'<tr class="group[^>]*>(?:<th>[^<]*</th>)((?:<td class="cell[^>]*>[^<]*</td>)+)', page)) \
        == groups
    assert page.count('class="cell') == (groups + LAYERS) * commits


def test_log_of_several_checkpoints_writes_a_page_each(hrepo, tmp_path):
    out = tmp_path / "pages"
    assert run_theta(hrepo, "log", "--html", str(out))[0] == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter.safetensors.html", "model.safetensors.html"]
    for name in ("one.html", "file.html"):
        if name == "file.html":
            (tmp_path / name).write_text("")
        status, _, err = run_theta(hrepo, "log", "--html", str(tmp_path / name))
        assert status == 1
        assert err.startswith(f"git theta: error: {tmp_path / name}: 2 checkpoints changed, one picture each: "
                              f"name a directory")
    assert not (tmp_path / "one.html").exists()


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def png_colours(data: bytes) -> int:
    """How many distinct colours a PNG holds (Pillow, which matplotlib depends on, decodes it)."""
    image = pytest.importorskip("PIL.Image").open(io.BytesIO(data)).convert("RGB")
    return len(image.getcolors(maxcolors=1 << 24))


def test_log_png_is_an_image_of_the_heat_map(hrepo, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "history.png"
    assert run_theta(hrepo, "log", "--png", str(out), "--", PATH)[0] == 0
    data = out.read_bytes()
    w, h = png_size(data)
    assert 500 <= w <= 4500 and 250 <= h <= 6600
    assert png_colours(data) > 20  # viridis cells, grey, white, text: not a blank image


def test_png_without_matplotlib_names_the_extra(hrepo, tmp_path):
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    # what a Python without matplotlib raises (the wheel's venv in tests/install has none for real)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\", "
                                      "name='matplotlib')\n")
    env = {"PYTHONPATH": f"{shim.parent}:{hrepo.env.env['PYTHONPATH']}"}
    r = hrepo.theta("log", "--png", str(tmp_path / "x.png"), "--", PATH, check=False, extra_env=env)
    assert r.returncode == 1
    assert r.stderr.decode().strip() == \
        'git theta: error: matplotlib is not installed, and --png needs it: pip install "zipslice-theta[plot]"'
    assert not (tmp_path / "x.png").exists()


def test_diff_html_of_a_merge_shows_each_group_s_parent(hrepo, tmp_path):
    out = tmp_path / "merge.html"
    assert run_theta(hrepo, "diff", "--html", str(out), "HEAD^1", "HEAD", "--", PATH)[0] == 0
    page = out.read_text()
    rows = dict(re.findall(r'<tr class="bar[^"]*" data-group="([^"]+)"[^>]*>.*?data-decision="([^"]*)"', page))
    assert rows["model.layers.2.self_attn.q_proj.weight"] == "from parent 2 (only it changed the group)"
    assert rows["model.layers.3.self_attn.q_proj.weight"] == "from parent 1 (only it changed the group)"
    assert rows["model.embed_tokens.weight"] == "the same on both parents"
    assert rows["lm_head.weight"] == "changed on both parents: merged into a new value"
    assert "strategy configured now: average" in page
    groups, counts = diff_groups(hrepo, "HEAD^1", "HEAD")
    assert page.count('<tr class="bar') == len(groups) + counts["unchanged"] == 4 * LAYERS + 3
    for name, g in groups.items():
        m = re.search(r'<tr class="bar[^"]*" data-group="%s"[^>]*data-status="([^"]+)"[^>]*data-rel="([^"]*)"'
                      % re.escape(name), page)
        assert m.group(1) == g["status"]
        if g["status"] == "modified":
            assert close(float(m.group(2)), g["stats"]["relative"])


@pytest.mark.slow
def test_a_browser_renders_the_heat_map_and_unfolds_a_layer(hrepo, logged, tmp_path):
    """A real headless Chromium opens the page: one cell per group and commit, layers folded, a click unfolds
    one; the screenshot is an image of that size that is not blank; the figures in the page are those of
    `git theta diff --json`. (Slow: starting Chromium takes seconds.)"""
    out = tmp_path / "history.html"
    hrepo.theta("log", "--html", str(out), "--", PATH)
    doc = logged
    groups, commits = len(doc["groups"]), len(doc["commits"])
    with Browser.start() as b:
        page = b.open(out, width=1400, height=900)
        count = lambda sel: page.eval(f"document.querySelectorAll({json.dumps(sel)}).length")  # noqa: E731
        assert count("tr.group td.cell") == groups * commits
        assert count("tr.layer") == LAYERS and count("tr.layer td.cell") == LAYERS * commits
        folded_visible = count("tr.group:not([hidden])")
        assert folded_visible == groups - 4 * LAYERS
        assert page.eval("document.querySelector('tr.child').offsetHeight") == 0  # hidden: not drawn
        page.click('tr.layer[data-layer="model.layers.1"] th')
        assert count("tr.group:not([hidden])") == folded_visible + 4
        assert page.eval("document.querySelector('tr.child[data-parent=\"model.layers.1\"]').offsetHeight") > 0
        assert page.eval("document.querySelector('tr.layer[data-layer=\"model.layers.1\"]')"
                         ".getAttribute('aria-expanded')") == "true"
        box = page.eval("(function(){var r=document.querySelector('table.heat').getBoundingClientRect();"
                        "return [r.width, r.height];})()")
        shot = page.screenshot("table.heat")
        w, h = png_size(shot)
        assert (w, h) == (round(box[0]), round(box[1])) or (abs(w - box[0]) <= 1 and abs(h - box[1]) <= 1)
        assert w >= 26 * commits and h >= 16 * (folded_visible + 4 + LAYERS)
        assert png_colours(shot) > 20
        # the figures in the page
        cells = page.eval("""Array.from(document.querySelectorAll('tr.group')).map(function(r){
            return [r.dataset.group, Array.from(r.querySelectorAll('td.cell')).map(function(td){
              return [td.dataset.status, td.dataset.rel, td.dataset.changed, td.dataset.how];})];})""")
    by_name = dict(cells)
    assert list(by_name) == doc["groups"]
    for k, c in enumerate(doc["commits"][1:], start=1):
        diff, _ = diff_groups(hrepo, c["parents"][0], c["id"])
        for name, row in by_name.items():
            status, rel, changed, how = row[k]
            if name not in diff:
                assert status in ("unchanged", "absent")
                continue
            g = diff[name]
            assert status == g["status"]
            if status == "modified" and how == "recorded":
                assert close(float(rel), g["stats"]["relative"]) and int(changed) == g["stats"]["changed"]
