"""nn.record_attention: P and dL/dP of every attention module of any model, checked against a
manual numpy computation and against torch's gradient with respect to the attention weights;
recording changes neither the outputs nor the parameter gradients."""
import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import Tensor, backend, no_grad
from npformer import nn
from npformer.models import CausalLM, EncoderClassifier, Seq2SeqTransformer

E, H = 8, 2


def softmax(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def small_attention(rng):
    """A float64 MultiheadAttention(8, 2) with random biases, a query (2, 3, 8), memory (2, 4, 8),
    a key padding mask hiding the last key of the second sequence, and an upstream gradient."""
    npformer.manual_seed(0)
    mha = nn.MultiheadAttention(E, H).double()
    for p in mha.parameters():
        p.data[...] = rng.standard_normal(p.shape) * 0.5
    query, memory = rng.standard_normal((2, 3, E)), rng.standard_normal((2, 4, E))
    padding = np.array([[False] * 4, [False, False, False, True]])
    return mha, query, memory, padding, rng.standard_normal((2, 3, E))


def test_p_and_dl_dp_equal_a_manual_computation_and_torch(rng, torch):
    mha, query, memory, padding, g = small_attention(rng)
    with nn.record_attention(mha) as recorder:
        out, _ = mha(Tensor(query), Tensor(memory), Tensor(memory), key_padding_mask=padding, need_weights=False)
        (out * Tensor(g)).sum().backward()
    (record,) = recorder
    assert record.name == "" and record.weights.shape == record.grad.shape == (2, H, 3, 4)

    # numpy: q/k/v heads, P = softmax(q k^T / sqrt(hd) + mask), out = (P v) W_o^T + b_o
    W, b = mha.in_proj_weight.data, mha.in_proj_bias.data
    hd = E // H

    def heads(x):                                                       # (B, L, E) -> (B, H, L, hd)
        return x.reshape(x.shape[0], x.shape[1], H, hd).transpose(0, 2, 1, 3)
    q = heads(query @ W[:E].T + b[:E])
    k, v = heads(memory @ W[E:2 * E].T + b[E:2 * E]), heads(memory @ W[2 * E:].T + b[2 * E:])
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd) + np.where(padding, -np.inf, 0.0)[:, None, None, :]
    P = softmax(scores)
    # out = O W_o^T + b_o  ->  dO = g W_o; O = P v  ->  dL/dP = dO v^T (per head)
    dO = heads(g @ mha.out_proj.weight.data)
    dP = dO @ v.transpose(0, 1, 3, 2)
    scale = np.abs(g).max() * np.abs(v).max() * hd
    np.testing.assert_allclose(record.weights.numpy(), P, rtol=0, atol=1e-14)
    np.testing.assert_allclose(record.grad, dP, rtol=0, atol=1e-14 * scale)

    # torch: the same attention written with its ops, P kept with retain_grad
    T = torch.tensor
    qt, kt, vt = T(q, requires_grad=True), T(k), T(v)
    mask = T(np.where(padding, -np.inf, 0.0))[:, None, None, :]
    Pt = torch.softmax(qt @ kt.transpose(-1, -2) / hd ** 0.5 + mask, -1)
    Pt.retain_grad()
    Ot = (Pt @ vt).transpose(1, 2).reshape(2, 3, E)
    (torch.nn.functional.linear(Ot, T(mha.out_proj.weight.data), T(mha.out_proj.bias.data)) * T(g)).sum().backward()
    np.testing.assert_allclose(record.grad, Pt.grad.numpy(), rtol=0, atol=1e-14 * scale)
    assert np.abs(record.grad[1, :, :, 3]).max() > 0  # the gradient reaches a padded key; P there is 0
    assert (record.weights.numpy()[1, :, :, 3] == 0).all()


def test_recording_changes_neither_outputs_nor_parameter_gradients(rng, device):
    mha, query, memory, padding, g = small_attention(rng)
    mha.to(device)

    def run(record):
        mha.zero_grad()
        x, m = Tensor(query, requires_grad=True, device=device), Tensor(memory, device=device)
        if record:
            with nn.record_attention(mha) as recorder:
                out, weights = mha(x, m, m, key_padding_mask=padding)
        else:
            out, weights = mha(x, m, m, key_padding_mask=padding)
        (out * Tensor(g, device=device)).sum().backward()
        if record:
            assert backend.device_of(recorder[""].grad) == device
        arrays = [out.data, weights.data, x.grad.data] + [p.grad.data for p in mha.parameters()]
        return [backend.as_numpy(a) for a in arrays]

    for plain, recorded in zip(run(False), run(True)):
        np.testing.assert_allclose(recorded, plain, rtol=1e-12, atol=1e-13 * np.abs(plain).max())
    assert not mha.hooks_active and "recording_attention" not in mha.__dict__


def seq2seq():
    return Seq2SeqTransformer(11, 13, d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=1,
                              dim_feedforward=16, dropout=0.2, pad_idx=0)


