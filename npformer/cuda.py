"""CUDA graphs for training steps: capture a static-shape step once, replay it for every batch.

A step of a small Transformer launches ~1,500 kernels; from Python each launch costs several
microseconds of host time, so the GPU waits for the host. A CUDA graph records the launches of one
step and replays them all with one call:

    def train_step(src, tgt_in, tgt_out):
        logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.reshape(-1, vocab), tgt_out.reshape(-1), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    step = npformer.cuda.graphed(train_step)          # device="cuda"
    for batch in batches:
        loss = step(*batch)                            # warm-up call(s) eager, then capture, then replays
        scheduler.step()                               # outside the graph: its lr reaches the next replay
        if i % 100 == 0:
            print(loss.item())                         # the only host read (and the id checks' verdicts)

Rules (as torch.cuda.graphs): the step's shapes, dtypes and control flow are fixed (every call
gets arrays of the capture's shapes); the returned objects are the same every time, their
contents rewritten by each replay; host values computed inside the step are frozen at capture
(so nothing in it may read device values: no `.item()`, no `float(...)`), except what npformer
keeps on the device for this purpose: the dropout stream's (seed, offset) advances on the device
(each replay draws the masks an eager step would), Adam's step count and learning rate are
rewritten before each replay (npformer.runtime.graphs.replayed: a scheduler stepped outside the graph
applies), and the deferred id checks (npformer.runtime.deferred) report when the loss is read. Optimizers
other than Adam/AdamW refuse to be captured. Model and optimizer state must exist before the
capture: the first `warmup` calls run eagerly (default 1).

Where it runs: "cuda" (CuPy stream capture into a private memory pool, replayed with
`Graph.launch`); "test", an emulation that records the step's operations and replays them on the
same arrays (npformer.runtime.testdevice), so the same code path is tested without a GPU; "cpu": no graph,
every call runs eagerly.

This module is npformer's public CUDA API (named like torch.cuda, whose graphs it mirrors) and
nothing else: the CUDA kernels and their launchers all live in npformer/functional/cuda/, beside
the kernel tables they register with, and the state a captured step rewrites before each replay
(dropout offsets, Adam's scalars) is graph capture's (npformer.runtime.graphs).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from autograd import Tensor, backend
from npformer.runtime import deferred, graphs, testdevice

__all__ = ["graphed", "GraphedStep"]


class _CudaGraph:
    """A CuPy stream capture into its own memory pool, and its replays."""

    def __init__(self):
        cupy = backend.cupy
        self.pool = cupy.cuda.MemoryPool()   # the graph's memory: no one else allocates from it
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.graph = None

    @contextlib.contextmanager
    def eager(self):
        """A context for the warm-up calls: on the capture stream, like the capture, ordered after
        the work queued before it (the inputs) and before the work queued after it (the results)."""
        cupy = backend.cupy
        current = cupy.cuda.get_current_stream()
        self.stream.wait_event(current.record())
        try:
            with self.stream:
                yield
        finally:
            current.wait_event(self.stream.record())

    def capturing(self, run):
        cupy = backend.cupy
        self.stream.wait_event(cupy.cuda.get_current_stream().record())   # inputs written before
        with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()
            try:
                outputs = run()
            except BaseException:
                try:  # end the (now invalid) capture; the step's own error is the one to report
                    self.stream.end_capture()
                except Exception:
                    pass
                raise
            self.graph = self.stream.end_capture()
        return outputs

    def replay(self):
        cupy = backend.cupy
        current = cupy.cuda.get_current_stream()
        self.stream.wait_event(current.record())   # inputs and replay state written on the current stream
        self.graph.launch(self.stream)
        current.wait_event(self.stream.record())   # later work on the current stream sees the results


class _EmulatedGraph:
    """The test device's stand-in: a recorded run of the step (npformer.runtime.testdevice.Capture)."""

    def __init__(self):
        self.record = None

    @staticmethod
    def eager():
        return contextlib.nullcontext()

    def capturing(self, run):
        self.record = testdevice.Capture()   # a new one: nothing of a capture that failed is replayed
        with self.record:
            return run()

    def replay(self):
        self.record.replay()


