"""Whole-layer numerics of a patched BERT: gradient error against float64 within 3x stock float32's own,
and (slow) 300 training steps whose loss matches stock's at every step."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402

import tempo  # noqa: E402
from tempo.numerics import INPUT, gradient_errors, gradients  # noqa: E402


def test_gradient_error_within_3x_stock_for_every_parameter():
    config = transformers.BertConfig(hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    stock = BertLayer(config).train()
    patched = copy.deepcopy(stock)
    tempo.patch(patched)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(4, 64, 256, generator=gen), torch.randn(4, 64, 256, generator=gen)
    rows = gradient_errors(stock, patched, x, g)
    top = max(r.reference_norm for r in rows)
    checked = 0
    for r in rows:
        if r.reference_norm < 1e-9 * top:  # key.bias: zero in exact arithmetic (softmax ignores a per-row constant)
            continue
        assert r.patched <= 3 * r.stock, r
        checked += 1
    assert checked == len(rows) - 1 == len(list(stock.parameters()))


def _small_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=512, vocab_size=200, max_position_embeddings=64,
                                     num_labels=2, attn_implementation="eager")
    return transformers.BertForSequenceClassification(config).train()


def _train(model, steps):
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # at 1e-3 the run turns chaotic
    torch.manual_seed(1)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(5, 200, (16, 32), generator=gen)
        labels = (ids[:, :16] < 60).sum(1).gt(4).long()  # more than 4 "small" tokens in the first half?
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_training_equivalence_300_steps():
    stock = _train(_small_bert(), 300)
    model = _small_bert()
    tempo.patch(model)
    ours = _train(model, 300)
    assert sum(stock[-20:]) < sum(stock[:20]) - 1.0  # it learns something: mean loss down by > 0.05
    for step, (a, b) in enumerate(zip(stock, ours)):
        assert abs(a - b) <= 1e-4 * abs(a), (step, a, b)


def test_gradients_are_autograds_and_leave_grad_untouched():
    linear = torch.nn.Linear(3, 2)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(5, 3, generator=gen), torch.randn(5, 2, generator=gen)
    grads = gradients(linear, x, g)
    assert grads.keys() == {"weight", "bias", INPUT} and all(t.dtype == torch.float64 for t in grads.values())
    assert torch.equal(grads["weight"], (g.t() @ x).double())
    assert torch.equal(grads["bias"], g.sum(0).double())
    assert torch.allclose(grads[INPUT], (g @ linear.weight.detach()).double(), rtol=1e-6, atol=0)
    assert linear.weight.grad is None and linear.bias.grad is None


def test_gradients_seed_dropout_alike_in_float64():
    model = torch.nn.Sequential(torch.nn.Dropout(0.5), torch.nn.Linear(64, 64)).train()
    x, g = torch.randn(8, 64), torch.randn(8, 64)
    single, double = gradients(model, x, g), gradients(copy.deepcopy(model).double(), x, g)
    dropped = single[INPUT] == 0  # the same mask: the same input gradients vanish
    assert 100 < int(dropped.sum()) < 412 and torch.equal(dropped, double[INPUT] == 0)
