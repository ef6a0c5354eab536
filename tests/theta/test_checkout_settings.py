"""theta.settings.checkout_settings: when checkout goes through a placeholder, from env, git config, memory."""
from __future__ import annotations

import subprocess

import pytest

from theta import settings
from theta.base.errors import ThetaError
from zipslice import memory


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for name in ("GIT_THETA_MATERIALIZE_ABOVE", "GIT_THETA_SKIP_SMUDGE"):
        monkeypatch.delenv(name, raising=False)
    subprocess.run(["git", "init", "-q", str(tmp_path / "r")], check=True)
    return tmp_path / "r"


@pytest.mark.parametrize("text,value", [("0", 0), ("123", 123), ("64MiB", 64 << 20), ("1.5G", 3 << 29),
                                        ("2 gb", 2 << 30), ("512k", 512 << 10)])
def test_sizes(text, value):
    assert settings.parse_size(text, "x") == value


@pytest.mark.parametrize("text", ["", "-1", "12 parsecs", "MiB", "1e3"])
def test_bad_sizes_name_their_source(text):
    with pytest.raises(ThetaError, match="theta.materializeAbove: expected a size"):
        settings.parse_size(text, "theta.materializeAbove")


def test_auto_is_the_default_within_the_memory_the_process_has(repo, monkeypatch):
    monkeypatch.setattr(memory, "available", lambda: 64 << 30)
    assert settings.checkout_settings(repo) == settings.CheckoutSettings(settings.MATERIALIZE_ABOVE_DEFAULT)
    monkeypatch.setattr(memory, "available", lambda: 2 << 20)  # a tiny container: a quarter of it
    assert settings.checkout_settings(repo).materialize_above == 512 << 10


def test_git_config_then_environment(repo, monkeypatch):
    subprocess.run(["git", "config", "theta.materializeAbove", "2G"], cwd=repo, check=True)
    subprocess.run(["git", "config", "theta.skipSmudge", "true"], cwd=repo, check=True)
    assert settings.checkout_settings(repo) == settings.CheckoutSettings(2 << 30, skip=True)
    monkeypatch.setenv("GIT_THETA_MATERIALIZE_ABOVE", "0")
    monkeypatch.setenv("GIT_THETA_SKIP_SMUDGE", "0")
    assert settings.checkout_settings(repo) == settings.CheckoutSettings(0, skip=False)
    monkeypatch.setenv("GIT_THETA_SKIP_SMUDGE", "maybe")
    with pytest.raises(ThetaError, match="GIT_THETA_SKIP_SMUDGE: expected a boolean"):
        settings.checkout_settings(repo)
