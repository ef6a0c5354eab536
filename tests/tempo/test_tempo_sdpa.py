"""tempo on Hugging Face's default attention, "sdpa": taken over on CPU in training with dropout, where
SDPA keeps what eager attention keeps, with the forward, RNG use and gradients of the eager model
(patched, and stock where tempo's eager path is stock's bit for bit); left to SDPA, with the measured
reason, where SDPA's kernel keeps less. Models from configs, random init, no downloads.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import tempo  # noqa: E402
from tempo.bits import packed_size  # noqa: E402
from tempo.sdpa import PROBE_BATCH, PROBE_HEAD_DIM, PROBE_HEADS, PROBE_LENGTH, compare  # noqa: E402

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             vocab_size=101, max_position_embeddings=72)


def _build(name, implementation, **overrides):
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(**{**SMALL, **overrides}, attn_implementation=implementation)
        return transformers.BertForSequenceClassification(config).train()
    if name == "roberta":
        config = transformers.RobertaConfig(**{**SMALL, **overrides}, attn_implementation=implementation)
        return transformers.RobertaForMaskedLM(config).train()
    config = transformers.GPT2Config(**{"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 101,
                                        "n_positions": 64, **overrides}, attn_implementation=implementation)
    return transformers.GPT2LMHeadModel(config).train()


def _batch(name, padded=True):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 101, (3, 20), generator=gen)
    batch = {"input_ids": ids}
    if padded:  # sdpa gets a boolean mask, eager an additive one
        mask = torch.ones(3, 20, dtype=torch.long)
        mask[1, 15:] = 0
        batch["attention_mask"] = mask
    batch["labels"] = torch.tensor([0, 1, 1]) if name == "bert" else ids
    return batch


def _step(model, batch, seed=2):
    """(logits, every gradient, the RNG state the step left)"""
    torch.manual_seed(seed)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.logits.detach(), grads, torch.get_rng_state()


def _assert_bit_identical(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert torch.equal(a[2], b[2])  # dropout drew exactly the same numbers


def _attention_swaps(report):
    return [s for s in report.swapped if s.technique == "attention"]


@pytest.mark.parametrize("name, padded", [("bert", True), ("bert", False), ("roberta", True), ("gpt2", True),
                                          ("gpt2", False)])
def test_sdpa_model_bit_identical_to_patched_eager_model(name, padded):
    """Forward, RNG and every gradient of a patched sdpa model are the patched eager model's, with padding
    (a boolean mask becomes eager's additive one) and without (GPT-2: eager's causal mask)."""
    eager, sdpa = _build(name, "eager"), _build(name, "sdpa")
    report_eager, report_sdpa = tempo.patch(eager), tempo.patch(sdpa)
    assert report_sdpa.counts() == report_eager.counts() and report_sdpa.left == []
    notes = [s.note for s in _attention_swaps(report_sdpa) if s.note]
    assert len(notes) == 2 and all(n.startswith("sdpa: tempo's path in training with dropout") for n in notes)
    assert sdpa.config._attn_implementation == "sdpa"  # the shared config is not changed
    batch = _batch(name, padded)
    _assert_bit_identical(_step(eager, batch), _step(sdpa, batch))


@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2"])
def test_sdpa_attention_alone_bit_identical_to_stock_eager(name):
    """With only attention patched, tempo's path runs stock eager's ops on the same values."""
    stock, sdpa = _build(name, "eager"), _build(name, "sdpa")
    report = tempo.patch(sdpa, gelu=False, layernorm=False, dropout=False)
    assert len(_attention_swaps(report)) == 4  # 2 attentions, 2 projections
    batch = _batch(name)
    _assert_bit_identical(_step(stock, batch), _step(sdpa, batch))


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_sdpa_model_close_to_stock_sdpa(name):
    """Against stock SDPA, tempo's path differs by SDPA's rounding only (its math kernel scales Q and K by
    sqrt(scaling) each; head dim 8 makes that inexact), and draws the same random numbers."""
    overrides = {"num_attention_heads": 8} if name == "bert" else {"n_head": 8}
    stock, sdpa = _build(name, "sdpa", **overrides), _build(name, "sdpa", **overrides)
    tempo.patch(sdpa, gelu=False, layernorm=False, dropout=False)
    batch = _batch(name)
    logits_s, grads_s, rng_s = _step(stock, batch)
    logits_p, grads_p, rng_p = _step(sdpa, batch)
    assert torch.equal(rng_s, rng_p)
    assert (logits_p - logits_s).abs().max() <= 1e-5 * logits_s.abs().max()
    scale = max(g.norm() for g in grads_s.values())
    for key in grads_s:
        assert (grads_p[key] - grads_s[key]).norm() <= 1e-4 * max(grads_s[key].norm(), 1e-3 * scale), key


def test_sdpa_bfloat16_model_bit_identical_to_patched_eager():
    eager, sdpa = _build("bert", "eager").to(torch.bfloat16), _build("bert", "sdpa").to(torch.bfloat16)
    tempo.patch(eager)
    assert len(_attention_swaps(tempo.patch(sdpa))) == 4
    batch = _batch("bert")
    _assert_bit_identical(_step(eager, batch), _step(sdpa, batch))


def test_probe_measures_what_each_keeps_on_cpu():
    """The decision's figures, from saved-tensor hooks on the probe (per head, S x S scores, head dim D, float32):
    with dropout SDPA's math kernel keeps Q and K scaled, V, P, a float mask, dropout(P), and the projection
    keeps the context; tempo keeps Q, K, V, P and 1 bit per score. Without dropout SDPA's fused CPU kernel
    keeps Q, K, V, the output and a log-sum-exp per row; tempo's path is then eager's, which keeps P."""
    heads, s, d = PROBE_BATCH * PROBE_HEADS, PROBE_LENGTH, PROBE_HEAD_DIM
    dropped = compare("cpu", torch.float32, 0.1)
    assert dropped.sdpa_bytes == heads * 4 * (3 * s * d + 3 * s * s + s * d)
    assert dropped.tempo_bytes == heads * 4 * (3 * s * d + s * s) + packed_size(heads * s * s)
    assert dropped.tempo_keeps_less
    for mask, causal in [("bool", False), ("float", False), ("none", True)]:
        assert compare("cpu", torch.float32, 0.1, mask, causal).tempo_keeps_less
    plain = compare("cpu", torch.float32, 0.0)
    assert plain.sdpa_bytes == heads * 4 * (4 * s * d + s + s * d)
    assert plain.tempo_bytes == heads * 4 * (3 * s * d + s * s + s * d)
    assert not plain.tempo_keeps_less


def test_probe_leaves_rng_and_callers_hooks_alone():
    seen = []
    state = torch.get_rng_state()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        comparison = compare("cpu", torch.float32, 0.375, "bool")  # a key no other test uses: measured now
    assert comparison.tempo_keeps_less and seen == []
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_dropout_zero_is_left_to_sdpa_with_the_measured_reason(name):
    overrides = {"attention_probs_dropout_prob": 0.0} if name == "bert" else {"attn_pdrop": 0.0}
    model = _build(name, "sdpa", **overrides)
    report = tempo.patch(model)
    assert _attention_swaps(report) == []  # nor the projections after them
    reasons = {m.reason for m in report.left if m.type_name in ("BertSelfAttention", "GPT2Attention")}
    causal = name == "gpt2"
    assert reasons == {f"attention implementation 'sdpa', without dropout SDPA runs a fused kernel: measured "
                       f"{compare('cpu', torch.float32, 0.0, 'none', causal)}; left to SDPA"}
    assert "SDPA keeps 21.0 KiB for backward and tempo 144.0 KiB" in reasons.pop()


def test_eval_and_dropout_zero_at_call_time_run_sdpa():
    """A module taken over runs SDPA itself when a call has no dropout: in eval (with or without grad),
    or its dropout set to 0 after patching: the outputs and the bytes kept are stock SDPA's."""
    stock, sdpa = _build("bert", "sdpa").eval(), _build("bert", "sdpa").eval()
    report = tempo.patch(sdpa, gelu=False, layernorm=False, dropout=False)
    assert all(s.note.endswith("(in eval mode now: SDPA until model.train())") for s in _attention_swaps(report)
               if s.note)
    batch = _batch("bert")
    with torch.no_grad():
        assert torch.equal(stock(**batch).logits, sdpa(**batch).logits)
    before, after = tempo.measure(stock, batch), tempo.measure(sdpa, batch)
    assert after.by_path() == before.by_path()
    stock.train(), sdpa.train()
    for model in (stock, sdpa):
        for layer in model.bert.encoder.layer:
            layer.attention.self.dropout.p = 0.0
    _assert_bit_identical(_step(stock, batch), _step(sdpa, batch))
    torch.manual_seed(2)
    before = tempo.measure(stock, batch)
    torch.manual_seed(2)
    after = tempo.measure(sdpa, batch)
    assert after.by_path() == before.by_path()


