"""The zipslice command, run in-process through its entry point and as a real subprocess, on real files."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import zipslice.diff
from zipslice.cli import main


def run(capsys, *argv):
    """(exit status, stdout, stderr) of ``zipslice argv``."""
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.fixture()
def ckpt(tmp_path):
    w = torch.randn(64, 32)
    w[0, 0], w[1, 1], w[2, 2] = float("nan"), float("inf"), -float("inf")
    tensors = {"layer.weight": w, "layer.bias": torch.randn(64, dtype=torch.float64),
               "ids": torch.tensor([-7, 3, 2 ** 40]), "half": torch.randn(100).to(torch.bfloat16),
               "mask": torch.tensor([True, False, True]), "cplx": torch.tensor([3 + 4j, 0j], dtype=torch.complex64)}
    p = tmp_path / "m.pt"
    torch.save({"model": tensors, "step": 10}, p)
    return p, tensors


def test_ls_table_and_json(capsys, ckpt):
    p, tensors = ckpt
    code, out, err = run(capsys, "ls", p)
    assert code == 0 and err == ""
    for name in tensors:
        assert f"model/{name}" in out
    assert "6 tensors" in out and "[64, 32]" in out and "bfloat16" in out
    code, out, _ = run(capsys, "ls", p, "--json")
    data = json.loads(out)
    assert data["format"] == "torch" and data["total"]["tensors"] == 6
    rows = {r["name"]: r for r in data["tensors"]}
    assert data["total"]["nbytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    raw = p.read_bytes()
    w = rows["model/layer.weight"]
    assert w["shape"] == [64, 32] and w["stride"] == [32, 1] and w["dtype"] == "float32"
    # the offset really is where the bytes are
    assert raw[w["offset"]:w["offset"] + w["nbytes"]] == tensors["layer.weight"].numpy().tobytes()


def _torch_stats(t: torch.Tensor):
    v = t.double()
    fin = v[torch.isfinite(v)]
    return fin.min().item(), fin.max().item(), fin.mean().item(), fin.std().item()


@pytest.mark.parametrize("chunk", [1 << 20, 7])
def test_show_streams_statistics_like_torch(capsys, ckpt, monkeypatch, chunk):
    monkeypatch.setattr(zipslice.diff, "CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(zipslice.diff.iter_chunks, "__defaults__", (chunk,))
    p, tensors = ckpt
    for name in ("layer.weight", "layer.bias", "half"):
        code, out, _ = run(capsys, "show", p, f"model/{name}", "--json")
        assert code == 0
        s = json.loads(out)
        lo, hi, mean, std = _torch_stats(tensors[name])
        assert s["stats"]["min"] == lo and s["stats"]["max"] == hi
        assert s["stats"]["mean"] == pytest.approx(mean, rel=1e-12, abs=1e-12)
        assert s["stats"]["std"] == pytest.approx(std, rel=1e-9)
    s = json.loads(run(capsys, "show", p, "model/layer.weight", "--json")[1])
    assert (s["stats"]["nan"], s["stats"]["posinf"], s["stats"]["neginf"]) == (1, 1, 1)
    assert s["stats"]["count"] == 64 * 32 - 3 and s["shape"] == [64, 32] and s["stride"] == [32, 1]
    ids = json.loads(run(capsys, "show", p, "model/ids", "--json")[1])["stats"]
    assert (ids["min"], ids["max"]) == (-7, 2 ** 40)  # exact integers
    mask = json.loads(run(capsys, "show", p, "model/mask", "--json")[1])["stats"]
    assert (mask["min"], mask["max"], mask["count"]) == (0, 1, 3)
    c = json.loads(run(capsys, "show", p, "model/cplx", "--json")[1])
    assert c["stats_of"] == "|z|" and c["stats"]["max"] == 5.0


def test_show_table(capsys, ckpt):
    p, _ = ckpt
    code, out, _ = run(capsys, "show", p, "model/layer.weight")
    assert code == 0
    for field in ("dtype", "float32", "stride", "[32, 1]", "mean", "std", "NaN / +Inf / -Inf", "1 / 1 / 1"):
        assert field in out


def test_convert_and_diff_commands(capsys, ckpt, tmp_path):
    p, tensors = ckpt
    code, out, err = run(capsys, "convert", p, tmp_path / "out.bin.data", "--to", "torch")
    # the report goes to stderr (stdout stays for data); no progress bar: stderr is not a terminal
    assert code == 0 and out == "" and err.startswith("wrote ") and "torch, 6 tensors" in err and err.count("\n") == 1
    assert torch.equal(torch.load(tmp_path / "out.bin.data", weights_only=True)["model"]["ids"], tensors["ids"])
    code, out, _ = run(capsys, "diff", p, tmp_path / "out.bin.data")
    assert code == 0 and "0 changed, 0 added, 0 removed, 6 same" in out

    del tensors["cplx"]  # so the diff below has a removed tensor
    save_file({f"model/{k}": v for k, v in tensors.items()}, tmp_path / "s.safetensors")
    code, _, err = run(capsys, "convert", tmp_path / "s.safetensors", tmp_path / "h.safetensors", "--dtype", "float16")
    assert code == 0 and "3 cast to float16" in err
    assert load_file(tmp_path / "h.safetensors")["model/layer.bias"].dtype == torch.float16
    code, out, _ = run(capsys, "diff", tmp_path / "s.safetensors", tmp_path / "h.safetensors", "--json")
    assert code == 1
    rep = json.loads(out)
    bias = next(t for t in rep["tensors"] if t["name"] == "model/layer.bias")
    assert bias["dtype"] == ["float64", "float16"] and bias["status"] == "changed"
    assert 0 < float(bias["max_abs_diff"]) < 1e-2
    code, out, _ = run(capsys, "diff", p, tmp_path / "h.safetensors")
    assert code == 1 and "removed" in out and "model/cplx" in out and "step" in out


@pytest.mark.parametrize("argv, message", [
    (["ls", "{tmp}/missing.pt"], "missing.pt: No such file or directory"),
    (["ls", "{tmp}/notes.txt"], "unrecognised file"),
    (["ls", "{tmp}/pointer.pt"], "Git LFS pointer"),
    (["show", "{tmp}/good.pt", "nope"], "no tensor named 'nope'"),
    (["ls", "{tmp}/truncated.pt"], "truncated.pt"),
])
def test_errors_are_one_line(capsys, tmp_path, argv, message):
    (tmp_path / "notes.txt").write_text("just some notes\n")
    (tmp_path / "pointer.pt").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 +
                                         "\nsize 12\n")
    torch.save({"x": torch.ones(1000)}, tmp_path / "good.pt")
    (tmp_path / "truncated.pt").write_bytes((tmp_path / "good.pt").read_bytes()[:1500])
    code, out, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and out == ""
    assert err.startswith("zipslice: error: ") and err.count("\n") == 1 and message in err
    assert "Traceback" not in err


def test_bad_option_is_a_usage_error(capsys, ckpt, tmp_path):
    p, _ = ckpt
    code, _, err = run(capsys, "convert", p, tmp_path / "x.pt", "--dtype", "int8")
    assert code == 2 and "Traceback" not in err
    assert err.splitlines() == ["zipslice convert: error: Invalid value for '--dtype': 'int8' is not a dtype to cast "
                                "to; choose one of bfloat16, float16, float32", "Try 'zipslice convert -h' for help."]


def test_real_subprocess(tmp_path):
    """The installed entry point's module, end to end: one line on failure, data on stdout on success."""
    torch.save({"a": torch.arange(6.0).reshape(2, 3)}, tmp_path / "a.pt")
    ok = subprocess.run([sys.executable, "-m", "zipslice.cli", "ls", str(tmp_path / "a.pt"), "--json"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stderr == "" and json.loads(ok.stdout)["tensors"][0]["name"] == "a"
    bad = subprocess.run([sys.executable, "-m", "zipslice.cli", "show", str(tmp_path / "nothere.pt"), "a"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [f"zipslice: error: {tmp_path / 'nothere.pt'}: No such file or directory"]
