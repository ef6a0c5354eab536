"""Small torch checkpoints for the end-to-end tests, and how to compare what git checks out with them."""
from collections import OrderedDict

import torch

from theta.storage.metadata import loads


def make_state(seed: int = 0, n_layers: int = 3) -> OrderedDict:
    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict()
    sd["embed.weight"] = torch.randn(64, 32, generator=g)
    for i in range(n_layers):
        sd[f"layers.{i}.attn.weight"] = torch.randn(32, 32, generator=g) * 0.02
        sd[f"layers.{i}.mlp.weight"] = torch.randn(64, 32, generator=g) * 0.02
        sd[f"layers.{i}.norm.weight"] = torch.ones(32)
    sd["head.bias"] = torch.zeros(64, dtype=torch.bfloat16)
    sd["steps"] = torch.tensor(7, dtype=torch.int64)
    return sd


def save_pt(path, sd, extra=None):
    obj = {"model": sd, "epoch": 3, "name": "tiny"} if extra is None else {"model": sd, **extra}
    torch.save(obj, path)


def assert_same_checkpoint(path, expected_sd, extra=None):
    got = torch.load(path, weights_only=True)
    assert list(got["model"]) == list(expected_sd)
    for k, v in expected_sd.items():
        g = got["model"][k]
        assert g.dtype == v.dtype and g.shape == v.shape, k
        assert torch.equal(g.view(torch.uint8) if g.dim() else g, v.view(torch.uint8) if v.dim() else v), k
    for k, v in (extra or {"epoch": 3, "name": "tiny"}).items():
        assert got[k] == v


def blob_oids(repo, spec):
    return {r.oid for r in loads(repo.show(spec)).blob_refs()}
