"""Trainer: reproducibility, exact resumption from a checkpoint, learning (seq2seq, language
modelling, classification), history, argument checks, skipped updates, progress, figures, and
rebuilding a model from a checkpoint alone. Data parallelism: test_distributed*.py."""
import io
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import npformer
from autograd import Tensor
from npformer import nn, optim
from npformer.data import PAD, RandomBatches, SequenceTask
from npformer.models import CausalLM, EncoderClassifier, Seq2SeqTransformer
from npformer.progress import Progress
from npformer.runtime import random
from npformer.runtime.random import manual_seed
from npformer.training import (Loss, Seq2SeqTrainer, Trainer, causal_lm_loss, classification_loss, evaluate_loss,
                               layer_of)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trainer(seed=0, steps=8, model_seed=None, **kwargs):
    manual_seed(seed if model_seed is None else model_seed)
    model = Seq2SeqTransformer(12, 12, d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=32, dropout=0.1, pad_idx=PAD)
    task = SequenceTask("reverse", vocab_size=12, min_len=2, max_len=6, seed=seed, heldout_size=50)
    opt = optim.AdamW(model.parameters(), lr=3e-3)
    sched = optim.WarmupCosineLR(opt, warmup_steps=3, total_steps=steps)
    return Seq2SeqTrainer(model, opt, task, scheduler=sched, batch_size=16, label_smoothing=0.1, progress=False,
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


def test_resume_refuses_another_task(tmp_path):
    first = _trainer()
    first.fit(1)
    first.save(tmp_path / "ck.npz")
    with pytest.raises(ValueError, match="seed"):
        _trainer(seed=1).resume(tmp_path / "ck.npz")


def test_a_resume_that_fails_changes_nothing(tmp_path):
    """Another task's stream or a malformed trainer entry is refused before the model, optimizer,
    scheduler, random generators or the trainer change."""
    from npformer.checkpoint import save_checkpoint
    first = _trainer()
    first.fit(2)
    first.save(tmp_path / "other_task.npz")
    state = first.state_dict()
    pcg = state["task"]["rng"]
    rank_rng = state["rank_rng"][0]
    broken = {"missing step": {k: v for k, v in state.items() if k != "step"},
              "step -1": dict(state, step=-1),
              "bad stream": dict(state, task=dict(state["task"], rng={"bit_generator": "PCG64", "state": 1})),
              # numpy's own errors (OverflowError, KeyError, AttributeError) were raised as they were
              "negative stream": dict(state, task=dict(state["task"], rng=dict(pcg, state={"state": -1, "inc": 1}))),
              "stream without state": dict(state, task=dict(state["task"], rng={"bit_generator": "PCG64"})),
              "task not a dict": dict(state, task=5),
              "task without rng": dict(state, task={"config": state["task"]["config"]}),
              "rank stream without state": dict(state, rank_rng=[dict(rank_rng, cpu={"bit_generator": "PCG64"})]),
              "rank stream of 2**200": dict(state, rank_rng=[dict(rank_rng, cpu=dict(
                  rank_rng["cpu"], state={"state": 2**200, "inc": 1}))]),
              # accepted, then train_step failed appending to it
              "history entry not a list": dict(state, history=dict(state["history"], loss=5)),
              "history without a layer": dict(state, history=dict(state["history"], layer_grad_norm={}))}
    for name, bad in broken.items():
        save_checkpoint(tmp_path / f"{name}.npz", first.model, first.optimizer, first.scheduler, step=2, trainer=bad)
    for name in ["other_task"] + list(broken):
        second = _trainer(seed=1)
        before = {k: v.copy() for k, v in second.model.state_dict().items()}
        lr, rng_state = second.optimizer.param_groups[0]["lr"], random.global_rng().bit_generator.state
        with pytest.raises(ValueError, match=re.escape(f"{name}.npz: trainer state: ") if name in broken else "."):
            second.resume(tmp_path / f"{name}.npz")
        assert second.step == 0 and not second.optimizer.state and second.optimizer.param_groups[0]["lr"] == lr
        assert random.global_rng().bit_generator.state == rng_state
        assert all(np.array_equal(before[k], v) for k, v in second.model.state_dict().items()), name


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
    trainer = Seq2SeqTrainer(model, optim.Adam(model.parameters(), lr=1e-2), task, batch_size=32, progress=False)
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


# -- any model, any loss, any data -------------------------------------------------------------------
def _lm_data(n=96, length=9, seed=0):
    """Token ids: each sequence counts up from a random start (mod 8, ids 3..10), then PAD."""
    rng = np.random.default_rng(seed)
    ids = 3 + (rng.integers(0, 8, (n, 1)) + np.arange(length)) % 8
    lengths = rng.integers(4, length + 1, n)
    ids[np.arange(length)[None, :] >= lengths[:, None]] = PAD
    return ids


def _lm_trainer(steps=40, model_seed=0, **kwargs):
    manual_seed(model_seed)
    model = CausalLM(11, d_model=32, nhead=2, num_layers=1, dim_feedforward=64, dropout=0.1, max_len=16,
                     pad_idx=PAD)
    data = RandomBatches(_lm_data(), batch_size=16, seed=1)
    loss_fn = causal_lm_loss(ignore_index=PAD)
    heldout = [_lm_data(16, seed=5), _lm_data(16, seed=6)]
    opt = optim.AdamW(model.parameters(), lr=1e-2)
    return Trainer(model, opt, data, loss_fn, evaluate=evaluate_loss(loss_fn, heldout), eval_every=20,
                   scheduler=optim.WarmupCosineLR(opt, 5, steps), progress=False, grad_norm_every=5, **kwargs)


def test_trainer_learns_language_modelling_and_records_the_documented_history():
    trainer = _lm_trainer()
    result = trainer.fit(40)
    h = trainer.history
    assert set(result) == {"loss", "accuracy"} and result["accuracy"] > 0.6
    assert np.mean(h["loss"][-5:]) < 0.5 * np.mean(h["loss"][:5])
    assert {"step", "loss", "lr", "grad_norm", "items", "seconds", "accuracy", "layer_grad_norm_step",
            "layer_grad_norm", "eval_step", "eval_loss", "eval_accuracy"} == set(h)
    assert all(len(h[k]) == 40 for k in ("step", "loss", "lr", "grad_norm", "items", "seconds", "accuracy"))
    assert h["eval_step"] == [20, 40] and len(h["eval_loss"]) == 2
    # items: the targets that count (not PAD) of each batch
    assert all(0 < n <= 16 * 8 for n in h["items"]) and len(set(h["items"])) > 1


@pytest.mark.parametrize("record_steps", [False, True], ids=["eager", "recorded steps"])
@pytest.mark.parametrize("make", [_trainer, _lm_trainer], ids=["seq2seq", "language model"])
def test_resume_continues_bit_for_bit(tmp_path, make, record_steps):
    full = make(record_steps=record_steps)
    full.fit(8)
    first = make(record_steps=record_steps)
    first.fit(4)
    first.save(tmp_path / "ck.npz")
    # as in a new process: other weights, random and data streams
    resumed = make(model_seed=5, record_steps=record_steps)
    resumed._next_batch()
    resumed.resume(tmp_path / "ck.npz")
    assert resumed.step == 4
    resumed.fit(8)
    assert resumed.history["loss"] == full.history["loss"]  # bit for bit, steps 1..8
    assert resumed.history["lr"] == full.history["lr"]


@pytest.mark.parametrize("make", [_trainer, _lm_trainer], ids=["seq2seq", "language model"])
def test_recorded_steps_train_as_eager_steps_to_the_bit(make):
    """record_steps=True (npformer.recorded): the history (losses, lrs, gradient norms, items,
    accuracy, evaluations) and the weights of eager training, with dropout, clipping, a schedule
    and batches whose padding moves; a batch of another length runs eagerly, the next replays."""
    eager = make(steps=24)
    eager.fit(24)
    recorded = make(steps=24, record_steps=True)       # built after: the same seeds for its dropout
    recorded.fit(24)
    for key in ("loss", "lr", "grad_norm", "items", "accuracy", "eval_step"):
        assert recorded.history[key] == eager.history[key], key
    for a, b in zip(recorded.module.parameters(), eager.module.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
    step = recorded._recorded
    assert step.replays >= 12 and step.replays + step.eager_calls == 24


def test_a_loss_function_counting_with_numbers_trains_eagerly_with_record_steps():
    """Counts read on the host (numbers) would be the first step's at every replay: such a loss
    function's steps stay eager, with the numbers of record_steps=False."""
    def loss_fn(model, batch):
        out = npformer.training.seq2seq_loss()(model, batch)
        return Loss(out.sum, float(out.count), {"accuracy": float(out.metrics["accuracy"])})
    recorded = None
    histories = []
    for record_steps in (False, True):
        trainer = _trainer(record_steps=record_steps)
        trainer.loss_fn = loss_fn
        trainer.fit(5)
        histories.append(trainer.history["loss"])
        recorded = trainer
    assert histories[0] == histories[1] and recorded._recorded is None


def test_record_steps_follow_the_python_state_of_the_loss_function():
    """A loss function whose label smoothing follows a counter it increments: record_steps=True
    trains eagerly (each recording call changes the counter; the 8th warns), the history of
    record_steps=False; one whose smoothing a callback changes at step 3 (a dict the function
    reads): a new recording, replays after it, the same history."""
    def counting(model, batch, calls=[0]):
        calls[0] += 1
        return npformer.training.token_loss(model(batch.src, batch.tgt_in), batch.tgt_out, PAD,
                                            label_smoothing=min(calls[0], 5) / 10)
    settings = {"smoothing": 0.0}

    def set_at_3(trainer, stats):
        if stats["step"] == 3:
            settings["smoothing"] = 0.2

    def configured(model, batch):
        return npformer.training.token_loss(model(batch.src, batch.tgt_in), batch.tgt_out, PAD,
                                            label_smoothing=settings["smoothing"])
    for loss_fn, callbacks in ((counting, ()), (configured, [set_at_3])):
        histories = []
        for record_steps in (False, True):
            counting.__defaults__[0][0] = 0
            settings["smoothing"] = 0.0
            trainer = _trainer(record_steps=record_steps, callbacks=callbacks)
            trainer.loss_fn = loss_fn
            if record_steps and loss_fn is counting:   # each recording call changes the counter: eager at the 8th
                with pytest.warns(RuntimeWarning, match="recorded step: running it changed a value fn reads"):
                    trainer.fit(10)
                assert trainer._recorded.replays == 0
            else:
                trainer.fit(10)
            histories.append(trainer.history["loss"])
        assert histories[0] == histories[1]
        if loss_fn is configured:
            assert trainer._recorded.replays >= 4


def test_record_steps_with_a_host_read_in_the_loss_function_train_eagerly():
    """A loss function that branches on a value it reads on the host (the loss's .item()): with
    record_steps=True a warning naming its line, then eager steps: the history of record_steps=False."""
    def branching(model, batch):
        out = npformer.training.seq2seq_loss()(model, batch)
        scale = 0.5 if out.sum.item() / float(out.count) > 2.3 else 1.0      # the line the warning names
        return Loss(out.sum * scale, out.count, out.metrics)
    histories = []
    for record_steps in (False, True):
        trainer = _trainer(record_steps=record_steps)
        trainer.loss_fn = branching
        if record_steps:
            with pytest.warns(RuntimeWarning, match=r"recorded step: it read a value on the host at "
                                                    r".*test_training.py:\d+ \(in branching\)"):
                trainer.fit(6)
            assert trainer._recorded.replays == 0
        else:
            trainer.fit(6)
        histories.append(trainer.history["loss"])
    assert histories[0] == histories[1] and len(set(histories[0])) == 6


def test_trainer_learns_classification():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 10, (256, 6))
    labels = (ids == 3).any(axis=1).astype(np.int64)  # does token 3 occur?
    manual_seed(0)
    model = EncoderClassifier(10, 2, d_model=32, nhead=2, num_layers=1, dim_feedforward=64, dropout=0.0)
    heldout = [(ids[:64], labels[:64])]
    trainer = Trainer(model, optim.Adam(model.parameters(), lr=3e-3), RandomBatches(ids, labels, batch_size=32),
                      classification_loss(), evaluate=evaluate_loss(classification_loss(), heldout), progress=False)
    result = trainer.fit(60)
    assert result["accuracy"] > 0.9 and trainer.history["items"][0] == 32


def test_a_loss_function_may_return_a_mean_tensor_and_data_may_be_a_callable():
    manual_seed(0)
    model = nn.Linear(3, 1)
    x = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)

    def mse(m, batch):
        return ((m(Tensor(batch)) - 1.0) ** 2).mean()
    trainer = Trainer(model, optim.SGD(model.parameters(), lr=0.1), lambda: x, mse, progress=False, grad_norm_every=0)
    trainer.fit(30)
    assert trainer.history["loss"][-1] < 0.1 * trainer.history["loss"][0] and trainer.history["items"][0] == 1
    with pytest.raises(TypeError, match="loss_fn: expected a Loss or a scalar Tensor"):
        Trainer(model, optim.SGD(model.parameters(), lr=0.1), [x], lambda m, b: 3.0, progress=False).train_step()
    with pytest.raises(TypeError, match="Loss.sum must be a scalar Tensor"):
        Trainer(model, optim.SGD(model.parameters(), lr=0.1), [x], lambda m, b: Loss(2.0, 1),
                progress=False).train_step()
    empty = Trainer(model, optim.SGD(model.parameters(), lr=0.1), [x],
                    lambda m, b: Loss(m(Tensor(b)).sum() * 0, 0), progress=False)
    with pytest.raises(ValueError, match="no items to average over"):
        empty.train_step()


