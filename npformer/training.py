"""Training loops: `Trainer` for any model, loss and data; `Seq2SeqTrainer` for a SequenceTask.

One step: the next batch from `data`, `loss_fn(model, batch)`, backward, per-layer gradient
norms (every `grad_norm_every` steps), gradient clipping, optimizer and scheduler steps, then
the `callbacks`; an update whose gradient norm is not finite is skipped. Every `eval_every`
steps (and when `fit` ends) `evaluate` runs. A progress line shows the loss, metrics, lr and
items/s (best-effort: a closed stderr or a broken pipe stops the line, never the training).

Loss functions return a `Loss`: the loss summed over `count` items (target tokens,
sequences, ...) and metric sums over the same items (e.g. correct tokens); the Trainer
divides by the count over all ranks, so a step's loss and gradient are those of the mean over
the global batch, however padding splits it (see npformer.distributed.loss). A plain Tensor
is taken as a mean (count 1). Ready-made: `seq2seq_loss`, `causal_lm_loss`,
`classification_loss`; `evaluate_loss` evaluates any of them on held-out batches.

Data parallelism: give the Trainer a `distributed.DistributedDataParallel` model; each rank
then draws its share of every global batch (the data source shards: SequenceTask.batch,
data.RandomBatches), and rank 0 alone shows progress and writes checkpoints.
`shard_optimizer=True` splits the optimizer's state across ranks (ZeRO-1).

History (`trainer.history`, saved in checkpoints, drawn by `plots.plot_curves`):
    step, loss, lr, grad_norm, items, seconds   one entry per step: the mean loss over the
        step's items, the lr the update used, the total gradient norm before clipping (not
        finite: the update was skipped), the number of items over all ranks, the step's time
    <metric>                                    one entry per step per metric of the loss
        function (e.g. accuracy: correct / items)
    layer_grad_norm_step, layer_grad_norm       the steps where per-layer gradient norms were
        taken, and {layer name (`layer_of`): [norm at each of those steps]}
    eval_step, eval_<name>                      the step of each evaluation, and each value
        it returned (e.g. eval_exact_match)

Reproducible: the losses depend only on the seeds (`npformer.manual_seed` before building the
model, the data's seed); `save`/`resume` continue exactly where a run stopped.
"""
from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from autograd import Tensor, backend, raw_computation
from autograd.checks import check_bool, check_int, check_real
from npformer.runtime import random

from . import functional as F
from .checkpoint import load_checkpoint, save_checkpoint
from .checkpoint.packing import bit_generator
from .data import EOS, PAD, SequenceTask, shard
from .decoding import greedy_decode
from .distributed import comm
from .distributed.ddp import DistributedDataParallel, split_random_streams
from .distributed.zero import ZeroRedundancyOptimizer
from .nn import Module, inference_mode
from .optim import Optimizer, clip_grad_norm_, grad_norm
from .progress import Progress
from .recording import RecordedStep

__all__ = ["Loss", "token_loss", "seq2seq_loss", "causal_lm_loss", "classification_loss", "evaluate_loss", "Trainer",
           "Seq2SeqTrainer", "layer_of"]

LossFunction = Callable[[Module, Any], "Loss | Tensor"]  # (model, batch) -> Loss, or a scalar Tensor (a mean)
StepCallback = Callable[["Trainer", dict], None]  # (trainer, the step's stats), after every train_step


