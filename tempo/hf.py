"""Hugging Face transformers support: the rules tempo.patch uses for BERT, RoBERTa and GPT-2 modules.

Imported by tempo.patch only when `transformers` is already imported (a model holding its modules
implies it), so tempo never imports transformers itself otherwise.

- GELU activations (GELUActivation: erf form; NewGELUActivation, GELUTanh, FastGELUActivation: tanh
  form) get a subclass whose forward runs the original forward under tempo's output-keeping GELU.
- Self/cross attention of BERT, RoBERTa and GPT-2 pick their attention function from
  `config._attn_implementation` through transformers' AttentionInterface. The patched subclass sees a
  per-module view of its config whose `_attn_implementation` is "tempo" (registered below); every other
  attribute reads and writes through to the shared config, which is never modified. The "tempo" function
  reads the shared config's implementation at each call:
  eager: the model's own eager attention unless the module is training with dropout, and then the same
  ops with softmax -> dropout -> matmul fused (tempo.attend: bit-identical forward, same RNG use);
  sdpa: tempo.attend where tempo keeps less than SDPA (on CPU in training with dropout; measured, see
  tempo.hf_sdpa), with eager's mask: the eager model's forward and gradients; SDPA itself otherwise;
  any other implementation (flash, flex, a user's own): that implementation, untouched.
  tempo.patch leaves, with the reason, sdpa modules where SDPA keeps less, and every other implementation.
- The projection after a patched attention (BERT/RoBERTa `attention.output.dense`, GPT-2 `attn.c_proj`)
  gets tempo.context's subclass: it rebuilds the attention context in backward from what the attention
  keeps, instead of keeping it (technique "attention" too).
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers import activations as hf_activations
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.pytorch_utils import Conv1D

from . import hf_sdpa
from .attend import attend
from .context import TempoContextLinear, project_context
from .gelu import gelu_from_output

TEMPO_ATTENTION = "tempo"
EAGER_IMPLEMENTATIONS = (None, "eager")

# (module, class, GPT-2-style cast of the probabilities to V's dtype before dropout, its attention dropout)
_ATTENTION_CLASSES = (
    ("transformers.models.bert.modeling_bert", "BertSelfAttention", False, "dropout"),
    ("transformers.models.bert.modeling_bert", "BertCrossAttention", False, "dropout"),
    ("transformers.models.roberta.modeling_roberta", "RobertaSelfAttention", False, "dropout"),
    ("transformers.models.roberta.modeling_roberta", "RobertaCrossAttention", False, "dropout"),
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Attention", True, "attn_dropout"),
)
_GELU_CLASSES = (
    ("GELUActivation", "erf"),
    ("NewGELUActivation", "tanh"),
    ("GELUTanh", "tanh"),
    ("FastGELUActivation", "tanh"),  # 0.7978845608 vs sqrt(2/pi): 4e-11 apart
)


class _AttentionConfigView:
    """Reads and writes through to `config`, except `_attn_implementation`, which is "tempo"."""

    __slots__ = ("_tempo_config",)

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_tempo_config", config)

    @property
    def _attn_implementation(self) -> str:
        return TEMPO_ATTENTION

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_tempo_config"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_tempo_config"), name, value)

    def __repr__(self) -> str:
        return f"tempo view of {object.__getattribute__(self, '_tempo_config')!r}"


def _real_config(module: nn.Module) -> Any:
    return module.__dict__["config"]


def _config_view(module: nn.Module) -> _AttentionConfigView:
    return _AttentionConfigView(_real_config(module))


def _set_config(module: nn.Module, config: Any) -> None:
    module.__dict__["config"] = config


def tempo_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The "tempo" AttentionInterface entry: eager or sdpa attention with softmax -> dropout -> matmul fused
    where that keeps less; the model's own implementation otherwise."""
    cls = type(module)
    eager = cls._tempo_eager
    implementation = _real_config(module)._attn_implementation
    if implementation == hf_sdpa.SDPA:
        plan = hf_sdpa.plan(module, query, key, value, attention_mask, dropout, kwargs)
        if plan is not None:
            context, _, _ = attend(query, key, value, plan.mask, _scaling(scaling, query), dropout,
                                   value.dtype if cls._tempo_cast_probs else None)
            return context, None  # as SDPA: no attention weights
    if implementation not in EAGER_IMPLEMENTATIONS:  # sdpa left to SDPA, or another implementation
        fn = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    same_heads = query.shape[:-2] == key.shape[:-2] == value.shape[:-2]
    if not (module.training and dropout > 0.0 and torch.is_grad_enabled() and same_heads):
        return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    probs_dtype = value.dtype if cls._tempo_cast_probs else None
    # the output projection rebuilds the context from what attend keeps, in backward, instead of keeping it
    context, weights, _ = attend(query, key, value, attention_mask, _scaling(scaling, query), dropout, probs_dtype)
    return context, weights


