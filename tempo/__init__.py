"""tempo: fine-tune transformers in less memory by keeping less for backward (Tempo, NeurIPS 2022, done right).

    report = tempo.patch(model)          # swap GELU, LayerNorm, attention, dropout modules in place
    print(report)                        # what was swapped, what was left and why
    saved = tempo.measure(model, batch)  # bytes autograd keeps for backward, per module
    tempo.unpatch(model)                 # back to the original classes

Forward outputs, RNG use and state_dict are unchanged; gradients differ from stock by rounding only
(near GELU's minimum, by the floor float32 rounding of y sets). See docs/tempo.md.
Requires torch (the `tempo` extra); Hugging Face models need `transformers` (the `hf` extra).
"""
from zipslice import optional

# without torch: one line naming the extra, not a bare ModuleNotFoundError from the first module below
optional.require("torch", "tempo needs it", extra="tempo")
from .attention import softmax_dropout_matmul  # noqa: E402
from .dropout import TempoDropout, dropout  # noqa: E402
from .gelu import TempoGELU, gelu  # noqa: E402
from .layernorm import TempoLayerNorm, layer_norm  # noqa: E402
from .measure import ModuleSaved, SavedReport, SavedStorage, measure  # noqa: E402
from .patch import TECHNIQUES, Left, PatchReport, Swapped, patch, unpatch  # noqa: E402

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