def layer_of(name: str) -> str:
    """The layer a parameter belongs to, for per-layer gradient norms:
    'encoder.layers.1.self_attn.in_proj_weight' -> 'encoder.layers.1',
    'src_embed.weight' -> 'src_embed'."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[:i + 2])
    return ".".join(parts[:-1]) or name


@dataclass
class Loss:
    """What a loss function returns: `sum`, the loss summed over `count` items (a scalar
    Tensor), and `metrics`, sums over the same items, reported divided by the count. The count and
    metrics are numbers, or 0-d arrays read when the step reports them (token_loss's: a recorded
    step, `Trainer(record_steps=True)`, makes them again at each replay)."""

    sum: Tensor
    count: Any
    metrics: dict = field(default_factory=dict)


# -- loss functions ------------------------------------------------------------------------
def token_loss(logits: Tensor, target: Any, ignore_index: int = -100, label_smoothing: float = 0.0) -> Loss:
    """Cross-entropy of logits (..., C) against integer targets (...), summed over the targets
    that are not ignore_index; their count; metric "accuracy": how many of them the argmax gets.
    The building block of the ready-made loss functions (F.cross_entropy with reduction="sum")."""
    target = backend.to_device(target, logits.device)
    flat = raw_computation(backend.get_array_module(target).ravel, target)  # a copy when target is a strided view
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=ignore_index,
                           reduction="sum", label_smoothing=label_smoothing)
    count, correct = raw_computation(_counted_targets, logits, target, ignore_index)  # again at each replay
    return Loss(loss, count, {"accuracy": correct})


def _counted_targets(logits, target, ignore_index):
    """(the targets that are not ignore_index, how many of them the argmax of logits gets), as
    0-d integer arrays (read on the host when the step reports them)."""
    xp = logits.xp
    valid = target != ignore_index
    correct = (xp.argmax(logits.data, axis=-1) == target) & valid
    return xp.asarray(valid.sum()), xp.asarray(correct.sum())


def seq2seq_loss(label_smoothing: float = 0.0) -> LossFunction:
    """Loss function for an encoder-decoder on `data.Batch`es: teacher-forced token
    cross-entropy of model(src, tgt_in) against tgt_out, PAD ignored."""
    label_smoothing = check_real(label_smoothing, "label_smoothing", "seq2seq_loss", at_least=0, at_most=1)

    def loss_fn(model, batch):
        return token_loss(model(batch.src, batch.tgt_in), batch.tgt_out, PAD, label_smoothing)
    return loss_fn


def causal_lm_loss(ignore_index: int = -100, label_smoothing: float = 0.0) -> LossFunction:
    """Loss function for a causal LM on batches of token ids (B, T + 1): predict ids[:, 1:]
    from ids[:, :-1]; targets equal to ignore_index (e.g. the padding id) do not count."""
    ignore_index = check_int(ignore_index, "ignore_index", "causal_lm_loss")
    label_smoothing = check_real(label_smoothing, "label_smoothing", "causal_lm_loss", at_least=0, at_most=1)

    def loss_fn(model, ids):
        return token_loss(model(ids[:, :-1]), ids[:, 1:], ignore_index, label_smoothing)
    return loss_fn


def classification_loss(label_smoothing: float = 0.0) -> LossFunction:
    """Loss function for a classifier on batches (inputs, labels): cross-entropy of
    model(inputs) (B, C) against labels (B,), summed over the examples; metric accuracy."""
    label_smoothing = check_real(label_smoothing, "label_smoothing", "classification_loss", at_least=0, at_most=1)

    def loss_fn(model, batch):
        inputs, labels = batch
        return token_loss(model(inputs), labels, -100, label_smoothing)
    return loss_fn


def _as_loss(out):
    if isinstance(out, Loss):
        if not (isinstance(out.sum, Tensor) and out.sum.size == 1):
            raise TypeError(f"loss_fn: Loss.sum must be a scalar Tensor (the summed loss), got "
                            f"{type(out.sum).__name__}")
        return out
    if isinstance(out, Tensor) and out.size == 1:
        return Loss(out, 1)
    raise TypeError(f"loss_fn: expected a Loss or a scalar Tensor (a mean), got {type(out).__name__}"
                    + (f" of shape {out.shape}" if isinstance(out, Tensor) else ""))


def evaluate_loss(loss_fn: LossFunction, batches: Iterable[Any]) -> Callable[[Module], dict[str, float]]:
    """An `evaluate` function for Trainer: the loss and metrics of `loss_fn` over fixed
    held-out batches, without dropout or a graph (nn.inference_mode(): model.training
    untouched); batch i runs on rank i % world size and the sums are added over ranks. The
    function returns {"loss": ..., <metric>: ...}, divided by the item count. ValueError for no
    batch (when made), fewer batches than ranks, or when no batch has an item (e.g. every target
    equal to ignore_index: torch's mean would be NaN)."""
    batches = list(batches)
    if not batches:
        raise ValueError("evaluate_loss: expected at least one held-out batch, got none")

    def evaluate(model):
        group = comm.group()
        if len(batches) < group.size:
            raise ValueError(f"evaluate_loss: expected at least one held-out batch per rank ({group.size}), "
                             f"got {len(batches)}")
        loss = count = 0.0
        metrics = {}
        with inference_mode():
            for batch in batches[group.rank::group.size]:
                out = _as_loss(loss_fn(model, batch))
                loss, count = loss + out.sum.item(), count + out.count
                for name, value in out.metrics.items():
                    metrics[name] = metrics.get(name, 0.0) + value
        totals = group.sum([loss, count, *metrics.values()])
        if not totals[1] > 0:
            raise ValueError(f"evaluate_loss: the held-out batches have no items to average over (count {totals[1]:g}); "
                             "check them (e.g. every target equal to ignore_index)")
        return {"loss": totals[0] / totals[1], **{k: v / totals[1] for k, v in zip(metrics, totals[2:])}}
    return evaluate


def _batch_arrays(batch):
    """The arrays of a batch (an array, or a tuple or dataclass of arrays) in order, or None."""
    if backend.is_array(batch):
        return (batch,)
    values = tuple(getattr(batch, f.name) for f in fields(batch)) if is_dataclass(batch) and \
        not isinstance(batch, type) else batch if isinstance(batch, tuple) else None
    return values if values is not None and all(backend.is_array(v) for v in values) else None


def _inverse_count(count, dtype):
    """1 / count as a 0-d array of the loss's dtype (0 for no items: the step then raises)."""
    xp = backend.get_array_module(count)
    return xp.asarray(1.0 / count if count > 0 else 0.0, dtype=dtype)


def _epochs(data):
    """The next-batch function over an iterable: a new pass over it (an epoch) when one runs out;
    ValueError when an iterator (one pass only) runs out, or when a pass yields nothing."""
    passes, drawn = iter(data), 0

    def next_batch():
        nonlocal passes, drawn
        try:
            batch = next(passes)
        except StopIteration:
            if passes is data:
                raise ValueError(f"data: the iterator ran out after {drawn} batches; give an iterable that can be "
                                 "iterated again (each pass an epoch, e.g. a list), a callable, or "
                                 "npformer.data.RandomBatches") from None
            passes, drawn = iter(data), 0
            try:
                batch = next(passes)
            except StopIteration:
                raise ValueError("data: an empty iterable (no batch to train on)") from None
        drawn += 1
        return batch
    return next_batch


# -- the trainer ------------------------------------------------------------------------------
class Trainer:
    """Trains `model` with `optimizer` on batches from `data`, minimising `loss_fn`.

    model: an npformer Module, or a `distributed.DistributedDataParallel` (data parallelism).
    optimizer / scheduler: from npformer.optim (scheduler.step() after each optimizer step).
    data: where training batches come from: an iterable (its next item each step; when it runs
        out, a new pass over it starts: an epoch, as HF's Trainer with max_steps), an iterator (its
        next item; ValueError when it runs out) or a callable (called each step). One with state_dict()/load_state_dict()
        (data.RandomBatches) has its position saved in checkpoints.
    loss_fn: (model, batch) -> `Loss` or a scalar Tensor (a mean); see the module docstring.
    evaluate: (model) -> {name: number}, run every `eval_every` steps (0: only when `fit`
        ends) and at the end of `fit`; e.g. `evaluate_loss(loss_fn, heldout_batches)`.
    clip_norm: max global gradient norm (None: no clipping; the norm is still reported).
    grad_norm_every: keep per-layer gradient norms every N steps (0: never).
    progress: show the progress line (rank 0 only). log_every: refresh it every N steps.
    extra_state: a dict saved into every checkpoint of `save` (e.g. the run's settings).
    shard_optimizer: with a DistributedDataParallel model, split the optimizer's state across
        ranks (`distributed.ZeroRedundancyOptimizer`, ZeRO-1).
    record_steps: on the CPU, in one process, run each step's forward and backward as a
        recorded step (`npformer.recorded`): recorded at the second step, replayed for every batch
        of the same signature, the same numbers as eager steps. The signature (npformer/recording.py)
        covers the batch's shapes and dtypes (not its memory order), the modes, every attribute of
        every module of the model, and the loss function's Python state: its default arguments,
        closure and globals (a smoothing in a dict a callback changes records anew). A batch of new
        shapes or a changed setting is recorded too, up to 8 recordings; past them steps run
        eagerly. Steps stay eager with a loss function whose count or metrics are numbers (the
        ready-made ones make arrays: token_loss), batches that are not arrays (or a tuple or
        dataclass of them); they become eager for good, with one RuntimeWarning, when the
        recorded step reads a value on the host (`.item()`, `float()`: a branch on the data; the
        warning names the line), changes Python state it reads at each step that would record
        (a counter in the loss function: at the 8th such step, each of them eager), or a module's
        forward is replaced on the instance. Not seen: a branch on the values of the
        raw batch arrays or of a Tensor's `.data`, Python random numbers or the clock in the loss
        function.

    callbacks: functions `callback(trainer, stats)`, called in order at the end of every
        `train_step` with the step's stats (the step is done and in `history`): Lightning's
        `on_train_batch_end(trainer, ...)`, HF's `on_step_end`. One may save the trainer, or raise
        to stop training between two steps (the exception leaves `fit`).

    A SequenceTask is trained by `Seq2SeqTrainer` (it brings its own loss and evaluation).
    Raises TypeError / ValueError naming a bad argument (shard_optimizer=True without a
    DistributedDataParallel model: ValueError).
    """

    def __init__(self, model: Module, optimizer: Optimizer, data: Iterable[Any] | Callable[[], Any],
                 loss_fn: Callable[[Module, Any], Loss | Tensor], *, evaluate: Callable[[Module], dict[str, Any]] | None = None,
                 scheduler: Any = None, clip_norm: float | None = 1.0, eval_every: int = 0, grad_norm_every: int = 10,
                 progress: bool = True, log_every: int = 10, extra_state: dict[str, Any] | None = None,
                 shard_optimizer: bool = False, callbacks: Sequence[StepCallback] = (), record_steps: bool = False):
        if not isinstance(model, Module):
            raise TypeError(f"model: expected an npformer.nn.Module, got {type(model).__name__}")
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(f"optimizer: expected an npformer.optim optimizer, got {type(optimizer).__name__}")
        if scheduler is not None and not hasattr(scheduler, "step"):
            raise TypeError(f"scheduler: expected an lr scheduler with step(), got {type(scheduler).__name__}")
        if callable(data) and not hasattr(data, "__next__"):
            self._next_batch = data
        elif hasattr(data, "__iter__"):
            self._next_batch = _epochs(data)
        else:
            hint = "; train a SequenceTask with Seq2SeqTrainer" if isinstance(data, SequenceTask) else ""
            raise TypeError(f"data: expected an iterable, an iterator or a callable giving batches, "
                            f"got {type(data).__name__}{hint}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable (model, batch) -> Loss or Tensor, got "
                            f"{type(loss_fn).__name__}")
        if evaluate is not None and not callable(evaluate):
            raise TypeError(f"evaluate: expected a callable (model) -> dict or None, got {type(evaluate).__name__}")
        if extra_state is not None and not isinstance(extra_state, dict):
            raise TypeError(f"extra_state: expected a dict or None, got {type(extra_state).__name__}")
        if not isinstance(callbacks, (list, tuple)):
            raise TypeError(f"callbacks: expected a list of functions (trainer, stats), got {type(callbacks).__name__}")
        for i, callback in enumerate(callbacks):
            if not callable(callback):
                raise TypeError(f"callbacks[{i}]: expected a function (trainer, stats), got {type(callback).__name__}")
        self.clip_norm = None if clip_norm is None else check_real(clip_norm, "clip_norm", "Trainer", at_least=0)
        self.eval_every = check_int(eval_every, "eval_every", "Trainer", at_least=0)
        self.grad_norm_every = check_int(grad_norm_every, "grad_norm_every", "Trainer", at_least=0)
        self.log_every = check_int(log_every, "log_every", "Trainer", at_least=1)
        self.distributed = isinstance(model, DistributedDataParallel)
        self.group = model.group if self.distributed else comm.LOCAL
        self.module = model.module if self.distributed else model
        if check_bool(shard_optimizer, "shard_optimizer", "Trainer"):
            if not self.distributed:
                raise ValueError("shard_optimizer: needs a DistributedDataParallel model (there is nothing "
                                 "to split the optimizer's state across in one process)")
            optimizer = ZeroRedundancyOptimizer(optimizer, self.group)
        self.progress = check_bool(progress, "progress", "Trainer") and self.group.rank == 0
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.data, self.loss_fn, self.evaluate_fn = data, loss_fn, evaluate
        self.extra_state = dict(extra_state or {})
        self.callbacks = list(callbacks)
        self.layers = {}
        for name, p in self.module.named_parameters():
            self.layers.setdefault(layer_of(name), []).append(p)
        self.step = 0
        self.history = self._empty_history()
        self._bar = None
        record_steps = check_bool(record_steps, "record_steps", "Trainer") and not self.distributed
        # the signature follows the loss function (its closure, globals, defaults), whichever it is at each step
        self._recorded = RecordedStep(self._recorded_loss, self.module, state=lambda: self.loss_fn) \
            if record_steps else None
        self._metric_names = None   # the recorded loss function's metrics, in order
        self._batch_type = None     # the type of the batch the recorded step rebuilds from its arrays

    def _empty_history(self):
        return {"step": [], "loss": [], "lr": [], "grad_norm": [], "items": [], "seconds": [],
                "layer_grad_norm_step": [], "layer_grad_norm": {name: [] for name in self.layers}, "eval_step": []}

    # -- one step ------------------------------------------------------------------------
    def train_step(self, batch: Any = None) -> dict[str, Any]:
        """One optimisation step on `batch` (default: the next one from `data`). Returns the
        step's stats: step, loss, lr, grad_norm, items, seconds and the loss's metrics (also
        appended to `history`, then given to each callback). ValueError when no rank's batch has
        an item to average over."""
        start = time.perf_counter()
        batch = self._next_batch() if batch is None else batch
        self.model.train()
        lr = self.optimizer.param_groups[0]["lr"]
        totals, names = self._recorded_step(batch) if self._recorded is not None else (None, None)
        if totals is None:
            out = _as_loss(self.loss_fn(self.model, batch))
            # one message: the loss, the count and the metric sums of every rank
            totals, names = self.group.sum([out.sum.item(), out.count, *out.metrics.values()]), list(out.metrics)
            count = totals[1]
            if count > 0:
                self.optimizer.zero_grad()
                # after DDP's mean over ranks: d(sum of every rank's loss) / (every rank's count)
                (out.sum * (self.group.size / count)).backward()
        count = totals[1]
        if not count > 0:
            raise ValueError(f"loss_fn: step {self.step + 1} has no items to average over (count {count}); "
                             "check the batch (e.g. every target equal to ignore_index)")
        self.step += 1
        if self.grad_norm_every and self.step % self.grad_norm_every == 0:
            self.history["layer_grad_norm_step"].append(self.step)
            for name, params in self.layers.items():
                self.history["layer_grad_norm"][name].append(grad_norm(params))
        params = self.optimizer.parameters()
        total = float(clip_grad_norm_(params, self.clip_norm)) if self.clip_norm is not None else grad_norm(params)
        if math.isfinite(total):
            self.optimizer.step()
        else:  # skip the update rather than write inf or NaN into the weights
            self._say(f"step {self.step}: gradient norm {total}, update skipped")
        if self.scheduler is not None:
            self.scheduler.step()
        stats = {"step": self.step, "loss": totals[0] / count, "lr": lr, "grad_norm": total,
                  "items": int(count) if float(count).is_integer() else count,
                  "seconds": time.perf_counter() - start}
        stats.update({name: value / count for name, value in zip(names, totals[2:])})
        for key, value in stats.items():
            self.history.setdefault(key, []).append(value)
        for callback in self.callbacks:
            callback(self, stats)
        return stats

    def _recorded_step(self, batch):
        """(totals, metric names) of a step run by the recorded step (its gradients in .grad), or
        (None, None) when this batch or loss function cannot be recorded (the step then runs eagerly)."""
        arrays = _batch_arrays(batch)
        if arrays is None:
            return None, None
        self._batch_type = type(batch) if not backend.is_array(batch) else None
        self.optimizer.zero_grad()
        _, total, count, *metrics = self._recorded(*arrays)
        if self._metric_names is None:   # not recordable (numbers for count or metrics): eager from now on
            self._recorded = None
        # the scale was 0 without items (zero gradients, and the error below), as eager raises before backward
        return [total.item(), float(count), *map(float, metrics)], self._metric_names or []

    def _recorded_loss(self, *arrays):
        """The recorded step's function: the mean loss (d loss / d weights as eager steps take it:
        the summed loss times 1 / count, count 0 giving 0), the summed loss, the count, the metrics."""
        batch = arrays[0] if self._batch_type is None else self._batch_type(*arrays)
        out = _as_loss(self.loss_fn(self.model, batch))
        values = [out.count, *out.metrics.values()]
        recordable = all(backend.is_array(v) for v in values)
        self._metric_names = list(out.metrics) if recordable else None
        scale = Tensor(raw_computation(_inverse_count, out.count, out.sum.dtype)) if recordable else \
            1.0 / out.count if out.count else 0.0
        return (out.sum * scale, out.sum, *values)

    def _say(self, message):
        if self.group.rank == 0:
            (self._bar or Progress(0, enabled=False)).write(message)

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self) -> dict[str, Any]:
        """The `evaluate` function's results on the model ({} without one); every rank calls it."""
        return {} if self.evaluate_fn is None else dict(self.evaluate_fn(self.module))

    def _periodic_evaluation(self):
        """The evaluation run every `eval_every` steps (subclasses may make it cheaper)."""
        return self.evaluate()

    def _record_eval(self, result):
        self.history["eval_step"].append(self.step)
        for name, value in result.items():
            self.history.setdefault(f"eval_{name}", []).append(value)

    # -- the loop ------------------------------------------------------------------------
    def fit(self, steps: int, checkpoint_path: str | os.PathLike | None = None,
            checkpoint_every: int = 0) -> dict[str, Any]:
        """Train until `self.step == steps` (a total: a resumed trainer continues where it
        stopped), evaluating every `eval_every` steps and at the end; with checkpoint_path,
        save there every `checkpoint_every` steps and at the end (missing folders are made).
        Returns the final evaluation. The arguments are checked before the first step: TypeError
        or ValueError naming a bad one, IsADirectoryError for a checkpoint_path that is a folder."""
        steps = check_int(steps, "steps", "Trainer.fit", at_least=0)
        checkpoint_every = check_int(checkpoint_every, "checkpoint_every", "Trainer.fit", at_least=0)
        if checkpoint_path is not None:
            if not isinstance(checkpoint_path, (str, os.PathLike)):
                raise TypeError(f"Trainer.fit: checkpoint_path: expected a str or os.PathLike or None, got "
                                f"{type(checkpoint_path).__name__}")
            if not os.fspath(checkpoint_path):
                raise ValueError("Trainer.fit: checkpoint_path: expected a file path, got ''")
            if os.path.isdir(checkpoint_path):
                raise IsADirectoryError(f"Trainer.fit: checkpoint_path: {os.fspath(checkpoint_path)!r} is a folder; "
                                        "give a file, e.g. checkpoint.npz")
        elif checkpoint_every:
            raise ValueError(f"Trainer.fit: checkpoint_every={checkpoint_every} needs a checkpoint_path")
        self._bar = Progress(steps, self.step, self.progress)
        window_items, window_seconds = 0, 0.0
        last_eval = ""
        try:
            while self.step < steps:
                stats = self.train_step()
                window_items += stats["items"]
                window_seconds += stats["seconds"]
                if self.eval_every and self.step % self.eval_every == 0 and self.step < steps:
                    result = self._periodic_evaluation()
                    self._record_eval(result)
                    last_eval = " | eval " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()
                                                       if isinstance(v, float))
                if checkpoint_path is not None and checkpoint_every and self.step % checkpoint_every == 0:
                    self.save(checkpoint_path)
                if self.step % self.log_every == 0 or self.step == steps:
                    metrics = "".join(f" | {k} {stats[k]:.3f}" for k in stats if k not in _CORE_KEYS)
                    self._bar.update(self.step, f"loss {stats['loss']:.4f}{metrics} | lr {stats['lr']:.2e} | "
                                                f"{window_items / max(window_seconds, 1e-9):,.0f} items/s" + last_eval)
                    window_items, window_seconds = 0, 0.0
        finally:
            self._bar.close()
            self._bar = None
        result = self.evaluate()
        if result:
            self._record_eval(result)
        if checkpoint_path is not None:
            self.save(checkpoint_path)
        return result

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, history, the data's position and every rank's random stream (the model,
        optimizer and scheduler have their own state dicts). Collective with several ranks."""
        rng = {"cpu": random.global_rng("cpu").bit_generator.state, "dropout": random.dropout_stream().state_dict()}
        state = {"step": self.step, "history": self.history, "world_size": self.group.size,
                 "rank_rng": self.group.gather_object(rng)}
        if hasattr(self.data, "state_dict"):
            state["data"] = self.data.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what state_dict returned (step, history, data position, random streams), all or
        nothing: ValueError or TypeError naming what is wrong, and nothing changes."""
        self.prepare_load_state_dict(state)()

    def prepare_load_state_dict(self, state: dict[str, Any]) -> Callable[[], None]:
        """Check `state` (ValueError or TypeError naming what is wrong) and return the function
        that loads it, which cannot fail: the data stream's state is first loaded into a copy."""
        if not isinstance(state, dict) or not isinstance(state.get("history"), dict):
            raise ValueError(f"expected a dict with 'step' and 'history', got {type(state).__name__}")
        step = check_int(state.get("step"), "step", "Trainer.prepare_load_state_dict", at_least=0)
        self._check_history(state["history"])
        for name, owner in self._state_owners():
            if name in state:
                copy.deepcopy(owner).load_state_dict(state[name])  # raises here, or loads below too
        saved_rngs = state.get("rank_rng")
        if saved_rngs is not None:
            if not isinstance(saved_rngs, list):
                raise ValueError(f"rank_rng: expected a list, got {type(saved_rngs).__name__}")
            stream = random.Philox()
            for saved in saved_rngs:
                if not isinstance(saved, dict) or set(saved) != {"cpu", "dropout"}:
                    raise ValueError(f"rank_rng: expected {{'cpu': ..., 'dropout': ...}} per rank, got {saved!r:.80}")
                bit_generator(saved["cpu"], "rank_rng/cpu", like=random.global_rng("cpu").bit_generator)
                stream.load_state_dict(saved["dropout"])

        def apply():
            self.step, self.history = step, state["history"]
            for name, owner in self._state_owners():
                if name in state:
                    owner.load_state_dict(state[name])
            self._restore_rank_rng(saved_rngs)
        return apply

    def _check_history(self, history):
        """ValueError unless train_step can append to `history`: a list for every entry (those of
        an empty history included), layer_grad_norm a dict with a list for each of the model's layers."""
        entries = [k for k in {**self._empty_history(), **history} if k != "layer_grad_norm"]
        layers = history.get("layer_grad_norm")
        if (not all(isinstance(history.get(k), list) for k in entries) or not isinstance(layers, dict)
                or not all(isinstance(layers.get(name), list) for name in self.layers)):
            raise ValueError(f"history: expected a list for each of {sorted(self._empty_history())} and every "
                             f"other entry, and layer_grad_norm holding a list for each of {sorted(self.layers)}; "
                             f"got {str(history)[:200]}")

    def _state_owners(self):
        """(key in the state dict, object with its own load_state_dict) pairs."""
        return [("data", self.data)] if hasattr(self.data, "load_state_dict") else []

    def _restore_rank_rng(self, saved_rngs):
        if saved_rngs and len(saved_rngs) == self.group.size:  # same ranks: each continues its streams
            random.global_rng("cpu").bit_generator.state = saved_rngs[self.group.rank]["cpu"]
            random.dropout_stream().load_state_dict(saved_rngs[self.group.rank]["dropout"])
        elif self.group.size > 1:  # another number of ranks: new independent streams
            split_random_streams(self.group)

    def save(self, path: str | os.PathLike) -> str | os.PathLike:
        """A checkpoint of everything needed to continue exactly (see `resume`), plus
        extra_state, written by rank 0 (every rank calls it). The model is saved unwrapped: it
        loads in one process, or on any number of ranks. Returns path."""
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            self.optimizer.consolidate_state_dict()
        trainer_state = self.state_dict()
        if self.group.rank == 0:
            save_checkpoint(path, self.module, self.optimizer, self.scheduler, step=self.step,
                            trainer=trainer_state, **self.extra_state)
        return path

    def resume(self, path: str | os.PathLike) -> dict[str, Any]:
        """Load a checkpoint written by `save` (by any number of ranks) into this trainer's
        model, optimizer, scheduler, random generators and data stream, all or nothing. Every
        rank reads the file. Returns the checkpoint dict. Raises what load_checkpoint raises."""
        return load_checkpoint(path, self.module, self.optimizer, self.scheduler, state_targets={"trainer": self})