def _scaling(scaling: float | None, query: torch.Tensor) -> float:
    return query.size(-1) ** -0.5 if scaling is None else scaling


AttentionInterface.register(TEMPO_ATTENTION, tempo_attention_forward)


def _register(cls: type) -> type:
    cls.__module__ = __name__
    cls.__qualname__ = cls.__name__
    globals()[cls.__name__] = cls  # importable, so patched models pickle
    return cls


def _attention_subclass(base: type, cast_probs: bool, dropout_attribute: str) -> type:
    eager = sys.modules[base.__module__].eager_attention_forward
    return _register(type(f"Tempo{base.__name__}", (base,), {
        "config": property(_config_view, _set_config),
        "_tempo_base": base,
        "_tempo_technique": "attention",
        "_tempo_eager": staticmethod(eager),
        "_tempo_cast_probs": cast_probs,
        "_tempo_dropout": dropout_attribute,
    }))


def _gelu_subclass(base: type, kind: str) -> type:
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return gelu_from_output(input, kind, partial(base.forward, self))

    return _register(type(f"Tempo{base.__name__}", (base,), {
        "forward": forward,
        "_tempo_base": base,
        "_tempo_technique": "gelu",
        "_tempo_kind": kind,
    }))


class TempoContextConv1D(Conv1D):
    """HF Conv1D (GPT-2's c_proj) after a tempo attention: keeps nothing of its input when it is the
    attention context. Same parameters, forward bits and state_dict."""

    _tempo_base = Conv1D
    _tempo_technique = "attention"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = project_context(x, self.weight, self.bias, weight_in_out=True)
        return super().forward(x) if out is None else out


_register(TempoContextConv1D)
# (class of the module holding the projection, its attribute, the projection's class) -> tempo class;
# BERT/RoBERTa: the projection's grandparent holds the attention as `.self`; GPT-2: its parent is it.
_PROJECTIONS = (
    ("transformers.models.bert.modeling_bert", "BertSelfOutput", "dense", nn.Linear, TempoContextLinear),
    ("transformers.models.roberta.modeling_roberta", "RobertaSelfOutput", "dense", nn.Linear, TempoContextLinear),
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Attention", "c_proj", Conv1D, TempoContextConv1D),
)


@dataclass(frozen=True)
class ContextProjectionRule:
    """The output projection of an attention tempo swapped (visited after it: named_modules' order)."""

    technique = "attention"
    holders: dict  # holder class -> (attribute, projection class, tempo class)

    def classify(self, module: nn.Module, parent_of=lambda _m: None) -> type | str | None:
        holder = parent_of(module)
        holder_cls = type(holder).__dict__.get("_tempo_base", type(holder))  # GPT-2's is swapped already
        spec = self.holders.get(holder_cls)
        if spec is None:
            return None
        attribute, base, swap = spec
        if type(module) is not base or getattr(holder, attribute, None) is not module:
            return None
        attention = holder if attribute == "c_proj" else getattr(parent_of(holder), "self", None)
        return swap if "_tempo_base" in type(attention).__dict__ else None


@dataclass(frozen=True)
class AttentionRule:
    technique = "attention"
    swaps: dict

    def classify(self, module: nn.Module, parent_of=lambda _m: None) -> type | tuple[type, str] | str | None:
        new_cls = self.swaps.get(type(module))
        if new_cls is None:
            return None
        implementation = _real_config(module)._attn_implementation
        if implementation not in EAGER_IMPLEMENTATIONS + (hf_sdpa.SDPA,):
            return (f"attention implementation {implementation!r}: tempo takes over eager and sdpa attention "
                    "only (flash and flex kernels keep no S x S tensor)")
        if getattr(module, "reorder_and_upcast_attn", False):
            return "reorder_and_upcast_attn=True (its own upcast attention path): left as is"
        if implementation == hf_sdpa.SDPA:
            takes_over, why = hf_sdpa.verdict(module, new_cls._tempo_dropout)
            return (new_cls, why) if takes_over else why
        return new_cls


@dataclass(frozen=True)
class GeluRule:
    technique = "gelu"
    swaps: dict

    def classify(self, module: nn.Module, parent_of=lambda _m: None) -> type | str | None:
        return self.swaps.get(type(module))


def _build_rules() -> list:
    attention = {}
    for module_name, class_name, cast, dropout in _ATTENTION_CLASSES:
        try:
            base = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # absent from this transformers version
            continue
        attention[base] = _attention_subclass(base, cast, dropout)
    gelus = {}
    for class_name, kind in _GELU_CLASSES:
        base = getattr(hf_activations, class_name, None)
        if base is not None:
            gelus[base] = _gelu_subclass(base, kind)
    holders = {}
    for module_name, class_name, attribute, base, swap in _PROJECTIONS:
        try:
            holder = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue
        holders[holder] = (attribute, base, swap)
    return [AttentionRule(attention), ContextProjectionRule(holders), GeluRule(gelus)]


RULES = _build_rules()