class GraphedStep:
    """`fn` captured as a graph on `device` after `warmup` eager calls, then replayed (see the module
    docstring). Calling it copies the arguments into the captured step's static inputs. Made by
    `graphed`; `calls` and `replays` count what it did."""

    def __init__(self, fn: Callable[..., Any], device: str = "cuda", warmup: int = 1):
        if device not in backend.DEVICES:
            raise ValueError(f"graphed: device must be one of {backend.DEVICES}, got {device!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"graphed: warmup must be an integer >= 1 (the optimizer state must exist before "
                             f"the capture), got {warmup!r}")
        if device == "cuda":
            backend.module_for(device)  # a clear error without CuPy or a GPU
        self.fn, self.device, self.warmup = fn, device, warmup
        self.calls = 0
        self.replays = 0
        self.graph = None
        self.capture = None
        self.static = None        # the captured step's inputs (arrays on the device, or Tensors)
        self.outputs = None

    def __call__(self, *args: Any) -> Any:
        """Run the step: eagerly for the first `warmup` calls (and always on "cpu"), then capture
        it once and replay it. Returns what `fn` returned (after the capture: the same objects,
        rewritten by each replay). Arguments: arrays or Tensors (not requiring grad) of the
        captured shapes and dtypes, else TypeError / ValueError."""
        self.calls += 1
        if self.device == "cpu":
            return self.fn(*args)
        if self.graph is None:
            self.graph = _CudaGraph() if self.device == "cuda" else _EmulatedGraph()
        if self.calls <= self.warmup:
            with self.graph.eager():
                return self.fn(*args)
        if self.capture is None:
            self.static = [self._static_input(a, i) for i, a in enumerate(args)]
            self._capture()
        else:
            self._copy_inputs(args)
        self._replay()
        return self.outputs

    # -- inputs ---------------------------------------------------------------------------------------------------
    def _static_input(self, value, i):
        """A device array (or Tensor of one) of the argument's shape and dtype, holding its values."""
        if isinstance(value, Tensor):
            if value.requires_grad:
                raise TypeError(f"graphed: argument {i} is a Tensor that requires grad; pass data (ids, targets, "
                                "inputs) as arrays or plain Tensors, parameters live in the model")
            return Tensor(self._static_input(value.data, i))
        if not backend.is_array(value):
            raise TypeError(f"graphed: argument {i} must be an array or a Tensor (the step's inputs are copied "
                            f"into static buffers), got {type(value).__name__}")
        static = backend.module_for(self.device).empty(value.shape, dtype=value.dtype)
        self._copy_into(static, value)
        return static

    def _copy_into(self, static, value):
        if backend.device_of(value) == self.device:
            backend.get_array_module(static).copyto(static, value)      # on the device
        elif backend.device_of(value) == "cpu":
            backend.copy_from_host(static, value)                         # host to device
        else:
            raise RuntimeError(f"graphed: an argument is on device '{backend.device_of(value)}', the graph on "
                               f"'{self.device}'")

    def _copy_inputs(self, args):
        if len(args) != len(self.static):
            raise TypeError(f"graphed: the captured step took {len(self.static)} arguments, got {len(args)}")
        for i, (static, value) in enumerate(zip(self.static, args)):
            target, value = (static.data, value.data if isinstance(value, Tensor) else value) \
                if isinstance(static, Tensor) else (static, value)
            if not backend.is_array(value) or tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
                raise ValueError(f"graphed: argument {i} must have the captured shape {tuple(target.shape)} and "
                                 f"dtype {target.dtype}, got {getattr(value, 'shape', type(value).__name__)} "
                                 f"{getattr(value, 'dtype', '')}".rstrip())
            self._copy_into(target, value)

    # -- capture and replay ------------------------------------------------------------------------------------------
    def _capture(self):
        """Capture the step; kept only when the whole capture succeeded (after an error the next
        call captures again, instead of replaying part of a step)."""
        capture = graphs.Capture(self.device)
        with graphs.capturing(capture):
            outputs = self.graph.capturing(lambda: self.fn(*self.static))
        self.capture, self.outputs = capture, outputs

    def _replay(self):
        for hook in self.capture.hooks:      # the step's host-side state (dropout offsets, Adam's scalars)
            hook(self.replays)
        self.graph.replay()
        self.replays += 1
        deferred.add_pending(self.capture.checks)


def graphed(fn: Callable[..., Any], device: str = "cuda", warmup: int = 1) -> GraphedStep:
    """A callable that runs `fn(*arrays)` as a captured CUDA graph on `device` (see the module
    docstring): `warmup` eager calls, then one capture, then replays. Returns GraphedStep; like
    torch.cuda.make_graphed_callables for a whole training step. Raises ValueError for an
    unknown device or warmup < 1, RuntimeError for "cuda" without CuPy or a GPU."""
    return GraphedStep(fn, device, warmup)