def causal_lm():
    return CausalLM(11, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, dropout=0.2, max_len=8)


def classifier():
    return EncoderClassifier(11, 3, d_model=8, nhead=2, num_layers=2, dim_feedforward=16, dropout=0.2, pad_idx=0)


SRC = np.array([[3, 4, 5, 6], [7, 8, 9, 0]])
TGT = np.array([[1, 5, 6], [1, 7, 8]])
MODELS = {
    "seq2seq": (seq2seq, lambda m: F.cross_entropy(m(SRC, TGT).reshape(-1, 13), TGT.reshape(-1)),
                {"transformer.encoder.layers.0.self_attn": (2, 2, 4, 4), "transformer.encoder.layers.1.self_attn":
                 (2, 2, 4, 4), "transformer.decoder.layers.0.self_attn": (2, 2, 3, 3),
                 "transformer.decoder.layers.0.multihead_attn": (2, 2, 3, 4)}),
    "causal_lm": (causal_lm, lambda m: F.cross_entropy(m(SRC[:, :-1]).reshape(-1, 11), SRC[:, 1:].reshape(-1)),
                  {"encoder.layers.0.self_attn": (2, 2, 3, 3), "encoder.layers.1.self_attn": (2, 2, 3, 3)}),
    "classifier": (classifier, lambda m: F.cross_entropy(m(SRC), np.array([0, 2])),
                   {"encoder.layers.0.self_attn": (2, 2, 4, 4), "encoder.layers.1.self_attn": (2, 2, 4, 4)}),
}


@pytest.mark.parametrize("kind", MODELS)
def test_every_attention_of_a_model_in_training_mode(kind):
    """Every layer and head of each kind of model, with dropout on: the same loss and gradients as
    without recording (the same dropout masks), and a nonzero dL/dP for every module."""
    build, loss_of, shapes = MODELS[kind]
    npformer.manual_seed(0)
    model = build()
    results = []
    for record in (False, True):
        npformer.manual_seed(1)
        model.zero_grad()
        if record:
            with nn.record_attention(model) as recorder:
                loss = loss_of(model)
                loss.backward()
        else:
            loss = loss_of(model)
            loss.backward()
        results.append([loss.item()] + [p.grad.numpy().copy() for p in model.parameters()])
    for plain, recorded in zip(*results):
        np.testing.assert_allclose(recorded, plain, rtol=1e-5, atol=1e-6 * np.abs(plain).max())
    assert recorder.names() == list(shapes)
    for name, shape in shapes.items():
        record = recorder[name]
        assert record.weights.shape == record.grad.shape == shape
        assert np.abs(record.grad).max() > 0
        np.testing.assert_allclose(record.weights.numpy().sum(-1), 1, rtol=0, atol=1e-6)


def test_records_of_decoding_and_of_no_grad():
    npformer.manual_seed(0)
    model = seq2seq().eval()
    with no_grad(), nn.record_attention(model) as recorder:
        cache = model.init_cache(model.encode(SRC))
        for token in ([1, 1], [5, 7]):
            model.decode_step(np.array(token), cache)
    cross = recorder.all("transformer.decoder.layers.0.multihead_attn")
    assert [r.weights.shape for r in cross] == [(2, 2, 1, 4)] * 2 and cross[0].grad is None
    assert [r.weights.shape for r in recorder.all("transformer.decoder.layers.0.self_attn")] == [(2, 2, 1, 1),
                                                                                               (2, 2, 1, 2)]
    with pytest.raises(KeyError, match="ran 2 times while recording; use recorder.all"):
        recorder["transformer.decoder.layers.0.self_attn"]
    with pytest.raises(KeyError, match="no such attention call; recorded: "):
        recorder["decoder"]


def test_recording_is_undone_after_an_error_and_cannot_nest():
    model = causal_lm()
    with pytest.raises(ValueError, match="positions but max_len"):
        with nn.record_attention(model):
            model(np.ones((1, 9), int))
    attention = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    assert not any(m.hooks_active or "recording_attention" in m.__dict__ for m in attention)
    with nn.record_attention(model):
        with pytest.raises(RuntimeError, match="already recording"):
            with nn.record_attention(model):
                pass
    with pytest.raises(ValueError, match="has no MultiheadAttention"):
        nn.record_attention(nn.Linear(2, 2))


def test_only_the_thread_that_opened_the_block_records(rng):
    """Recording is per thread, like grad mode: another thread using the model meanwhile runs
    the usual path and adds nothing to the recorder."""
    import threading

    mha, query, memory, padding, _ = small_attention(rng)
    x, m = Tensor(query), Tensor(memory)
    plain = mha(x, m, m, key_padding_mask=padding)[0].numpy()
    seen = {}

    def other_thread():
        seen["out"] = mha(x, m, m, key_padding_mask=padding)[0].numpy()
    with nn.record_attention(mha) as recorder:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert len(recorder) == 0
        mha(x, m, m, key_padding_mask=padding)
    assert len(recorder) == 1
    np.testing.assert_array_equal(seen["out"], plain)
