"""tempo.patch / tempo.unpatch on plain torch modules: class swap in place, weights and state_dict untouched."""
import io
import pickle

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import tempo  # noqa: E402
from tempo import gelu_slope  # noqa: E402


class CustomGELU(nn.GELU):
    def forward(self, x):
        return super().forward(x) * 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(32, eps=1e-12)
        self.fc1 = nn.Linear(32, 128)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(128, 32)
        self.drop = nn.Dropout(0.1)
        self.drop_inplace = nn.Dropout(0.1, inplace=True)
        self.mha = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.act_tanh = nn.GELU(approximate="tanh")
        self.custom = CustomGELU()

    def forward(self, x):
        a, _ = self.mha(x, x, x, need_weights=False)
        h = self.fc2(self.act(self.fc1(self.ln(x + a))))
        h = self.drop_inplace(self.drop(h) + x)
        return self.custom(self.act_tanh(h))


def _model():
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():  # pretrained-looking gamma/beta, so a rebuilt LayerNorm would show
        model.ln.weight.uniform_(0.5, 1.5)
        model.ln.bias.uniform_(-0.2, 0.2)
    return model


def _forward_backward(model, x, seed=1):
    leaf = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = model(leaf)
    out.backward(torch.ones_like(out))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), leaf.grad, grads


def _saved_bytes(state_dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    return buffer.getvalue()


def test_report_lists_swapped_and_left():
    model = _model()
    report = tempo.patch(model)
    assert {(s.path, s.before, s.after, s.technique) for s in report.swapped} == {
        ("ln", "LayerNorm", "TempoLayerNorm", "layernorm"),
        ("act", "GELU", "TempoGELU", "gelu"),
        ("act_tanh", "GELU", "TempoGELU", "gelu"),
        ("drop", "Dropout", "TempoDropout", "dropout"),
    }
    left = {m.path: m.reason for m in report.left}
    assert set(left) == {"drop_inplace", "mha", "custom"}
    assert "inplace" in left["drop_inplace"] and "MultiheadAttention" in left["mha"] and "subclass" in left["custom"]
    assert "swapped 4 modules" in str(report) and "left 3 modules" in str(report)


def test_state_dict_weights_eps_and_objects_unchanged():
    model = _model()
    before = model.state_dict()
    params = dict(model.named_parameters())
    tempo.patch(model)
    after = model.state_dict()
    assert list(before) == list(after)
    assert all(before[k] is after[k] or before[k].data_ptr() == after[k].data_ptr() for k in before)
    assert _saved_bytes(before) == _saved_bytes(after)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert model.ln.eps == 1e-12 and model.ln.normalized_shape == (32,)
    assert model.drop.p == 0.1


def test_forward_bit_identical_train_and_eval_and_gradients_close():
    stock, patched = _model(), _model()
    tempo.patch(patched)
    x = torch.randn(4, 10, 32)
    out_s, dx_s, grads_s = _forward_backward(stock, x)
    out_p, dx_p, grads_p = _forward_backward(patched, x)
    assert torch.equal(out_s, out_p)
    for name, a, b in [("x", dx_p, dx_s)] + [(n, grads_p[n], grads_s[n]) for n in grads_s]:
        assert (a - b).norm() <= 1e-5 * b.norm(), name
    stock.eval()
    patched.eval()
    with torch.no_grad():
        assert torch.equal(stock(x), patched(x))
        assert torch.equal(patched(x), patched(x))  # eval: no dropout


def test_training_flag_kept_and_switchable():
    model = _model().eval()
    tempo.patch(model)
    assert not model.training and not model.drop.training
    model.train()
    assert model.drop.training


def test_unpatch_round_trip():
    model = _model()
    x = torch.randn(2, 5, 32)
    torch.manual_seed(3)
    expected = model(x)
    tempo.patch(model)
    restored = tempo.unpatch(model)
    assert {s.path for s in restored.swapped} == {"ln", "act", "act_tanh", "drop"}
    assert type(model.ln) is nn.LayerNorm and type(model.act) is nn.GELU and type(model.drop) is nn.Dropout
    assert "tempo_ratio" not in model.ln.__dict__
    torch.manual_seed(3)
    assert torch.equal(model(x), expected)
    assert tempo.unpatch(model).swapped == []


def test_patch_twice_leaves_patched_modules():
    model = _model()
    tempo.patch(model)
    again = tempo.patch(model)
    assert again.swapped == []
    assert {m.path for m in again.left if m.reason == "already patched"} == {"ln", "act", "act_tanh", "drop"}


def test_techniques_switch_off():
    model = _model()
    report = tempo.patch(model, gelu=False, dropout=False)
    assert {s.technique for s in report.swapped} == {"layernorm"}
    assert {m.path for m in report.left if m.reason in ("gelu=False", "dropout=False")} == {"act", "act_tanh", "drop"}
    assert type(model.act) is nn.GELU


def test_layernorm_ratio_option():
    model = _model()
    tempo.patch(model, layernorm_ratio=4.0)
    assert model.ln.tempo_ratio == 4.0


def test_hooks_survive():
    model = _model()
    calls = []
    model.ln.register_forward_hook(lambda m, a, o: calls.append(type(m).__name__))
    tempo.patch(model)
    model(torch.randn(1, 2, 32))
    assert calls == ["TempoLayerNorm"]


def test_patched_model_pickles():
    model = _model()
    tempo.patch(model)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone.ln) is tempo.TempoLayerNorm
    x = torch.randn(2, 3, 32)
    torch.manual_seed(4)
    a = model(x)
    torch.manual_seed(4)
    assert torch.equal(clone(x), a)