_CORE_KEYS = ("step", "loss", "lr", "grad_norm", "items", "seconds")


class Seq2SeqTrainer(Trainer):
    """Trains an encoder-decoder (`Seq2SeqTransformer`) on a `data.SequenceTask`.

    Each step: a fresh global batch of batch_size sequences from the task (this rank's share of
    it), teacher-forced cross-entropy (PAD ignored, optional label smoothing) and token accuracy.
    Evaluation decodes held-out sequences greedily and scores exact-sequence and token
    accuracy, the held-out set split across ranks. eval_size: how many held-out sequences the
    evaluations every eval_every steps use (None: all); the final one uses all.
    eval_batch_size: sequences decoded at once. Other options (**options): those of `Trainer`.
    """

    def __init__(self, model: Module, optimizer: Optimizer, task: SequenceTask, *, batch_size: int = 64,
                 label_smoothing: float = 0.0, eval_size: int | None = None, eval_batch_size: int = 500,
                 **options: Any):
        if not isinstance(task, SequenceTask):
            raise TypeError(f"task: expected a npformer.data.SequenceTask, got {type(task).__name__}")
        self.task = task
        self.batch_size = check_int(batch_size, "batch_size", "Seq2SeqTrainer", at_least=1)
        self.label_smoothing = check_real(label_smoothing, "label_smoothing", "Seq2SeqTrainer", at_least=0, at_most=1)
        self.eval_size = None if eval_size is None else check_int(eval_size, "eval_size", "Seq2SeqTrainer", at_least=1)
        self.eval_batch_size = check_int(eval_batch_size, "eval_batch_size", "Seq2SeqTrainer", at_least=1)
        group = model.group if isinstance(model, DistributedDataParallel) else comm.LOCAL
        shard(self.batch_size, group.rank, group.size)  # a clear error now if the batch cannot be shared

        def next_batch():
            return task.batch(self.batch_size, group.rank, group.size)

        super().__init__(model, optimizer, next_batch, seq2seq_loss(self.label_smoothing), **options)

    def evaluate(self, sequences: int | None = None, use_cache: bool = True) -> dict[str, Any]:
        """Greedy-decode held-out sequences (default: all; or the first `sequences`), each rank
        its share, and score them. Returns {"exact_match", "token_accuracy", "sequences"}.
        use_cache=False decodes without the KV cache (slower; for comparison)."""
        task = self.task
        heldout = task.heldout if sequences is None else task.heldout[:sequences]
        mine = heldout[self.group.rank * len(heldout) // self.group.size:
                       (self.group.rank + 1) * len(heldout) // self.group.size]
        exact = correct = total = 0
        for start in range(0, len(mine), self.eval_batch_size):
            batch = task.collate(mine[start:start + self.eval_batch_size])
            predicted = greedy_decode(self.module, batch.src, task.max_target_len,
                                      eos=EOS if task.eos else None, use_cache=use_cache)
            e, c, t = task.score(predicted, batch.tgt_out)
            exact, correct, total = exact + e, correct + c, total + t
        exact, correct, total = self.group.sum([exact, correct, total])
        return {"exact_match": exact / max(len(heldout), 1), "token_accuracy": correct / max(total, 1),
                "sequences": len(heldout)}

    def _periodic_evaluation(self):
        return self.evaluate(self.eval_size)

    def state_dict(self) -> dict[str, Any]:
        """Trainer's state plus the task's training stream ("task")."""
        return {**super().state_dict(), "task": self.task.state_dict()}

    def _state_owners(self):
        return super()._state_owners() + [("task", self.task)]
