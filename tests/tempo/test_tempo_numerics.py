"""Whole-layer numerics of a patched BERT: gradient error against float64 within 3x stock float32's own,
and (slow) 300 training steps whose loss matches stock's at every step."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402

import tempo  # noqa: E402


def _layer_grads(model, x, g, dtype):
    inp = x.to(dtype).clone().requires_grad_()
    torch.manual_seed(5)  # the same dropout masks in every run: bernoulli_ draws alike in any dtype
    out = model(inp)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(g.to(dtype))
    grads = {name: p.grad.double() for name, p in model.named_parameters()}
    grads["(input)"] = inp.grad.double()
    return grads


def test_gradient_error_within_3x_stock_for_every_parameter():
    config = transformers.BertConfig(hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    stock = BertLayer(config).train()
    patched = copy.deepcopy(stock)
    tempo.patch(patched)
    reference = copy.deepcopy(stock).double()
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(4, 64, 256, generator=gen), torch.randn(4, 64, 256, generator=gen)
    ref = _layer_grads(reference, x, g, torch.float64)
    ours = _layer_grads(patched, x, g, torch.float32)
    theirs = _layer_grads(stock, x, g, torch.float32)
    top = max(r.norm() for r in ref.values())
    checked = 0
    for name, r in ref.items():
        if r.norm() < 1e-9 * top:  # key.bias: zero in exact arithmetic (softmax ignores a per-row constant)
            continue
        stock_error = (theirs[name] - r).norm() / r.norm()
        our_error = (ours[name] - r).norm() / r.norm()
        assert our_error <= 3 * stock_error, (name, our_error.item(), stock_error.item())
        checked += 1
    assert checked == len(ref) - 1


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
