"""tempo.measure: bytes autograd keeps for backward, per module, once per storage, parameters apart."""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import tempo  # noqa: E402


class TwoUses(nn.Module):
    """One tensor saved by two ops, one op outside any child, one child called twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)          # Linear keeps x (8 x 8 x 4 bytes)
        a = h * h                # mul keeps h (twice: one storage) -- charged to the root
        b = self.lin(a)          # Linear keeps a
        return torch.tanh(b)     # tanh keeps its output -- root


def test_counts_each_storage_once_and_charges_the_innermost_module():
    x = torch.randn(8, 8, requires_grad=True)
    model = TwoUses()
    report = tempo.measure(model, (x,))
    assert report.by_path() == {"lin": 2 * 256, "(root)": 2 * 256}
    assert report.total_bytes == 4 * 256
    assert report.parameter_bytes == 256  # the weight is saved too (not the bias), reported apart
    assert [m.storages for m in report.modules] == [2, 2]
    assert [(s.path, s.shape, s.dtype, s.bytes) for s in report.storages] == [
        ("lin", (8, 8), torch.float32, 256),     # x
        ("(root)", (8, 8), torch.float32, 256),  # h
        ("lin", (8, 8), torch.float32, 256),     # a
        ("(root)", (8, 8), torch.float32, 256),  # tanh's output
    ]


def test_views_count_their_whole_storage():
    class Slice(nn.Module):
        def forward(self, x):
            big = x * 2
            return torch.sin(big[:1])  # sin keeps a 1-row view of a 100-row storage

    report = tempo.measure(Slice(), (torch.randn(100, 10, requires_grad=True),))
    assert report.total_bytes == 100 * 10 * 4


def test_inputs_as_dict_and_table():
    class Kw(nn.Module):
        def forward(self, *, a, b):
            return a * b

    a, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    report = tempo.measure(Kw(), {"a": a, "b": b})
    assert report.total_bytes == 2 * 5 * 4
    table = report.table()
    assert "(root)" in table and "total" in table.splitlines()[-1]
    assert report.by_type() == {"Kw": 40}


def test_nothing_saved_under_eval_no_grad_inputs():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU()).requires_grad_(False)
    assert tempo.measure(model, (torch.randn(3, 4),)).total_bytes == 0


def test_hooks_are_removed():
    model = nn.Sequential(nn.Linear(4, 4))
    tempo.measure(model, (torch.randn(2, 4),))
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


class _KeepsAnEmptyTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, x.new_zeros(0))  # like tempo's LayerNorm with no kept columns
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _EmptyKeeper(nn.Module):
    def forward(self, x):
        return _KeepsAnEmptyTensor.apply(x)


def test_empty_saved_tensors_are_not_storages():
    """Every empty storage has data pointer 0: counted, they would pass for one shared storage."""
    model = nn.Sequential(_EmptyKeeper(), _EmptyKeeper())
    report = tempo.measure(model, (torch.randn(4, requires_grad=True),))
    assert [(m.path, m.bytes, m.storages) for m in report.modules] == [("0", 16, 1), ("1", 16, 1)]