def test_a_trainer_is_the_class_asked_for_and_a_sequence_task_needs_the_seq2seq_trainer():
    """Trainer(model, optimizer, task, ...) silently made a Seq2SeqTrainer; now the caller names it."""
    trainer = _trainer()
    assert type(trainer) is Seq2SeqTrainer and trainer.batch_size == 16
    with pytest.raises(TypeError, match="data: expected an iterable, an iterator or a callable giving batches, got "
                                        "SequenceTask; train a SequenceTask with Seq2SeqTrainer"):
        Trainer(trainer.module, trainer.optimizer, trainer.task, causal_lm_loss())


# -- step callbacks ---------------------------------------------------------------------------------------
def test_callbacks_run_in_order_after_every_step_with_the_trainer_and_the_record():
    calls = []

    def first(trainer, record):
        assert trainer.history["loss"][-1] == record["loss"]  # the step is done and in the history
        calls.append(("first", record["step"], trainer.step))

    def second(trainer, record):
        calls.append(("second", record["step"], trainer.step))
    trainer, _ = _linear_trainer([_examples()], callbacks=[first, second])
    trainer.fit(2)
    trainer.train_step()  # a step outside fit calls them too
    assert calls == [("first", 1, 1), ("second", 1, 1), ("first", 2, 2), ("second", 2, 2),
                     ("first", 3, 3), ("second", 3, 3)]
    seq2seq = _trainer(callbacks=(second,))  # Seq2SeqTrainer passes them on
    seq2seq.train_step()
    assert calls[-1] == ("second", 1, 1)


