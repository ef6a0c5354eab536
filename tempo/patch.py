"""Swap a model's modules for tempo's memory-lean ones in place, and back.

A swap changes only the module object's class (`module.__class__ = TempoX`, TempoX a subclass of X that
overrides forward): the object, its parameters, buffers, hooks, eps, p, `training` flag and therefore its
`state_dict` stay exactly as they were, and `unpatch` restores the original class. Nothing is rebuilt
from constructor arguments (the released Tempo rebuilt LayerNorm from normalized_shape, resetting
pretrained gamma/beta and eps).

Techniques (each can be switched off):
  gelu       nn.GELU; HF GELUActivation, NewGELUActivation, GELUTanh, FastGELUActivation
  layernorm  nn.LayerNorm
  attention  HF BERT / RoBERTa / GPT-2 eager self- and cross-attention, and sdpa where tempo keeps less
             (measured: on CPU in training with dropout), and the projection after it, which then rebuilds
             the attention context in backward instead of keeping it (tempo.hf, tempo.hf_sdpa)
  dropout    nn.Dropout (not in-place): 1-bit masks
Modules that look related but have no rule (other GELUs, norms, attention, dropouts) are reported as left,
with the reason.

A rule's `classify(module, parent_of)` answers None (not its module), a str (left: why), the tempo class to
swap in, or (class, note): swapped, with a note for the report (when the swapped module runs tempo's path).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

from torch import nn

from .dropout import TempoDropout
from .gelu import TempoGELU
from .layernorm import DEFAULT_RATIO, TempoLayerNorm

TECHNIQUES = ("gelu", "layernorm", "attention", "dropout")
_RELATED = re.compile(r"gelu|layernorm|rmsnorm|attention|dropout", re.IGNORECASE)


@dataclass(frozen=True)
class Swapped:
    path: str
    before: str
    after: str
    technique: str
    note: str = ""


@dataclass(frozen=True)
class Left:
    path: str
    type_name: str
    reason: str


@dataclass
class PatchReport:
    """What `patch` swapped (or `unpatch` restored) and which related modules it left, and why."""

    swapped: list[Swapped] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        totals: dict[str, int] = {}
        for s in self.swapped:
            totals[s.technique] = totals.get(s.technique, 0) + 1
        return totals

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)} modules: "
                 + (", ".join(f"{n} {t}" for t, n in self.counts().items()) or "none")]
        lines += [f"  {s.path}: {s.before} -> {s.after}" + (f" ({s.note})" if s.note else "") for s in self.swapped]
        if self.left:
            lines.append(f"left {len(self.left)} modules:")
            lines += [f"  {m.path}: {m.type_name}: {m.reason}" for m in self.left]
        return "\n".join(lines)


@dataclass(frozen=True)
class _ExactClassRule:
    technique: str
    base: type
    swap: type

    def classify(self, module: nn.Module, parent_of=lambda _m: None) -> type | str | None:
        if type(module) is self.base:
            return self.swap
        if isinstance(module, self.base):
            return f"a subclass of {self.base.__name__} (its forward may differ): left as is"
        return None


@dataclass(frozen=True)
class _DropoutRule:
    technique = "dropout"

    def classify(self, module: nn.Module, parent_of=lambda _m: None) -> type | str | None:
        if type(module) is nn.Dropout:
            return "inplace=True: left as is" if module.inplace else TempoDropout
        if isinstance(module, nn.Dropout):
            return "a subclass of Dropout (its forward may differ): left as is"
        return None


@dataclass(frozen=True)
class _PlainAttentionRule:
    technique = "attention"

    def classify(self, module: nn.Module, parent_of=lambda _m: None) -> type | str | None:
        if isinstance(module, nn.MultiheadAttention):
            return ("nn.MultiheadAttention has no tempo rule (use tempo.softmax_dropout_matmul in your own "
                    "attention)")
        if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            return "its activation is a function, not a module, and its attention is nn.MultiheadAttention"
        return None


def _rules() -> list:
    rules = [
        _ExactClassRule("gelu", nn.GELU, TempoGELU),
        _ExactClassRule("layernorm", nn.LayerNorm, TempoLayerNorm),
        _DropoutRule(),
        _PlainAttentionRule(),
    ]
    if "transformers" in sys.modules:  # a model holding HF modules has imported it already
        from . import hf

        rules = hf.RULES + rules
    return rules


def _is_tempo(module: nn.Module) -> bool:
    return "_tempo_base" in type(module).__dict__


def patch(
    model: nn.Module,
    *,
    gelu: bool = True,
    layernorm: bool = True,
    attention: bool = True,
    dropout: bool = True,
    layernorm_ratio: float = DEFAULT_RATIO,
) -> PatchReport:
    """Swap supported modules of `model` in place; return what was swapped and what was left (and why).

    layernorm_ratio: LayerNorm keeps x_hat for the columns where |beta| > ratio * |gamma| (tempo.layernorm).
    """
    enabled = {"gelu": gelu, "layernorm": layernorm, "attention": attention, "dropout": dropout}
    report = PatchReport()
    rules = _rules()
    handled: list[str] = []  # paths some rule spoke for (swapped or left with a reason)
    unruled: list[tuple[str, str]] = []
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    for path, module in model.named_modules():
        type_name = type(module).__name__
        if _is_tempo(module):
            report.left.append(Left(path or "(root)", type_name, "already patched"))
            handled.append(path)
            continue
        for rule in rules:
            result = rule.classify(module, lambda m: parents.get(id(m)))
            if result is None:
                continue
            handled.append(path)
            result, note = result if isinstance(result, tuple) else (result, "")
            if isinstance(result, str):
                report.left.append(Left(path or "(root)", type_name, result))
            elif not enabled[rule.technique]:
                report.left.append(Left(path or "(root)", type_name, f"{rule.technique}=False"))
            else:
                module.__class__ = result
                if rule.technique == "layernorm":
                    module.tempo_ratio = layernorm_ratio
                report.swapped.append(Swapped(path or "(root)", type_name, result.__name__, rule.technique, note))
            break
        else:
            if _RELATED.search(type_name):
                unruled.append((path, type_name))
    # related-looking modules no rule spoke for, unless they merely contain one that a rule did
    for path, type_name in unruled:
        prefix = f"{path}." if path else ""
        if not any(h.startswith(prefix) and h != path for h in handled):
            report.left.append(Left(path or "(root)", type_name, "no tempo rule for this class"))
    return report


def unpatch(model: nn.Module) -> PatchReport:
    """Restore every tempo module of `model` to its original class, in place; report what was restored."""
    report = PatchReport()
    for path, module in model.named_modules():
        if not _is_tempo(module):
            continue
        patched = type(module)
        module.__class__ = patched._tempo_base
        module.__dict__.pop("tempo_ratio", None)
        technique = patched.__dict__.get("_tempo_technique", "")
        report.swapped.append(Swapped(path or "(root)", patched.__name__, module.__class__.__name__, technique))
    return report
