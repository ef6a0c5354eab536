"""tempo.patch on Hugging Face BERT / RoBERTa / GPT-2 built from configs (random init, no downloads)."""
import io
import pickle

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from torch import nn  # noqa: E402

import tempo  # noqa: E402

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             vocab_size=101, max_position_embeddings=72)


def bert(**overrides):
    config = transformers.BertConfig(**{**SMALL, "attn_implementation": "eager", **overrides})
    return transformers.BertForSequenceClassification(config)


def roberta(**overrides):
    config = transformers.RobertaConfig(**{**SMALL, "attn_implementation": "eager", **overrides})
    return transformers.RobertaForMaskedLM(config)


def gpt2(**overrides):
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=64,
                                     attn_implementation="eager", **overrides)
    return transformers.GPT2LMHeadModel(config)


BUILDERS = {"bert": bert, "roberta": roberta, "gpt2": gpt2}


def _model(name, **overrides):
    torch.manual_seed(0)
    return BUILDERS[name](**overrides).train()


def _batch(name):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 101, (3, 20), generator=gen)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 15:] = 0  # padding: masked attention scores
    batch = {"input_ids": ids, "attention_mask": mask}
    batch["labels"] = torch.tensor([0, 1, 1]) if name == "bert" else ids
    return batch


def _loss_and_grads(model, batch, seed=2):
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.logits.detach(), grads


def _state_bytes(model):
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getvalue()


def _count(model, cls):
    return sum(type(m) is cls for m in model.modules())


@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2"])
def test_swaps_everything_in_eager_models(name):
    model = _model(name)
    expected = {
        "layernorm": _count(model, nn.LayerNorm),
        "dropout": _count(model, nn.Dropout),
        "gelu": 2,
        "attention": 4,  # 2 attentions and the 2 projections after them
    }
    report = tempo.patch(model)
    assert report.counts() == expected
    assert report.left == []


@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2"])
def test_state_dict_byte_identical_and_config_untouched(name):
    model = _model(name)
    before = _state_bytes(model)
    config_before = model.config.to_dict()
    tempo.patch(model)
    assert _state_bytes(model) == before
    assert model.config.to_dict() == config_before
    assert model.config._attn_implementation == "eager"
    tempo.unpatch(model)
    assert _state_bytes(model) == before


@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2"])
def test_training_forward_bit_identical_gradients_close(name):
    stock, patched = _model(name), _model(name)
    tempo.patch(patched)
    batch = _batch(name)
    logits_s, grads_s = _loss_and_grads(stock, batch)
    rng_s = torch.get_rng_state()
    logits_p, grads_p = _loss_and_grads(patched, batch)
    assert torch.equal(logits_s, logits_p)
    assert torch.equal(torch.get_rng_state(), rng_s)  # dropout drew exactly as many numbers as stock's
    assert grads_s.keys() == grads_p.keys()
    scale = max(g.norm() for g in grads_s.values())
    for key in grads_s:
        assert (grads_p[key] - grads_s[key]).norm() <= 1e-5 * max(grads_s[key].norm(), 1e-3 * scale), key


@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2"])
def test_attention_alone_bit_identical_gradients(name):
    """The fused attention and the projection rebuilding its context run stock's ops on the same values:
    forward, RNG and every gradient bit for bit."""
    stock, patched = _model(name), _model(name)
    report = tempo.patch(patched, gelu=False, layernorm=False, dropout=False)
    projection = {"gpt2": "attn.c_proj", "bert": "attention.output.dense", "roberta": "attention.output.dense"}[name]
    assert [s.after for s in report.swapped if s.path.endswith(projection)] == [
        "TempoContextConv1D" if name == "gpt2" else "TempoContextLinear"] * 2
    batch = _batch(name)
    logits_s, grads_s = _loss_and_grads(stock, batch)
    rng_s = torch.get_rng_state()
    logits_p, grads_p = _loss_and_grads(patched, batch)
    assert torch.equal(logits_s, logits_p) and torch.equal(torch.get_rng_state(), rng_s)
    assert grads_s.keys() == grads_p.keys()
    assert all(torch.equal(grads_s[key], grads_p[key]) for key in grads_s)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_eval_identical_and_deterministic(name):
    stock, patched = _model(name).eval(), _model(name).eval()
    tempo.patch(patched)
    batch = _batch(name)
    with torch.no_grad():
        assert torch.equal(stock(**batch).logits, patched(**batch).logits)
        assert torch.equal(patched(**batch).logits, patched(**batch).logits)
    # eval with grad (e.g. input attributions): still no dropout
    a = patched(**batch).logits
    assert torch.equal(a, stock(**batch).logits)