def test_a_callback_that_raises_stops_fit_between_two_steps(tmp_path):
    class Stop(Exception):
        pass

    def stop_at_3(trainer, record):
        if trainer.step == 3:
            trainer.save(tmp_path / "ck.npz")
            raise Stop
    trainer, _ = _linear_trainer([_examples()], callbacks=[stop_at_3])
    with pytest.raises(Stop):
        trainer.fit(10, checkpoint_path=tmp_path / "end.npz")
    assert trainer.step == len(trainer.history["loss"]) == 3 and not (tmp_path / "end.npz").exists()
    assert npformer.load_checkpoint(tmp_path / "ck.npz", restore_rng=False)["trainer"]["step"] == 3


@pytest.mark.parametrize("callbacks, message", [
    (print, "callbacks: expected a list of functions (trainer, stats), got builtin_function_or_method"),
    ([print, "save"], "callbacks[1]: expected a function (trainer, stats), got str"),
], ids=["a function, not a list", "not a function"])
def test_bad_callbacks_fail_at_construction(callbacks, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        _linear_trainer([_examples()], callbacks=callbacks)


# -- arguments are checked when the trainer is made --------------------------------------------------------
BAD_ARGUMENTS = [
    (dict(eval_batch_size=0), ValueError, r"Seq2SeqTrainer: eval_batch_size must be an integer >= 1, got 0"),
    (dict(clip_norm=-1), ValueError, r"Trainer: clip_norm must be a finite real number >= 0, got -1"),
    (dict(clip_norm=float("nan")), ValueError, r"clip_norm must be .*got nan"),
    (dict(clip_norm=True), TypeError, r"Trainer: clip_norm must be a finite real number >= 0, got True \(a bool"),
    (dict(clip_norm="1"), TypeError, r"Trainer: clip_norm must be a finite real number >= 0, got '1' of type str"),
    (dict(eval_every=-1), ValueError, r"Trainer: eval_every must be an integer >= 0, got -1"),
    (dict(eval_every=2.5), TypeError, r"Trainer: eval_every must be an integer >= 0, got 2.5 of type float"),
    (dict(eval_size=0), ValueError, r"Seq2SeqTrainer: eval_size must be an integer >= 1, got 0"),
    (dict(batch_size=0), ValueError, r"Seq2SeqTrainer: batch_size must be an integer >= 1, got 0"),
    (dict(batch_size=True), TypeError, r"Seq2SeqTrainer: batch_size must be an integer >= 1, got True \(a bool"),
    (dict(label_smoothing="0.1"), TypeError, r"Seq2SeqTrainer: label_smoothing must be a real number in \[0, 1\], got '0.1' of type str"),
    (dict(label_smoothing=1.5), ValueError, r"Seq2SeqTrainer: label_smoothing must be a real number in \[0, 1\], got 1.5"),
    (dict(label_smoothing=True), TypeError, r"Seq2SeqTrainer: label_smoothing must be a real number in \[0, 1\], got True \(a bool"),
    (dict(grad_norm_every=-2), ValueError, r"Trainer: grad_norm_every must be an integer >= 0"),
    (dict(log_every=0), ValueError, r"Trainer: log_every must be an integer >= 1, got 0"),
    (dict(progress="yes"), TypeError, r"Trainer: progress must be True or False, got 'yes'"),
    (dict(extra_state=[1]), TypeError, r"extra_state: expected a dict or None, got list"),
    (dict(shard_optimizer=True), ValueError, r"shard_optimizer: needs a DistributedDataParallel model"),
    (dict(scheduler=3), TypeError, r"scheduler: expected an lr scheduler"),
]


@pytest.mark.parametrize("overrides, error, message", BAD_ARGUMENTS, ids=[str(c[0]) for c in BAD_ARGUMENTS])
def test_bad_arguments_fail_at_construction(overrides, error, message):
    manual_seed(0)
    model = Seq2SeqTransformer(12, 12, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                               dim_feedforward=16, dropout=0.0, pad_idx=PAD)
    task = SequenceTask("reverse", vocab_size=12, min_len=2, max_len=6, seed=0, heldout_size=50)
    with pytest.raises(error, match=message):
        Seq2SeqTrainer(model, optim.Adam(model.parameters()), task, **{"progress": False, **overrides})


def test_numpy_numbers_are_numbers():
    trainer = _trainer(clip_norm=np.float32(0.5), eval_every=np.int64(3), eval_size=np.int32(10))
    assert trainer.clip_norm == 0.5 and trainer.eval_every == 3 and trainer.eval_size == 10
    trainer.fit(np.int64(3))
    assert trainer.step == 3


def test_bad_model_optimizer_data_and_fit_arguments():
    model = nn.Linear(2, 1)
    opt = optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="model: expected an npformer.nn.Module, got function"):
        Trainer(lambda x: x, opt, [1], lambda m, b: None)
    with pytest.raises(TypeError, match="optimizer: expected an npformer.optim optimizer, got str"):
        Trainer(model, "adam", [1], lambda m, b: None)
    with pytest.raises(TypeError, match="data: expected an iterable, an iterator or a callable"):
        Trainer(model, opt, 3, lambda m, b: None)
    with pytest.raises(TypeError, match="loss_fn: expected a callable"):
        Trainer(model, opt, [1], None)
    with pytest.raises(TypeError, match="evaluate: expected a callable"):
        Trainer(model, opt, [1], lambda m, b: None, evaluate="loss")
    trainer = Trainer(model, opt, [1], lambda m, b: None, progress=False)
    with pytest.raises(ValueError, match="Trainer.fit: steps must be an integer >= 0, got -1"):
        trainer.fit(-1)
    with pytest.raises(TypeError, match="Trainer.fit: checkpoint_every must be an integer >= 0, got 1.5"):
        trainer.fit(1, checkpoint_every=1.5)


