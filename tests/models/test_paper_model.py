"""The paper's model (Table 3's base Transformer with one embedding matrix shared by source,
target and the pre-softmax projection): Seq2SeqTransformer(..., share_embeddings=True), its
parameter count as docs/paper_model.md adds it up, the old tie_weights="all" spelling,
gradients of the shared matrix against torch, torch interop, checkpoints and safetensors."""
import json

import numpy as np
import pytest

import npformer
import npformer.functional as F
from autograd import Tensor
from npformer import interop, optim
from npformer.models import Seq2SeqTransformer, load_safetensors, save_safetensors

from helpers import F64, assert_torch_parity

PAD = 0


def paper_count(V, d=512, ff=2048, N=6):
    """docs/paper_model.md's sum for nn.MultiheadAttention-shaped layers (d_k = d_v = d / h)."""
    attention = 4 * d * d + 4 * d               # in_proj_weight (3d, d) + in_proj_bias (3d) + out_proj (d, d) + (d)
    feedforward = 2 * d * ff + ff + d           # linear1 (ff, d) + (ff), linear2 (d, ff) + (d)
    norm = 2 * d                                # LayerNorm weight + bias
    encoder_layer = attention + feedforward + 2 * norm
    decoder_layer = 2 * attention + feedforward + 3 * norm
    return V * d + N * (encoder_layer + decoder_layer) + 2 * norm + V  # shared matrix, layers, final norms, bias


def small(**options):
    settings = dict(src_vocab_size=11, tgt_vocab_size=11, d_model=8, nhead=2, num_encoder_layers=2,
                    num_decoder_layers=2, dim_feedforward=12, pad_idx=PAD, share_embeddings=True)
    return Seq2SeqTransformer(**{**settings, **options})


@pytest.fixture(scope="module")
def base_model():
    return Seq2SeqTransformer(37000, 37000, share_embeddings=True)


def test_base_model_count(base_model):
    """63,121,544 = 18,944,000 (shared matrix) + 18,914,304 (encoder) + 25,224,192 (decoder)
    + 2,048 (final norms) + 37,000 (generator bias): docs/paper_model.md."""
    total = sum(p.size for p in base_model.parameters())
    assert total == paper_count(37000) == 63_121_544
    assert base_model.src_embed is base_model.tgt_embed and base_model.generator.weight is None
    keys = [k for k in base_model.state_dict() if not k.startswith("transformer.")]
    assert keys == ["tgt_embed.weight", "generator.bias"]
    untied = Seq2SeqTransformer(37000, 37000, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=8)
    tied = Seq2SeqTransformer(37000, 37000, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                              dim_feedforward=8, tie_weights=True)
    shared = Seq2SeqTransformer(37000, 37000, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=8, share_embeddings=True)
    sizes = [sum(p.size for p in m.parameters()) for m in (untied, tied, shared)]
    assert sizes[0] - sizes[1] == sizes[1] - sizes[2] == 37000 * 8  # each sharing drops one matrix


@pytest.mark.parametrize("d, ff, N", [(8, 12, 1), (16, 24, 2)])
def test_count_formula_against_torch(d, ff, N, torch):
    model = Seq2SeqTransformer(13, 13, d_model=d, nhead=2, num_encoder_layers=N, num_decoder_layers=N,
                               dim_feedforward=ff, share_embeddings=True)
    theirs = interop.to_torch(model)
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.size for p in model.parameters()) \
        == paper_count(13, d, ff, N)


def test_config_normalises_the_sharing_arguments():
    assert small().config["tie_weights"] is True and small().config["share_embeddings"] is True
    old = small(share_embeddings=False, tie_weights="all")  # the older spelling still works
    assert old.config["share_embeddings"] is True and old.src_embed is old.tgt_embed
    assert list(old.state_dict()) == list(small().state_dict())
    plain = small(share_embeddings=False)
    assert plain.config["tie_weights"] is False and plain.src_embed is not plain.tgt_embed
    assert Seq2SeqTransformer(**old.config).config == old.config


@pytest.mark.parametrize("options, error, message", [
    (dict(src_vocab_size=11, tgt_vocab_size=12), ValueError, r"src_vocab_size \(11\) must equal tgt_vocab_size \(12\)"),
    (dict(tie_weights=False), ValueError, "which tie_weights=False contradicts"),
    (dict(tie_weights="some"), TypeError, "tie_weights must be True or False, got 'some'"),
    (dict(share_embeddings="yes"), TypeError, "share_embeddings must be True or False"),
])
def test_bad_sharing_arguments(options, error, message):
    with pytest.raises(error, match=message):
        small(**options)