def test_sdpa_registered_to_another_function_is_left():
    calls = []

    def own(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("sdpa", own)
    try:
        model = _build("bert", "sdpa")
        report = tempo.patch(model)
        assert _attention_swaps(report) == []
        assert {m.reason for m in report.left if m.type_name == "BertSelfAttention"} == {
            "'sdpa' is registered to a function other than transformers' own: left to it"}
        model(**_batch("bert"))
        assert len(calls) == 2
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)


def test_gpt2_upcast_attention_is_left_under_sdpa_too():
    model = _build("gpt2", "sdpa", reorder_and_upcast_attn=True)
    report = tempo.patch(model)
    assert [m.reason for m in report.left if m.type_name == "GPT2Attention"] == [
        "reorder_and_upcast_attn=True (its own upcast attention path): left as is"] * 2
    assert _attention_swaps(report) == []


def test_other_implementations_are_left_with_the_reason():
    AttentionInterface.register("tempo-test-own", sdpa_attention_forward)
    model = _build("bert", "tempo-test-own")
    report = tempo.patch(model)
    assert _attention_swaps(report) == []
    assert {m.reason for m in report.left if m.type_name == "BertSelfAttention"} == {
        "attention implementation 'tempo-test-own': tempo takes over eager and sdpa attention only "
        "(flash and flex kernels keep no S x S tensor)"}