# -- gradients beyond float range ---------------------------------------------------------------------------
class TwoScalars(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(np.ones(1)), nn.Parameter(np.ones(1))


def test_clip_grad_norm_returns_inf_when_the_sum_of_squares_overflows():
    m = TwoScalars()
    for p in m.parameters():
        p.grad = Tensor(np.full(1, 1.2e154))  # each norm is finite, the sum of their squares is not
    assert float(optim.clip_grad_norm_(m.parameters(), 1.0)) == math.inf  # a 0-d Tensor, as torch
    assert optim.grad_norm(m.parameters()) == math.inf
    np.testing.assert_array_equal(m.a.grad, [1.2e154])  # left as it was


def test_trainer_skips_an_update_whose_gradient_norm_overflows(capsys):
    m = TwoScalars()
    calls = []

    def loss_fn(model, batch):
        calls.append(batch)
        scale = 1.2e154 if batch == "huge" else 1.0
        return Loss(model.a.sum() * scale + model.b.sum() * scale, 1)
    trainer = Trainer(m, optim.SGD(m.parameters(), lr=0.1), ["huge", "small"], loss_fn, clip_norm=1.0,
                      progress=False, grad_norm_every=0)
    trainer.train_step()
    assert m.a.data[0] == 1.0 and m.b.data[0] == 1.0 and trainer.history["grad_norm"] == [math.inf]
    assert "step 1: gradient norm inf, update skipped" in capsys.readouterr().err
    trainer.train_step()
    assert m.a.data[0] < 1.0 and calls == ["huge", "small"]


# -- progress and figures ---------------------------------------------------------------------------------
def test_progress_line_on_a_file(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the line of its own, even where tqdm is installed
    bar = Progress(20, enabled=True)
    for step in range(1, 21):
        bar.update(step, f"loss {1 / step:.2f}")
    bar.write("a message")
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("step  1/20 [#") and lines[-2].startswith("step 20/20 [####################]")
    assert len(lines) == 12 and lines[-1] == "a message"  # about every 10% of the run on a file
    silent = Progress(5, enabled=False)
    silent.update(1, "x")
    silent.close()
    assert capsys.readouterr().err == ""
    silent.write("step 3: gradient norm inf, update skipped")  # news, not progress: printed all the same
    assert capsys.readouterr().err == "step 3: gradient norm inf, update skipped\n"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_rewrites_its_line_and_a_message_outside_a_run_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = Progress(2)
    bar.update(1, "loss 1.0")
    bar.write("a message")
    bar.close()
    assert sys.stderr.getvalue() == "\rstep 1/2 [##########..........] loss 1.0\033[K\na message\n\n"
    monkeypatch.setattr(sys, "stderr", Terminal())
    Progress(0, enabled=False).write("step 3: gradient norm inf, update skipped")  # no bar to break
    assert sys.stderr.getvalue() == "step 3: gradient norm inf, update skipped\n"


def test_progress_gives_up_a_closed_stream_and_says_nothing_more(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    bar = Progress(3)
    bar.update(1, "loss 1.0")  # ValueError: I/O operation on closed file, caught
    bar.write("step 2: gradient norm inf, update skipped")
    bar.close()
    assert bar.stream is None


# A training run whose progress line cannot be written, in a process of its own: 8 steps of a
# linear model in two calls of fit, the third and seventh of which overflow (their updates are
# skipped, and said on stderr); the callback waits at step 2 for a line on stdin, sent once the
# test has closed its end of stderr.
TRAINING_RUN = """
import sys
if sys.argv[1] == "without tqdm":
    sys.modules["tqdm"] = None
import numpy as np
from autograd import Tensor
from npformer import nn, optim
from npformer.training import Loss, Trainer

def loss_fn(model, scale):
    return Loss(model(Tensor(np.ones((1, 1), np.float32))).sum() * scale, 1)

def wait_for_the_reader(trainer, record):
    if trainer.step == 2:
        sys.stdin.readline()

model = nn.Linear(1, 1)
trainer = Trainer(model, optim.SGD(model.parameters(), lr=0.1), [1.0, 1.0, 1e300, 1.0], loss_fn, log_every=1,
                  callbacks=[wait_for_the_reader])
trainer.fit(4)
trainer.fit(8)  # a second progress line, on the stream that already failed
print("trained", trainer.step, "skipped", trainer.history["grad_norm"].count(float("inf")))
"""


@pytest.mark.parametrize("tqdm", ["with tqdm", "without tqdm"])
@pytest.mark.parametrize("stderr", ["closed", "read by a reader that stops early"])
def test_training_goes_on_when_its_progress_line_cannot_be_written(stderr, tqdm):
    """A closed stderr (sys.stderr is None) raised AttributeError: 'NoneType' object has no
    attribute 'isatty'; a reader that went away (`2>&1 | head -c 1`) raised BrokenPipeError.
    Progress output is best-effort: the run trains every step and ends normally."""
    if tqdm == "with tqdm":
        pytest.importorskip("tqdm")
    command = [sys.executable, "-c", TRAINING_RUN, tqdm]
    if stderr == "closed":
        run = subprocess.run(command, cwd=ROOT, input="\n", stdout=subprocess.PIPE, text=True, timeout=300,
                             preexec_fn=lambda: os.close(2))
        code, out = run.returncode, run.stdout
    else:
        child = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        assert child.stderr.read(1)  # the first character of the progress line, then the reader stops
        child.stderr.close()
        child.stdin.write("\n")
        child.stdin.close()
        out = child.stdout.read()
        code = child.wait(timeout=300)
    assert (code, out) == (0, "trained 8 skipped 2\n")


def test_plot_curves_draws_the_documented_history_keys(tmp_path):
    pytest.importorskip("matplotlib")
    from npformer import plots
    trainer = _lm_trainer(steps=20)
    trainer.fit(20)
    path = plots.plot_curves(trainer.history, tmp_path / "lm.png", "language model")
    assert path.stat().st_size > 1000
    minimal = {"step": [1, 2, 3], "loss": [3.0, 2.0, 1.5], "lr": [1e-3] * 3}
    assert plots.plot_curves(minimal, tmp_path / "minimal.png").stat().st_size > 1000
    with pytest.raises(KeyError, match="missing \\['lr'\\]"):
        plots.plot_curves({"step": [1], "loss": [1.0]}, tmp_path / "x.png")


# -- edges a PyTorch user hits: smoothing and ignore_index, empty data, data that runs out, checkpoint paths ---------
def test_token_loss_equals_torch_cross_entropy_with_ignore_index_and_label_smoothing(torch):
    rng = np.random.default_rng(3)
    logits, target = rng.standard_normal((2, 5, 7)), rng.integers(0, 7, (2, 5))
    target[0, 1] = target[1, 3] = 4
    for smoothing in (0.0, 0.1, np.float32(0.25)):
        out = npformer.training.token_loss(Tensor(logits), target, np.int64(4), smoothing)
        expected = torch.nn.functional.cross_entropy(torch.tensor(logits).reshape(-1, 7), torch.tensor(target).reshape(-1),
                                                     ignore_index=4, label_smoothing=float(smoothing), reduction="sum")
        assert out.count == 8 and out.metrics["accuracy"] == int(((logits.argmax(-1) == target) & (target != 4)).sum())
        np.testing.assert_allclose(out.sum.item(), expected.item(), rtol=1e-12, atol=0)


def test_loss_factories_check_ignore_index_when_made():
    with pytest.raises(TypeError, match=r"causal_lm_loss: ignore_index must be an integer, got True \(a bool"):
        causal_lm_loss(ignore_index=True)
    with pytest.raises(TypeError, match="causal_lm_loss: ignore_index must be an integer, got 'pad' of type str"):
        causal_lm_loss(ignore_index="pad")
    causal_lm_loss(ignore_index=np.int64(0))  # numpy integers are integers


def _linear_trainer(data, heldout=None, **kwargs):
    manual_seed(0)
    model = nn.Linear(3, 4)

    def loss_fn(m, batch):
        return npformer.training.token_loss(m(Tensor(batch[0])), batch[1])
    evaluate = None if heldout is None else evaluate_loss(loss_fn, heldout)
    return (Trainer(model, optim.SGD(model.parameters(), lr=0.1), data, loss_fn, evaluate=evaluate, progress=False,
                    **kwargs), loss_fn)


def _examples(n=2, label=1):
    return np.ones((n, 3), np.float32), np.full(n, label)


def test_evaluate_loss_on_batches_without_an_item_is_a_clear_error_not_a_division_by_zero():
    trainer, loss_fn = _linear_trainer([_examples()])
    with pytest.raises(ValueError, match=r"evaluate_loss: the held-out batches have no items to average over "
                                         r"\(count 0\)"):
        evaluate_loss(loss_fn, [_examples(label=-100)])(trainer.model)
    with pytest.raises(ValueError, match=r"evaluate_loss: expected at least one held-out batch, got none"):
        evaluate_loss(loss_fn, iter([]))  # when made: was raised by the evaluation at the end of fit, after training


def test_fit_zero_steps_evaluates_and_saves_without_training(tmp_path):
    trainer, loss_fn = _linear_trainer([_examples()], heldout=[_examples()])
    before = trainer.model.weight.numpy().copy()
    result = trainer.fit(0, checkpoint_path=tmp_path / "ck.npz")
    assert trainer.step == 0 and trainer.history["loss"] == [] and set(result) == {"loss", "accuracy"}
    np.testing.assert_array_equal(trainer.model.weight.numpy(), before)
    assert npformer.load_checkpoint(tmp_path / "ck.npz", restore_rng=False)["trainer"]["step"] == 0


def test_a_list_of_batches_is_an_epoch_and_fit_starts_the_next_one():
    batches = [_examples(label=k) for k in range(3)]
    seen = []
    trainer, loss_fn = _linear_trainer(batches)
    trainer.loss_fn = lambda m, b: (seen.append(int(b[1][0])), loss_fn(m, b))[1]
    trainer.fit(7)
    assert trainer.step == 7 and seen == [0, 1, 2, 0, 1, 2, 0]  # like HF's Trainer with max_steps


@pytest.mark.parametrize("data, message", [
    ([], r"data: an empty iterable \(no batch to train on\)"),
    (iter([_examples()] * 2), r"data: the iterator ran out after 2 batches; give an iterable that can be iterated "
                              r"again \(each pass an epoch"),
], ids=["empty list", "iterator"])
def test_data_that_runs_out_is_a_clear_error_not_a_stopiteration(data, message):
    trainer, _ = _linear_trainer(data)
    with pytest.raises(ValueError, match=message):
        trainer.fit(3)
    assert trainer.step == len(trainer.history["loss"]) == (2 if message.startswith("data: the iterator") else 0)


def test_fit_checks_the_checkpoint_path_before_training(tmp_path):
    trainer, _ = _linear_trainer([_examples()])
    with pytest.raises(TypeError, match="Trainer.fit: checkpoint_path: expected a str or os.PathLike or None, got int"):
        trainer.fit(3, checkpoint_path=5)
    with pytest.raises(IsADirectoryError, match="Trainer.fit: checkpoint_path: .* is a folder; give a file"):
        trainer.fit(3, checkpoint_path=tmp_path)
    with pytest.raises(ValueError, match="Trainer.fit: checkpoint_path: expected a file path, got ''"):
        trainer.fit(3, checkpoint_path="")
    with pytest.raises(ValueError, match="Trainer.fit: checkpoint_every=2 needs a checkpoint_path"):
        trainer.fit(3, checkpoint_every=2)
    assert trainer.step == 0  # nothing trained in vain
    trainer.fit(2, checkpoint_path=tmp_path / "new" / "folder" / "ck.npz")  # missing folders are made
    assert npformer.load_checkpoint(tmp_path / "new" / "folder" / "ck.npz", restore_rng=False)["step"] == 2
