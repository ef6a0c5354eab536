"""Which strategy (and parameters) merges a group changed on both sides.

Sources, most specific first (docs/guide/merging.md, "Choosing the strategy"):

1. environment: ``GIT_THETA_MERGE_STRATEGY`` for every group of this command, ``GIT_THETA_MERGE_<PARAM>``
   (e.g. ``GIT_THETA_MERGE_DENSITY``, ``GIT_THETA_MERGE_LAMBDA_OURS``) for parameters;
2. the first matching ``[[rule]]`` of ``.thetamerge`` (TOML, at the top of the working tree);
3. ``git config theta.merge.strategy`` and ``theta.merge.<param>`` (git spells ``lambda_ours`` as
   ``lambda-ours``: git config names cannot hold ``_``);
4. the ``[default]`` table of ``.thetamerge``.

Parameters are layered the other way round (a more specific source overrides a broader one) and only the
ones the chosen strategy knows are passed to it, so ``theta.merge.density`` does not break ``average``.

``.thetamerge`` example::

    [default]
    strategy = "ties"
    density = 0.3

    [[rule]]
    groups = ["*embed*", "lm_head.*"]   # fnmatch globs on group names
    strategy = "ours"

    [[rule]]
    paths = "adapters/*.safetensors"    # optional: globs on the checkpoint's path in the repo
    strategy = "average"
    alpha = 0.7
"""
from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Mapping

from theta.base.errors import GitError, MergeError, ThetaError
from theta.git import repo as gitutil
from theta.settings import parse_bool

RULES_FILE = ".thetamerge"
ENV_PREFIX = "GIT_THETA_MERGE_"
_ENV_NOT_PARAMS = {"STRATEGY", "INTERACTIVE", "VALUES"}


@dataclass(frozen=True)
class Choice:
    """The strategy chosen for one group (None: nothing configured) and where the choice came from."""

    strategy: str | None
    params: dict[str, float]
    source: str


@dataclass(frozen=True)
class Rule:
    groups: tuple[str, ...]
    paths: tuple[str, ...]
    strategy: str | None
    params: dict[str, float]
    label: str

    def matches(self, path: str, group: str) -> bool:
        if self.paths and not any(fnmatchcase(path, p) for p in self.paths):
            return False
        return not self.groups or any(fnmatchcase(group, g) for g in self.groups)


def _param_name(key: str) -> str:
    return key.strip().lower().replace("-", "_")


# .thetamerge comes with the repository (untrusted): bounded before it is parsed
MAX_RULES_FILE_BYTES = 1 << 20
MAX_RULES_DEPTH = 8           # nesting of arrays/inline tables (the format needs 2: [[rule]] + a glob list)
MAX_RULES = 1000
MAX_GLOBS = 1000              # per rule
MAX_GLOB_CHARS = 1024