def test_implementation_switched_after_patching_is_followed():
    """The patched module reads the model's implementation at each call: eager -> sdpa is taken over
    (the eager model's results), and any other implementation runs untouched."""
    stock, patched = _build("bert", "eager"), _build("bert", "eager")
    tempo.patch(patched)
    batch = _batch("bert")
    expected = _step(patched, batch)
    patched.set_attn_implementation("sdpa")
    _assert_bit_identical(expected, _step(patched, batch))
    calls = []

    def own(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("tempo-test-counting", own)
    for model in (stock, patched):
        model.set_attn_implementation("tempo-test-counting")
    assert torch.equal(_step(stock, batch)[0], _step(patched, batch)[0])
    assert len(calls) == 4


def test_bert_decoder_with_cross_attention_bit_identical_to_patched_eager():
    """A causal BERT self-attention (sdpa gets no mask: eager's causal one is built) and cross-attention
    with a padded encoder mask."""
    def build(implementation):
        torch.manual_seed(0)
        config = transformers.BertConfig(**SMALL, is_decoder=True, add_cross_attention=True,
                                         attn_implementation=implementation)
        return transformers.BertLMHeadModel(config).train()

    gen = torch.Generator().manual_seed(1)
    ids, encoded = torch.randint(3, 101, (3, 12), generator=gen), torch.randn(3, 9, 64, generator=gen)
    encoder_mask = torch.ones(3, 9, dtype=torch.long)
    encoder_mask[1, 6:] = 0
    batch = {"input_ids": ids, "encoder_hidden_states": encoded, "encoder_attention_mask": encoder_mask,
             "labels": ids, "use_cache": False}
    eager, sdpa = build("eager"), build("sdpa")
    tempo.patch(eager)
    report = tempo.patch(sdpa)
    assert report.counts()["attention"] == 8 and report.left == []  # 2 self, 2 cross, 4 projections
    _assert_bit_identical(_step(eager, batch), _step(sdpa, batch))