def test_one_matrix_gets_all_three_gradients(torch, rng):
    """The shared matrix's gradient sums the source embedding's, the target embedding's and the
    generator's, as in the torch composition (one tensor used three times)."""
    model = small(dropout=0.0).double()
    src = rng.integers(1, 11, size=(2, 5))
    src[1, 3:] = PAD
    tgt = rng.integers(1, 11, size=(2, 4))
    ids = [src, tgt]

    def ours(m, x):
        return m(*ids) * x

    def theirs(t, x):
        return t(*(torch.tensor(a) for a in ids)) * x
    assert_torch_parity(torch, model, ours, theirs, [np.ones((1, 1, 11))], **F64)
    each = {}
    for part in ("src", "tgt", "generator"):  # the gradient of each use, alone
        model.zero_grad()
        hidden = Tensor(rng.standard_normal((2, 4, 8)))
        loss = {"src": lambda: model.encode(src).sum(), "tgt": lambda: model.decode(tgt, hidden).sum(),
                "generator": lambda: model.project(hidden).sum()}[part]()
        loss.backward()
        each[part] = model.tgt_embed.weight.grad.numpy().copy()
    assert all(np.abs(g).max() > 0 for g in each.values())


def test_torch_round_trip_keeps_the_sharing(torch, rng):
    model = small(dropout=0.0).eval()
    theirs = interop.to_torch(model)
    assert theirs.config == model.config and not hasattr(theirs, "src_embed")
    back = interop.from_torch(theirs)
    assert back.src_embed is back.tgt_embed and back.config == model.config
    src, tgt = rng.integers(1, 11, size=(2, 5)), rng.integers(1, 11, size=(2, 4))
    np.testing.assert_array_equal(back(src, tgt).numpy(), model(src, tgt).numpy())
    np.testing.assert_allclose(theirs(torch.tensor(src), torch.tensor(tgt)).detach().numpy(),
                               model(src, tgt).numpy(), atol=1e-5)


def test_checkpoint_round_trip_keeps_the_sharing(tmp_path, rng):
    model = small()
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    src, tgt = rng.integers(1, 11, size=(2, 5)), rng.integers(1, 11, size=(2, 4))
    F.cross_entropy(model(src, tgt).reshape(-1, 11), tgt.reshape(-1)).backward()
    optimizer.step()
    path = tmp_path / "paper.npz"
    npformer.save_checkpoint(path, model, optimizer)
    loaded, _ = npformer.load_model(path)
    assert loaded.src_embed is loaded.tgt_embed and loaded.config == model.config
    np.testing.assert_array_equal(loaded.eval()(src, tgt).numpy(), model.eval()(src, tgt).numpy())
    resumed = optim.Adam(loaded.parameters(), lr=1e-3)
    state = npformer.load_checkpoint(path, loaded, resumed)
    assert state["config"] == model.config


def test_checkpoint_written_with_the_old_spelling_loads(tmp_path, rng):
    """A file whose config says tie_weights="all" (and has no share_embeddings) rebuilds shared."""
    model = small()
    path = tmp_path / "old.npz"
    npformer.save_checkpoint(path, model)
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays["meta"]))
    config = meta["config"]
    del config["share_embeddings"]
    config["tie_weights"] = "all"
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(path, **arrays)
    loaded, _ = npformer.load_model(path)
    assert loaded.src_embed is loaded.tgt_embed and loaded.config == model.config
    src, tgt = rng.integers(1, 11, size=(2, 5)), rng.integers(1, 11, size=(2, 4))
    np.testing.assert_array_equal(loaded.eval()(src, tgt).numpy(), model.eval()(src, tgt).numpy())


def test_safetensors_round_trip_keeps_the_sharing(tmp_path, safetensors, rng):
    model = small()
    save_safetensors(model, tmp_path / "paper.safetensors")
    loaded = load_safetensors(tmp_path / "paper.safetensors")
    assert loaded.src_embed is loaded.tgt_embed and loaded.config == model.config
    src, tgt = rng.integers(1, 11, size=(2, 5)), rng.integers(1, 11, size=(2, 4))
    np.testing.assert_array_equal(loaded.eval()(src, tgt).numpy(), model.eval()(src, tgt).numpy())