def _stash_bytes(module, x, y):
    with torch.no_grad():
        kind = "erf" if module.approximate == "none" else "tanh"
        return 8 * gelu_slope.stash_near_minimum(x, y, kind)[0].numel()


def test_measured_savings():
    """Exactly the bytes the techniques promise, per module, by saved-tensor hooks."""
    stock, patched = _model(), _model()
    tempo.patch(patched)
    x = torch.randn(4, 10, 32, requires_grad=True)
    stash = {}  # bytes of exact slopes the GELUs keep near their minimum (8 per element), same run
    for name in ("act", "act_tanh"):
        module = getattr(patched, name)
        module.register_forward_hook(lambda m, a, o, name=name: stash.__setitem__(name, _stash_bytes(m, a[0], o)))
    before, after = tempo.measure(stock, (x,)), tempo.measure(patched, (x,))
    n = 4 * 10  # tokens
    # stock GELU keeps its input; fc2 keeps its output. Ours: the output (charged to the GELU, fc2 keeps the
    # same storage) and 1 bit per element.
    assert before.by_path()["act"] == before.by_path()["fc2"] == n * 128 * 4
    assert after.by_path()["act"] == n * 128 * 4 + n * 128 // 8 + stash["act"] and "fc2" not in after.by_path()
    # Dropout: the float mask stock keeps on CPU becomes 1 bit per element
    assert (before.by_path()["drop"], after.by_path()["drop"]) == (n * 32 * 4, n * 32 // 8)
    # LayerNorm: stock keeps input, mean, rstd; ours keeps output (the same storage fc1 keeps) and rstd
    assert before.by_path()["ln"] == n * 32 * 4 + 2 * n * 4
    assert after.by_path()["ln"] == n * 32 * 4 + n * 4 and "fc1" not in after.by_path()
    gelu_saving = n * 128 * 4 - n * 128 // 8 - stash["act"]
    tanh_gelu_saving = n * 32 * 4 - n * 32 // 8 - stash["act_tanh"]  # its output is what `custom` keeps
    dropout_saving = n * 32 * 4 - n * 32 // 8
    layernorm_saving = n * 32 * 4 + n * 4  # input and mean
    assert before.total_bytes - after.total_bytes == gelu_saving + tanh_gelu_saving + dropout_saving + layernorm_saving


def test_layernorm_gains_nothing_when_its_consumer_copies():
    """If the next op keeps a copy rather than the output itself (nn.MultiheadAttention transposes its
    input), the output is kept for LayerNorm alone: the saving shrinks to the mean. measure() shows it."""
    model = nn.Sequential(nn.LayerNorm(32), nn.MultiheadAttention(32, 4, batch_first=True))

    class Run(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            h = self.inner[0](x)
            return self.inner[1](h, h, h, need_weights=False)[0]

    x = torch.randn(4, 10, 32, requires_grad=True)
    before = tempo.measure(Run(model), (x,)).total_bytes
    tempo.patch(model)
    after = tempo.measure(Run(model), (x,)).total_bytes
    assert before - after == 40 * 4  # the mean only
