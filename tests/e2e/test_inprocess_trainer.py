"""theta.ThetaTrainerCallback: a real transformers Trainer run (a tiny GPT-2 built from its config) whose
checkpoints become the history of one tracked file, through real git and git-lfs."""
from __future__ import annotations

import pytest
import torch

import theta
import zipslice
from support.gitrepo import GitEnv
from theta.base.errors import StagedChangesError
from theta.storage.metadata import loads

transformers = pytest.importorskip("transformers")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, length: int = 16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 101, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer(out, callback, steps: int = 6):
    torch.manual_seed(0)
    # n_embd 128: the MLP's two matrices are 256 KiB each, large enough to be stored as split keyframes
    # (theta.updates.keyframe), so a later save stores them as split steps; the smaller groups, moved by Adam as
    # much as their size, are stored whole again at every save
    config = transformers.GPT2Config(n_embd=128, n_layer=1, n_head=2, vocab_size=101, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, save_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_only_model=True, use_cpu=True, disable_tqdm=True, seed=0)
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])


@pytest.fixture
def repo(tmp_path, monkeypatch):
    env = GitEnv.create(tmp_path)
    env.run(["git", "theta", "install"], cwd=env.home)
    for k, v in env.env.items():
        monkeypatch.setenv(k, v)
    r = env.init("work", theta=False)
    (r / "README").write_text("run\n")
    r.commit("start", "README")
    return r


@pytest.mark.slow  # a Trainer run: ~25 s on a loaded 2-core machine
def test_each_checkpoint_the_trainer_saves_becomes_a_commit(repo, tmp_path):
    callback = theta.ThetaTrainerCallback("model.safetensors", repo=repo.path, tag="step-{step}")
    trainer(tmp_path / "run", callback).train()
    assert [c.step for c in callback.committed] == [2, 4, 6]
    log = repo.out("log", "--format=%s", "--", "model.safetensors").splitlines()
    assert log == [f"checkpoint-{s}: step {s}, epoch {s / 8:.2f}" for s in (6, 4, 2)]  # 8 steps an epoch
    assert repo.out("rev-parse", "step-6") == repo.out("rev-parse", "HEAD") == callback.committed[-1].commit
    assert repo.status() == "D model.safetensors"  # committed, never written to the work tree
    for c in callback.committed:
        with theta.load_from_git(f"step-{c.step}", repo / "model.safetensors") as got, \
                zipslice.load(tmp_path / "run" / f"checkpoint-{c.step}" / "model.safetensors") as want:
            assert list(got) == list(want) and got.metadata == want.metadata == {"format": "pt"}
            for k in want:
                assert bytes(got.read_bytes(k)) == bytes(want.read_bytes(k)), (c.step, k)
    # later saves store changes: each holds fewer new bytes than the first (the MLP's split steps)
    first, *later = callback.committed
    assert all(c.new_blob_bytes < first.new_blob_bytes for c in later), \
        [(c.step, c.new_blob_bytes) for c in callback.committed]
    assert all(c.seconds > 0 and c.groups == first.groups for c in callback.committed)
    head = loads(repo.show("HEAD:model.safetensors"))
    assert any(g.steps[-1].type != "dense" for g in head.groups.values())
    repo.git("checkout", "--", "model.safetensors")
    assert repo.status() == ""
    assert (repo / "model.safetensors").read_bytes() == \
        (tmp_path / "run" / "checkpoint-6" / "model.safetensors").read_bytes()


def test_on_save_commits_the_weights_save_pretrained_wrote(repo, tmp_path):
    """The callback as the Trainer calls it (its own TrainingArguments and TrainerState), without a training
    run: each checkpoint directory's model.safetensors, written by save_pretrained, becomes a commit."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=101,
                                                                 n_positions=16))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[])
    callback = theta.ThetaTrainerCallback("model.safetensors", repo=repo.path, tag="s{step}")
    state = transformers.TrainerState(is_world_process_zero=True)
    callback.on_train_begin(args, state, transformers.TrainerControl())
    for step in (10, 20):
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.add_(0.01)  # one matrix moves
        state.global_step, state.epoch = step, step / 10
        state.log_history.append({"loss": 1.0 / step, "step": step})
        model.save_pretrained(tmp_path / "run" / f"checkpoint-{step}")
        callback.on_save(args, state, transformers.TrainerControl())
    assert repo.out("log", "--format=%s", "-2").splitlines() == ["checkpoint-20: step 20, epoch 2.00",
                                                                "checkpoint-10: step 10, epoch 1.00"]
    first, second = callback.committed
    assert (first.changed_groups, second.changed_groups) == (first.groups, 1)
    assert 0 < second.new_blob_bytes < 32 * 128 * 4  # less than that matrix's own bytes
    with theta.load_from_git("s20", repo / "model.safetensors") as got, \
            zipslice.load(tmp_path / "run" / "checkpoint-20" / "model.safetensors") as want:
        assert list(got) == list(want)
        assert all(bytes(got.read_bytes(k)) == bytes(want.read_bytes(k)) for k in want)
    # a sharded save (an index and its shards) is committed as the one tracked file
    state.global_step = 30
    model.save_pretrained(tmp_path / "run" / "checkpoint-30", max_shard_size="20KB")
    callback.on_save(args, state, transformers.TrainerControl())
    assert callback.committed[-1].source.endswith("model.safetensors.index.json")
    with theta.load_from_git("s30", repo / "model.safetensors") as got, \
            zipslice.load(tmp_path / "run" / "checkpoint-30" / "model.safetensors.index.json") as want:
        assert sorted(got) == sorted(want) and got.format == "safetensors"
        assert all(bytes(got.read_bytes(k)) == bytes(want.read_bytes(k)) for k in want)
    # a process other than the world's first commits nothing
    state.is_world_process_zero, state.global_step = False, 40
    callback.on_save(args, state, transformers.TrainerControl())
    assert len(callback.committed) == 3


def test_a_repository_that_cannot_take_the_commits_fails_before_training(repo, tmp_path):
    (repo / "model.safetensors").write_bytes(b"user's own")
    repo.theta("track", "model.safetensors")
    repo.git("add", ".gitattributes", "model.safetensors")
    callback = theta.ThetaTrainerCallback("model.safetensors", repo=repo.path)
    t = trainer(tmp_path / "run", callback, steps=2)
    with pytest.raises(StagedChangesError, match="model.safetensors has staged changes"):
        t.train()
    assert t.state.global_step == 0 and not (tmp_path / "run" / "checkpoint-2").exists()
