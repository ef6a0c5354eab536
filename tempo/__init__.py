"""tempo: fine-tune transformers in less memory by keeping less for backward (Tempo, NeurIPS 2022, done right).

    report = tempo.patch(model)          # swap GELU, LayerNorm, attention, dropout modules in place
    print(report)                        # what was swapped, what was left and why
    saved = tempo.measure(model, batch)  # bytes autograd keeps for backward, per module
    tempo.unpatch(model)                 # back to the original classes

Forward outputs, RNG use and state_dict are unchanged; gradients differ from stock by rounding only
(near GELU's minimum, by the floor float32 rounding of y sets). See docs/tempo.md.
Requires torch (the `tempo` extra); Hugging Face models need `transformers` (the `hf` extra).
"""
from .attention import softmax_dropout_matmul
from .dropout import TempoDropout, dropout
from .gelu import TempoGELU, gelu
from .layernorm import TempoLayerNorm, layer_norm
from .measure import ModuleSaved, SavedReport, SavedStorage, measure
from .patch import TECHNIQUES, Left, PatchReport, Swapped, patch, unpatch

__all__ = [
    "TECHNIQUES",
    "Left",
    "ModuleSaved",
    "PatchReport",
    "SavedReport",
    "SavedStorage",
    "Swapped",
    "TempoDropout",
    "TempoGELU",
    "TempoLayerNorm",
    "dropout",
    "gelu",
    "layer_norm",
    "measure",
    "patch",
    "softmax_dropout_matmul",
    "unpatch",
]
