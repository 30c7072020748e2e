"""A reusable training loop for sequence-to-sequence tasks (`Trainer`).

One step: a fresh batch from the task, teacher-forced forward pass, cross-entropy (PAD
ignored, optional label smoothing), backward, per-layer gradient norms (every
`grad_norm_every` steps), gradient clipping, optimizer and scheduler steps. Every
`eval_every` steps (and at the end) the held-out set is decoded greedily and scored by
exact-sequence and token accuracy. A progress line shows loss, token accuracy, lr, tokens/s.

Reproducible: the losses depend only on the seeds (`autograd.manual_seed` before building
the model, the task's seed); `save`/`resume` continue exactly where a run stopped.
"""
import math
import sys
import time

from autograd import backend

from . import functional as F
from .checkpoint import load_checkpoint, save_checkpoint
from .data import EOS, PAD
from .decoding import greedy_decode
from .optim import clip_grad_norm_, grad_norm


def layer_of(name):
    """The layer a parameter belongs to, for per-layer gradient norms:
    'encoder.layers.1.self_attn.in_proj_weight' -> 'encoder.layers.1',
    'src_embed.weight' -> 'src_embed'."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[:i + 2])
    return ".".join(parts[:-1]) or name


class _Progress:
    """tqdm when installed, else one line rewritten with a carriage return on a terminal
    (or a new line every ~10% of the run when the output is a file)."""

    def __init__(self, total, initial, enabled):
        self.total, self.enabled, self.bar = total, enabled, None
        self.tty = enabled and sys.stderr.isatty()
        self.last_line = -1
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step, text):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
            return
        width = 20
        filled = int(width * step / max(self.total, 1))
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (width - filled)}] {text}"
        if self.tty:
            sys.stderr.write("\r" + line + "\033[K")
            sys.stderr.flush()
        elif step * 10 // max(self.total, 1) != self.last_line or step == self.total:
            self.last_line = step * 10 // max(self.total, 1)
            print(line, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")


class Trainer:
    """Trains `model` (a Seq2SeqTransformer) on `task` (a `npformer.data.SequenceTask`).

    optimizer / scheduler: from npformer.optim (scheduler.step() after each optimizer step).
    batch_size: sequences per step. label_smoothing: as in F.cross_entropy.
    clip_norm: max global gradient norm (None: no clipping; the norm is still recorded).
    eval_every: decode the held-out set every N steps (0: only when `fit` ends).
    eval_size: how many held-out sequences intermediate evaluations use (None: all);
    the final evaluation of `fit` always uses the whole held-out set.
    grad_norm_every: record per-layer gradient norms every N steps.
    progress: show the progress line. log_every: refresh it every N steps.
    extra_state: a dict saved into every checkpoint of `save` (e.g. the run's settings).
    """

    def __init__(self, model, optimizer, task, *, scheduler=None, batch_size=64, label_smoothing=0.0,
                 clip_norm=1.0, eval_every=0, eval_size=None, eval_batch_size=500, grad_norm_every=10,
                 progress=True, log_every=10, extra_state=None):
        if batch_size < 1:
            raise ValueError(f"batch_size: expected a positive integer, got {batch_size}")
        self.model, self.optimizer, self.task, self.scheduler = model, optimizer, task, scheduler
        self.batch_size, self.label_smoothing, self.clip_norm = batch_size, label_smoothing, clip_norm
        self.eval_every, self.eval_size, self.eval_batch_size = eval_every, eval_size, eval_batch_size
        self.grad_norm_every, self.progress, self.log_every = grad_norm_every, progress, max(1, log_every)
        self.extra_state = dict(extra_state or {})
        self.device = next(iter(model.parameters())).device
        self.layers = {}
        for name, p in model.named_parameters():
            self.layers.setdefault(layer_of(name), []).append(p)
        self.step = 0
        self.history = {
            "step": [], "loss": [], "accuracy": [], "lr": [], "tokens": [], "seconds": [],
            "grad_norm": [],  # total norm before clipping, every step
            "layer_grad_norm_step": [], "layer_grad_norm": {name: [] for name in self.layers},
            "eval_step": [], "eval_exact_match": [], "eval_token_accuracy": [],
        }

    # -- one step ------------------------------------------------------------------------
    def loss_and_accuracy(self, batch):
        """Teacher-forced cross-entropy (a Tensor) and token accuracy (float) of a batch."""
        logits = self.model(batch.src, batch.tgt_in)                           # (B, T, V)
        vocab = logits.shape[-1]
        target = backend.to_device(batch.tgt_out, self.device)                 # (B, T)
        loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), ignore_index=PAD,
                               label_smoothing=self.label_smoothing)
        xp = logits.xp
        valid = target != PAD
        correct = (xp.argmax(logits.data, axis=-1) == target) & valid
        return loss, float(correct.sum()) / max(int(valid.sum()), 1)

    def train_step(self, batch=None):
        """One optimisation step on `batch` (default: a fresh one from the task). Returns a dict
        with loss, accuracy, lr, grad_norm, tokens, seconds."""
        start = time.perf_counter()
        batch = self.task.batch(self.batch_size) if batch is None else batch
        self.model.train()
        lr = self.optimizer.param_groups[0]["lr"]
        loss, accuracy = self.loss_and_accuracy(batch)
        self.optimizer.zero_grad()
        loss.backward()
        self.step += 1
        if self.grad_norm_every and self.step % self.grad_norm_every == 0:
            self.history["layer_grad_norm_step"].append(self.step)
            for name, params in self.layers.items():
                self.history["layer_grad_norm"][name].append(grad_norm(params))
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if self.clip_norm is not None:
            total = float(clip_grad_norm_(params, self.clip_norm))
        else:
            total = grad_norm(params)
        if math.isfinite(total):
            self.optimizer.step()
        else:  # skip the update rather than write NaN into the weights
            print(f"\nstep {self.step}: gradient norm {total}, update skipped", file=sys.stderr)
        if self.scheduler is not None:
            self.scheduler.step()
        record = {"step": self.step, "loss": loss.item(), "accuracy": accuracy, "lr": lr, "grad_norm": total,
                  "tokens": batch.n_tokens, "seconds": time.perf_counter() - start}
        for key, value in record.items():
            self.history[key].append(value)
        return record

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self, sequences=None, use_cache=True):
        """Greedy-decode held-out sequences (default: all; or the first `sequences`) and score
        them. Returns {"exact_match", "token_accuracy", "sequences"}."""
        task = self.task
        heldout = task.heldout if sequences is None else task.heldout[:sequences]
        exact = correct = total = 0
        for start in range(0, len(heldout), self.eval_batch_size):
            batch = task.collate(heldout[start:start + self.eval_batch_size])
            predicted = greedy_decode(self.model, batch.src, task.max_target_len,
                                      eos=EOS if task.eos else None, use_cache=use_cache)
            e, c, t = task.score(predicted, batch.tgt_out)
            exact, correct, total = exact + e, correct + c, total + t
        return {"exact_match": exact / max(len(heldout), 1), "token_accuracy": correct / max(total, 1),
                "sequences": len(heldout)}

    def _record_eval(self, result):
        self.history["eval_step"].append(self.step)
        self.history["eval_exact_match"].append(result["exact_match"])
        self.history["eval_token_accuracy"].append(result["token_accuracy"])

    # -- the loop ------------------------------------------------------------------------
    def fit(self, steps, checkpoint_path=None, checkpoint_every=0):
        """Train until `self.step == steps` (a total: a resumed trainer continues where it
        stopped), evaluating every `eval_every` steps and on the whole held-out set at the end;
        with checkpoint_path, save there every `checkpoint_every` steps and at the end.
        Returns the final evaluation."""
        bar = _Progress(steps, self.step, self.progress)
        window_tokens, window_seconds = 0, 0.0
        last_eval = ""
        try:
            while self.step < steps:
                record = self.train_step()
                window_tokens += record["tokens"]
                window_seconds += record["seconds"]
                if self.eval_every and self.step % self.eval_every == 0 and self.step < steps:
                    result = self.evaluate(self.eval_size)
                    self._record_eval(result)
                    last_eval = f" | held-out exact {result['exact_match']:.3f}"
                if checkpoint_path and checkpoint_every and self.step % checkpoint_every == 0:
                    self.save(checkpoint_path)
                if self.step % self.log_every == 0 or self.step == steps:
                    bar.update(self.step, f"loss {record['loss']:.4f} | acc {record['accuracy']:.3f} | "
                                          f"lr {record['lr']:.2e} | {window_tokens / max(window_seconds, 1e-9):,.0f} tok/s"
                                          + last_eval)
                    window_tokens, window_seconds = 0, 0.0
        finally:
            bar.close()
        result = self.evaluate()
        self._record_eval(result)
        if checkpoint_path:
            self.save(checkpoint_path)
        return result

    # -- state ---------------------------------------------------------------------------
    def state_dict(self):
        """Step, history and the task's random stream (the model, optimizer and scheduler
        have their own state dicts)."""
        return {"step": self.step, "history": self.history, "task": self.task.state_dict()}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.history = state["history"]
        self.task.load_state_dict(state["task"])

    def save(self, path):
        """A checkpoint of everything needed to continue exactly (see `resume`), plus extra_state."""
        return save_checkpoint(path, self.model, self.optimizer, self.scheduler, step=self.step,
                               trainer=self.state_dict(), **self.extra_state)

    def resume(self, path):
        """Load a checkpoint written by `save` into this trainer's model, optimizer,
        scheduler, random generators and task stream. Returns the checkpoint dict."""
        ckpt = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.load_state_dict(ckpt["trainer"])
        return ckpt
