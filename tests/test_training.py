"""Trainer: reproducibility, exact resumption from a checkpoint, learning, history, and
rebuilding a model from a checkpoint alone."""
import numpy as np
import pytest

import npformer
from autograd import manual_seed
from npformer import optim
from npformer.data import PAD, SequenceTask
from npformer.models import Seq2SeqTransformer
from npformer.training import Trainer, layer_of


def _trainer(seed=0, steps=8, model_seed=None, **kwargs):
    manual_seed(seed if model_seed is None else model_seed)
    model = Seq2SeqTransformer(12, 12, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, dropout=0.1, pad_idx=PAD)
    task = SequenceTask("reverse", vocab_size=12, min_len=2, max_len=6, seed=seed, heldout_size=50)
    opt = optim.AdamW(model.parameters(), lr=3e-3)
    sched = optim.WarmupCosineLR(opt, warmup_steps=3, total_steps=steps)
    return Trainer(model, opt, task, scheduler=sched, batch_size=16, label_smoothing=0.1, progress=False,
                   grad_norm_every=2, **kwargs)


def test_same_seed_same_losses():
    a = _trainer()
    a.fit(6)
    b = _trainer()  # dropout draws from the global generator: seeding it again replays the run
    b.fit(6)
    assert a.history["loss"] == b.history["loss"]
    c = _trainer(seed=1)
    c.fit(6)
    assert c.history["loss"] != a.history["loss"]


def test_resume_continues_bit_for_bit(tmp_path):
    full = _trainer()
    full.fit(8)
    first = _trainer()
    first.fit(4)
    first.save(tmp_path / "ck.npz")
    resumed = _trainer(model_seed=5)  # as in a new process: other weights, random and data streams
    resumed.task.batch(3)
    resumed.resume(tmp_path / "ck.npz")
    assert resumed.step == 4
    resumed.fit(8)
    assert resumed.history["loss"] == full.history["loss"]  # bit for bit, steps 1..8
    assert resumed.history["lr"] == full.history["lr"]


def test_resume_refuses_another_task(tmp_path):
    first = _trainer()
    first.fit(1)
    first.save(tmp_path / "ck.npz")
    with pytest.raises(ValueError, match="seed"):
        _trainer(seed=1).resume(tmp_path / "ck.npz")


def test_history_evaluation_and_clipping():
    trainer = _trainer(eval_every=3, clip_norm=0.5, eval_size=20)
    result = trainer.fit(6)
    h = trainer.history
    assert h["step"] == list(range(1, 7)) and len(h["loss"]) == len(h["lr"]) == len(h["accuracy"]) == 6
    assert h["eval_step"] == [3, 6] and set(result) == {"exact_match", "token_accuracy", "sequences"}
    assert result["sequences"] == 50 and 0 <= result["exact_match"] <= result["token_accuracy"] <= 1
    assert h["layer_grad_norm_step"] == [2, 4, 6]
    assert set(h["layer_grad_norm"]) >= {"src_embed", "tgt_embed", "generator", "transformer.encoder.layers.0",
                                         "transformer.decoder.layers.0"}
    assert all(len(v) == 3 and all(n > 0 for n in v) for v in h["layer_grad_norm"].values())
    # the per-layer norms combine into the total that clipping saw (same step, before clipping)
    per_layer = np.array([v[0] for v in h["layer_grad_norm"].values()])
    assert np.sqrt((per_layer ** 2).sum()) == pytest.approx(h["grad_norm"][1], rel=1e-5)
    assert h["lr"][0] == pytest.approx(3e-3 / 3)


def test_a_short_run_learns_to_copy():
    manual_seed(0)
    model = Seq2SeqTransformer(10, 10, d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=64, dropout=0.0, pad_idx=PAD)
    task = SequenceTask("copy", vocab_size=10, min_len=3, max_len=3, seed=0, heldout_size=50)
    trainer = Trainer(model, optim.Adam(model.parameters(), lr=1e-2), task, batch_size=32, progress=False)
    result = trainer.fit(60)
    assert np.mean(trainer.history["loss"][-5:]) < 0.5 * np.mean(trainer.history["loss"][:5])
    assert result["token_accuracy"] > 0.5


def test_model_rebuilt_from_the_checkpoint_alone(tmp_path):
    trainer = _trainer()
    trainer.fit(2)
    trainer.save(tmp_path / "ck.npz")
    model, ckpt = npformer.load_model(tmp_path / "ck.npz")
    assert ckpt["config"] == trainer.model.config and ckpt["step"] == 2
    src, tgt = np.array([[3, 4, 5, 0]]), np.array([[1, 5, 4, 3]])
    trainer.model.eval()
    np.testing.assert_array_equal(model(src, tgt).numpy(), trainer.model(src, tgt).numpy())


def test_layer_of():
    assert layer_of("transformer.encoder.layers.1.self_attn.in_proj_weight") == "transformer.encoder.layers.1"
    assert layer_of("transformer.decoder.norm.weight") == "transformer.decoder.norm"
    assert layer_of("src_embed.weight") == "src_embed"
    assert layer_of("bias") == "bias"
