"""A Hugging Face ``transformers`` Trainer callback: every checkpoint the Trainer saves becomes a commit.

    from theta import ThetaTrainerCallback

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[ThetaTrainerCallback("model.safetensors", tag="step-{step}")])
    trainer.train()      # each save: checkpoint-N/model.safetensors committed as model.safetensors

Each time the Trainer has written a checkpoint directory (``on_save``), the model weights it wrote there are
committed as the new version of one tracked path (:func:`theta.inprocess.commit.commit_checkpoint`: only the groups
that changed are stored, each in the form the clean's update policy picks), so the run's checkpoints become
that file's history: ``git log model.safetensors``, ``theta.load_from_git("step-500", "model.safetensors")``,
``git theta diff``. The weights are read from the file the Trainer wrote (still in the page cache): the commit
records exactly what the checkpoint holds, tied weights and file metadata included. Only the world's
process 0 commits. The repository's state is checked when training begins (:func:`theta.inprocess.commit.preflight`),
so a path that cannot be committed fails before the first step, not after an epoch.

This module imports ``transformers`` (the ``hf`` extra); ``theta`` imports it only when
``theta.ThetaTrainerCallback`` is first used.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from zipslice import optional

from theta.base.errors import ThetaDependencyError, ThetaError

# without the extra: one line naming it, not a bare ModuleNotFoundError from the import below
optional.require("transformers", "theta.ThetaTrainerCallback needs it", error=ThetaDependencyError)
from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

from theta.inprocess.commit import commit_checkpoint, preflight  # noqa: E402

# what the Trainer writes for the model, in the order looked for (single file, then sharded, then PEFT adapters)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class CommittedCheckpoint:
    """One checkpoint committed by the callback."""

    step: int
    commit: str
    source: str           # the weights file the Trainer wrote
    seconds: float        # how long the commit took (what the save added to the training step)
    new_blob_bytes: int   # bytes of new blobs stored for it
    changed_groups: int   # groups stored anew (the others were unchanged or within rtol/atol)
    groups: int


class ThetaTrainerCallback(TrainerCallback):
    """Commit each checkpoint the Trainer saves as a new version of ``path``.

    ``path``: the tracked file the checkpoints become versions of, relative to ``repo`` (default: the current
    directory); its committed format is kept (a new path takes its extension's). ``message`` and ``tag``:
    templates formatted with ``step``, ``epoch``, ``checkpoint`` (the directory name) and ``loss`` (the last
    training loss logged, or None); ``tag=None`` tags nothing. ``weights``: the file name to commit from each
    checkpoint directory (default: the first of :data:`WEIGHT_FILES` present). ``checkout``: also write each
    version into the work tree. ``progress``: a bar on stderr per commit.

    ``committed`` lists what each save did (:class:`CommittedCheckpoint`).
    """

    def __init__(self, path: str | os.PathLike = "model.safetensors", repo: str | os.PathLike | None = None, *,
                 message: str = "{checkpoint}: step {step}, epoch {epoch:.2f}",
                 tag: str | None = None, weights: str | None = None, checkout: bool = False,
                 progress: bool = False):
        self.path = Path(os.path.abspath(Path(repo) / path if repo is not None else path))
        self.message, self.tag, self.weights = message, tag, weights
        self.checkout, self.progress = checkout, progress
        self.committed: list[CommittedCheckpoint] = []

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            preflight(self.path)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        import zipslice

        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        source = self._weights_in(folder)
        fields = {"step": state.global_step, "epoch": float(state.epoch or 0.0), "checkpoint": folder.name,
                  "loss": _last_loss(state.log_history)}
        t0 = time.perf_counter()
        with zipslice.load(source) as lsd:
            saved = commit_checkpoint(lsd, self.path, self.message.format(**fields),
                                      tag=self.tag.format(**fields) if self.tag is not None else None,
                                      checkout=self.checkout, progress=self.progress)
        self.committed.append(CommittedCheckpoint(
            step=state.global_step, commit=str(saved.commit), source=str(source),
            seconds=time.perf_counter() - t0, new_blob_bytes=saved.stats.new_blob_bytes,
            changed_groups=saved.stats.written, groups=saved.stats.groups))

    def _weights_in(self, folder: Path) -> Path:
        names = (self.weights,) if self.weights is not None else WEIGHT_FILES
        for name in names:
            if (folder / name).is_file():
                return folder / name
        raise ThetaError(f"{folder}: the Trainer saved no model weights theta knows ({', '.join(names)})")


def _last_loss(history: list[dict]) -> float | None:
    for entry in reversed(history or []):
        if "loss" in entry:
            return entry["loss"]
    return None