def test_unpatch_round_trip_restores_classes_and_config():
    model = _model("bert")
    classes = [type(m) for m in model.modules()]
    attention = model.bert.encoder.layer[0].attention.self
    tempo.patch(model)
    assert attention.config is not model.config  # a view while patched...
    assert attention.config.hidden_size == 64 and attention.config._attn_implementation == "tempo"
    tempo.unpatch(model)
    assert [type(m) for m in model.modules()] == classes
    assert attention.config is model.config  # ...the shared config itself afterwards


def test_gpt2_upcast_attention_is_left():
    model = _model("gpt2", reorder_and_upcast_attn=True)
    report = tempo.patch(model)
    assert [m.reason for m in report.left if m.type_name == "GPT2Attention"] == [
        "reorder_and_upcast_attn=True (its own upcast attention path): left as is"] * 2
    assert "attention" not in report.counts()  # nor the projections after them


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_measured_savings(name):
    stock, patched = _model(name), _model(name)
    tempo.patch(patched)
    batch = _batch(name)
    before, after = tempo.measure(stock, batch), tempo.measure(patched, batch)
    assert after.total_bytes < 0.75 * before.total_bytes
    gelu_type = {"bert": "TempoGELUActivation", "gpt2": "TempoNewGELUActivation"}[name]
    tokens, inner = 3 * 20, 128 if name == "bert" else 256
    # each GELU keeps its float32 output, 1 bit per element and 8 bytes per element stashed near x*
    stashed = after.by_type()[gelu_type] - 2 * (tokens * inner * 4 + tokens * inner // 8)
    assert stashed % 8 == 0 and 0 <= stashed // 8 <= 0.02 * 2 * tokens * inner


def test_patched_model_pickles():
    model = _model("gpt2")
    tempo.patch(model)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone.transformer.h[0].attn).__name__ == "TempoGPT2Attention"
    batch = _batch("gpt2")
    assert torch.equal(_loss_and_grads(model, batch)[0], _loss_and_grads(clone, batch)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_models(dtype):
    stock, patched = _model("bert").to(dtype), _model("bert").to(dtype)
    tempo.patch(patched)
    batch = _batch("bert")
    logits_s, grads_s = _loss_and_grads(stock, batch)
    logits_p, grads_p = _loss_and_grads(patched, batch)
    assert torch.equal(logits_s, logits_p)
    total_s = torch.cat([g.double().flatten() for g in grads_s.values()])
    total_p = torch.cat([g.double().flatten() for g in grads_p.values()])
    assert torch.isfinite(total_p).all()
    assert (total_p - total_s).norm() <= 0.05 * total_s.norm()


@pytest.mark.slow
def test_torch_compile_runs_patched_model_with_graph_breaks():
    """torch.compile traces around tempo's ops (bit packing in numpy, data-dependent stash): graph breaks,
    same forward bits, gradients as in eager."""
    stock, patched = _model("bert"), _model("bert")
    tempo.patch(patched)
    compiled = torch.compile(patched, backend="aot_eager")
    batch = _batch("bert")
    logits_s, grads_s = _loss_and_grads(stock, batch)
    logits_c, grads_c = _loss_and_grads(compiled, batch)
    grads_c = {name.removeprefix("_orig_mod."): grad for name, grad in grads_c.items()}
    assert torch.equal(logits_s, logits_c)
    assert grads_c.keys() == grads_s.keys()
    scale = max(g.norm() for g in grads_s.values())
    for key in grads_s:
        assert (grads_c[key] - grads_s[key]).norm() <= 1e-5 * max(grads_s[key].norm(), 1e-3 * scale), key