def _number(value: object, where: str) -> float:
    """A finite float from config, environment or .thetamerge; MergeError naming ``where`` otherwise."""
    if isinstance(value, bool):
        raise MergeError(f"{where}: expected a number, got {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise MergeError(f"{where}: expected a number, got {_short(value)}") from None
    if not math.isfinite(number):
        raise MergeError(f"{where}: expected a finite number, got {value!r}")
    return number


def _globs(value: object, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        if len(value) > MAX_GLOBS or any(len(v) > MAX_GLOB_CHARS for v in value):
            raise MergeError(f"{where}: at most {MAX_GLOBS} globs of at most {MAX_GLOB_CHARS} characters")
        return tuple(value)
    raise MergeError(f"{where}: expected a glob or a list of globs, got {_short(value)}")


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def toml_depth(text: str) -> int:
    """The deepest nesting of arrays and inline tables in a TOML text, without parsing it (tomllib recurses
    once per level). Strings (basic, literal, multi-line) and comments are skipped."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c in "\"'":
            triple = text.startswith(c * 3, i)
            quote = c * 3 if triple else c
            i += len(quote)
            while i < n and not text.startswith(quote, i):
                if c == '"' and text[i] == "\\":
                    i += 1
                elif not triple and text[i] == "\n":
                    break  # an unterminated one-line string: tomllib reports it
                i += 1
            i += len(quote)
        else:
            if c in "[{":
                depth += 1
                deepest = max(deepest, depth)
            elif c in "]}":
                depth -= 1
            i += 1
    return deepest


def _table(table: Mapping, where: str) -> tuple[str | None, dict[str, float]]:
    strategy = table.get("strategy")
    if strategy is not None and not isinstance(strategy, str):
        raise MergeError(f"{where}: strategy must be a string, got {strategy!r}")
    params = {_param_name(k): _number(v, f"{where}: {k}") for k, v in table.items()
              if k not in ("strategy", "groups", "paths", "values")}
    return strategy, params


@dataclass
class MergeConfig:
    env_strategy: str | None = None
    env_params: dict[str, float] = field(default_factory=dict)
    git_strategy: str | None = None
    git_params: dict[str, float] = field(default_factory=dict)
    file_strategy: str | None = None
    file_params: dict[str, float] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)
    interactive: bool = True
    # non-tensor values (epoch counters, ...) changed differently on both sides: None = conflict, "ours", "theirs"
    values: str | None = None
    # given on the command line (`git theta merge-resolve --strategy/--param`): above everything else
    cli_strategy: str | None = None
    cli_params: dict[str, float] = field(default_factory=dict)

    @property
    def configured(self) -> bool:
        return bool(self.cli_strategy or self.env_strategy or self.git_strategy or self.file_strategy
                    or any(r.strategy for r in self.rules))

    def choose(self, path: str, group: str) -> Choice:
        rule = next((r for r in self.rules if r.strategy and r.matches(path, group)), None)
        if self.cli_strategy:
            strategy, source = self.cli_strategy, "--strategy"
        elif self.env_strategy:
            strategy, source = self.env_strategy, "environment GIT_THETA_MERGE_STRATEGY"
        elif rule is not None:
            strategy, source = rule.strategy, rule.label
        elif self.git_strategy:
            strategy, source = self.git_strategy, "git config theta.merge.strategy"
        elif self.file_strategy:
            strategy, source = self.file_strategy, f"{RULES_FILE} [default]"
        else:
            return Choice(None, {}, "no strategy configured")
        params: dict[str, float] = {}
        params.update(self.file_params)
        params.update(self.git_params)
        # parameters of any matching rule (even one without a strategy) refine the broader ones
        for r in reversed([r for r in self.rules if r.matches(path, group)]):
            params.update(r.params)
        params.update(self.env_params)
        params.update(self.cli_params)
        return Choice(strategy, params, source)

    def check_parameters(self, known: set[str]) -> None:
        """Refuse parameter names no installed strategy knows (a typo must not silently use a default)."""
        sources = [("--param ", self.cli_params), ("environment GIT_THETA_MERGE_", self.env_params),
                   ("git config theta.merge.", self.git_params),
                   (f"{RULES_FILE} [default] ", self.file_params)]
        sources += [(f"{r.label} ", r.params) for r in self.rules]
        for where, params in sources:
            for name in params:
                if name not in known:
                    shown = name.upper() if where.startswith("environment") else name
                    raise MergeError(f"unknown merge parameter {where}{shown}; parameters of the installed "
                                     f"strategies: {', '.join(sorted(known))}")

    @classmethod
    def load(cls, repo_dir: str | os.PathLike = ".", environ: Mapping[str, str] | None = None) -> "MergeConfig":
        environ = os.environ if environ is None else environ
        cfg = cls()
        _load_file(cfg, Path(repo_dir) / RULES_FILE)
        _load_git(cfg, repo_dir)
        for key, value in environ.items():
            if not key.startswith(ENV_PREFIX) or not value:
                continue
            name = key[len(ENV_PREFIX):]
            if name == "STRATEGY":
                cfg.env_strategy = value.strip()
            elif name == "INTERACTIVE":
                cfg.interactive = _boolean(value, key)
            elif name == "VALUES":
                cfg.values = _values_policy(value, f"environment {key}")
            elif name not in _ENV_NOT_PARAMS:
                cfg.env_params[_param_name(name)] = _number(value, f"environment {key}")
        return cfg


def _values_policy(value: object, where: str) -> str | None:
    v = str(value).strip().lower()
    if v in ("ours", "theirs"):
        return v
    if v == "conflict":
        return None
    raise MergeError(f"{where}: expected ours, theirs or conflict, got {value!r}")


def _boolean(value: str, where: str) -> bool:
    try:
        return parse_bool(value, where)
    except ThetaError as e:
        raise MergeError(str(e)) from None


def _load_file(cfg: MergeConfig, path: Path) -> None:
    if not path.is_file():
        return
    size = path.stat().st_size
    if size > MAX_RULES_FILE_BYTES:
        raise MergeError(f"{path}: {size} bytes, over the limit of {MAX_RULES_FILE_BYTES} for {RULES_FILE}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise MergeError(f"{path}: not valid TOML: {e}") from None
    depth = toml_depth(text)
    if depth > MAX_RULES_DEPTH:
        raise MergeError(f"{path}: arrays or tables nested {depth} deep, over the limit of {MAX_RULES_DEPTH}")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise MergeError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:  # defence in depth: toml_depth should have refused it
        raise MergeError(f"{path}: nested too deeply") from None
    unknown = set(data) - {"default", "rule"}
    if unknown:
        raise MergeError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}; expected [default] and [[rule]]")
    cfg.file_strategy, cfg.file_params = _table(data.get("default", {}), f"{path} [default]")
    if "values" in data.get("default", {}):
        cfg.values = _values_policy(data["default"]["values"], f"{path} [default] values")
    if not isinstance(data.get("default", {}), dict):
        raise MergeError(f"{path}: 'default' must be a table ([default])")
    rules = data.get("rule", [])
    if not isinstance(rules, list) or not all(isinstance(t, dict) for t in rules):
        raise MergeError(f"{path}: 'rule' must be an array of tables ([[rule]])")
    if len(rules) > MAX_RULES:
        raise MergeError(f"{path}: {len(rules)} rules, over the limit of {MAX_RULES}")
    for i, table in enumerate(rules, 1):
        where = f"{path} rule {i}"
        strategy, params = _table(table, where)
        groups, paths = _globs(table.get("groups"), where + " groups"), _globs(table.get("paths"), where + " paths")
        label = f"{RULES_FILE} rule {i} (groups {', '.join(groups) or '*'})"
        cfg.rules.append(Rule(groups, paths, strategy, params, label))


def _load_git(cfg: MergeConfig, repo_dir: str | os.PathLike) -> None:
    try:
        found = gitutil.config_get_regexp(r"^theta\.merge\.", repo_dir)
    except GitError as e:
        raise MergeError(f"git config failed in {os.fspath(repo_dir)}: {e}") from None
    for key, value in found.items():
        name = key[len("theta.merge."):]
        if name == "strategy":
            cfg.git_strategy = value.strip()
        elif name == "interactive":
            cfg.interactive = _boolean(value, f"git config {key}")
        elif name == "values":
            cfg.values = _values_policy(value, f"git config {key}")
        elif "." not in name:
            cfg.git_params[_param_name(name)] = _number(value, f"git config {key}")
