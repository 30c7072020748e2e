"""Run a learner's backward, judge each gradient it returns, and print one row per function.

Each gradient is compared with the engine's (npformer.functional's hand-written backward, run by
autograd) and with float64 central differences of the engine's forward:
  exact  the largest difference from the engine is 0, or <= 1e-12 times the gradient's magnitude;
  close  within gradcheck's float64 tolerance (1e-5 + 1e-3 |reference|) of both references;
  wrong  otherwise, with the worst entry (its axes named) and a diagnosis (`diagnoses`).

The learner's code runs in a child process under a time limit (`isolated`): a function that
loops, exits the program or kills its process gets a verdict ("did not return within N s",
"exited the program"), never a pass, and the checking goes on.
"""
import contextlib
import dataclasses
import importlib.util
import io
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TextIO

import numpy as np

from .diagnoses import SPECIFIC, diagnose, matches
from .isolated import DEFAULT_TIMEOUT_S, Unsendable, run_isolated
from .problems import EXERCISES, UPSTREAM, engine_gradients, finite_differences

EXACT_RTOL = 1e-12
# a function's verdict: its worst output's
ORDER = ("exact", "close", "wrong", "error", "timeout", "exited", "not written")


@dataclasses.dataclass
class GradientResult:
    """The verdict on one gradient a backward returns (e.g. dk of attention_backward): exact,
    close or wrong; the largest differences from the engine and from finite differences (None
    when the shape is wrong); for a wrong one, the worst entry and the diagnosis in plain words."""

    name: str
    verdict: str                 # exact, close or wrong
    max_diff: float | None       # largest |yours - engine|; None when the shapes differ
    fd_diff: float | None        # largest |yours - finite differences|
    worst: str = ""              # the worst entry, e.g. "dk[b=1, h=0, j=3, d=2] yours 0.2, correct -0.2"
    diagnosis: str = ""


@dataclasses.dataclass
class Result:
    """The verdict on one backward function: exact, close, wrong, error, timeout (it did not return
    within the time limit), exited (it ended the program: sys.exit, os._exit, a kill) or not written.

    gradients: one GradientResult per returned gradient (empty when the function raised);
    message: why there are none (the exception), or what is wrong with the returned values;
    warning: what about your inputs may hide a mistake (a constant upstream gradient)."""

    name: str
    verdict: str
    gradients: list = dataclasses.field(default_factory=list)
    message: str = ""
    warning: str = ""

    @property
    def passed(self) -> bool:
        """True when every gradient is exact or close."""
        return self.verdict in ("exact", "close")

    def row(self) -> str:
        """The function's line of the table: name, verdict, largest differences, then what is wrong."""
        wrong = [g for g in self.gradients if g.verdict == "wrong"]
        notes = [n for n in (self.warning, self.message) if n]
        notes += [f"{g.worst or g.name}: {g.diagnosis}" for g in wrong]
        columns = [None, None] if any(g.max_diff is None for g in wrong) else [
            max((getattr(g, key) for g in self.gradients), default=None) for key in ("max_diff", "fd_diff")]
        return (f"{self.name:<24} {self.verdict:<12} {_number(columns[0]):>9} {_number(columns[1]):>11}  "
                f"{'; '.join(notes)}").rstrip()


HEADER = f"{'function':<24} {'verdict':<12} {'max diff':>9} {'finite diff':>11}  worst entry: diagnosis"


def _number(x):
    return "-" if x is None else f"{x:.1e}"


def _entry(name, axes, index):
    return f"{name}[" + ", ".join(f"{a}={i}" for a, i in zip(axes, index)) + "]"


def _judge(name, axes, mine, correct, numeric):
    """exact / close / wrong for one gradient of the right shape, and its worst entry."""
    diff = np.abs(mine - correct[name])
    max_diff = float(diff.max()) if diff.size else 0.0
    fd_diff = float(np.abs(mine - numeric).max()) if diff.size else 0.0
    scale = float(np.abs(correct[name]).max()) if diff.size else 0.0
    if max_diff <= EXACT_RTOL * scale:
        return GradientResult(name, "exact", max_diff, fd_diff)
    if matches(mine, correct[name]) and matches(mine, numeric):
        return GradientResult(name, "close", max_diff, fd_diff)
    index = np.unravel_index(int(np.argmax(diff)), diff.shape)
    worst = f"{_entry(name, axes, index)} yours {mine[index]:.4g}, correct {correct[name][index]:.4g}"
    return GradientResult(name, "wrong", max_diff, fd_diff, worst)


def compare(name: str, mine: object, engine: object, numeric: object, *, axes: Sequence[str] | None = None,
            stream: TextIO | None = None) -> GradientResult:
    """Judge one hand-derived gradient that is no exercise of its own (a step inside a backward,
    e.g. attention's dP or dS), like backprop ninja's cmp(): print one line to `stream` (stdout),
    "exact" / "close" / "wrong" as `check` says them, the largest |mine - engine| and |mine -
    numeric|, and for a wrong one its worst entry. engine: the engine's gradient (autograd's
    backward); numeric: finite differences. axes: names for the worst entry's index (default
    axis0, axis1, ...). Returns the GradientResult; ValueError when the shapes differ."""
    mine, engine, numeric = (np.asarray(a, dtype=np.float64) for a in (mine, engine, numeric))
    if not mine.shape == engine.shape == numeric.shape:
        raise ValueError(f"compare: {name}: mine, engine and numeric must have one shape, got "
                         f"{mine.shape}, {engine.shape} and {numeric.shape}")
    axes = tuple(axes) if axes is not None else tuple(f"axis{i}" for i in range(mine.ndim))
    if len(axes) != mine.ndim:
        raise ValueError(f"compare: {name}: axes must name the {mine.ndim} axes of the gradient, got {len(axes)}")
    result = _judge(name, axes, mine, {name: engine}, numeric)
    (stream or sys.stdout).write(f"{name:<16} {result.verdict:<6} max diff {result.max_diff:.1e}  "
                                 f"finite diff {result.fd_diff:.1e}  {result.worst}".rstrip() + "\n")
    return result


def _as_gradients(exercise, returned):
    """The returned value as {name: float64 array}, or the sentence saying why it is not one."""
    names = list(exercise.outputs)
    if len(names) > 1:
        if not isinstance(returned, (tuple, list)) or len(returned) != len(names):
            got = f"{len(returned)} values" if isinstance(returned, (tuple, list)) else type(returned).__name__
            return f"returned {got}, expected a tuple of {len(names)} ({', '.join(names)})"
    elif isinstance(returned, tuple):
        return f"returned a tuple of {len(returned)}, expected one array ({names[0]})"
    else:
        returned = [returned]
    arrays = {}
    for name, value in zip(names, returned):
        if value is None:
            return f"{name} is None, expected an array"
        if isinstance(value, Unsendable):
            return f"{name} is {value.type_name}, expected an array"
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):
            return f"{name} is {type(value).__name__}, expected an array"
        if np.iscomplexobj(array):
            return (f"{name} is complex ({array.dtype}), expected real numbers: the gradient of a real loss "
                    "has no imaginary part")
        if array.dtype.kind != "f":
            what = "an integer array truncates a gradient" if array.dtype.kind in "iub" else \
                f"{type(value).__name__} is no array of numbers"
            return f"{name} has dtype {array.dtype}, expected floating-point numbers ({what})"
        arrays[name] = array.astype(np.float64)
    return arrays


def check(name: str, mine: Callable, *inputs: object, stream: TextIO | None = None,
          timeout: float = DEFAULT_TIMEOUT_S) -> Result:
    """Check the backward `mine` of exercise `name` (e.g. "attention_backward"), print its row
    to `stream` (stdout) and return the Result.

    inputs: the arguments to call it with, in the exercise's order (e.g. q, k, v, mask, dout,
    scale); none: the checker's own, which give every axis a size of its own. mine gets copies,
    so it may change them, and runs in a child process for at most `timeout` seconds. What mine
    raises or returns wrongly, a run past the limit and an exit are reported in the Result. Raises
    KeyError for an unknown name (naming the exercises), TypeError when mine is not callable or
    the number of inputs is wrong, ValueError for inputs the engine cannot take.

    An upstream gradient of yours (dy, dout) that is constant, e.g. all ones as sum() gives, hides
    mistakes (every row of softmax's Jacobian sums to 0): the check then runs again with a
    standard normal one, the Result takes the worse verdict, and its warning says so."""
    if not isinstance(name, str) or name not in EXERCISES:
        raise KeyError(f"check: no exercise {name!r}; the exercises are {', '.join(EXERCISES)}")
    exercise = EXERCISES[name]
    if not callable(mine):
        raise TypeError(f"check: mine must be your {name} function, got {type(mine).__name__}")
    _check_timeout("check", timeout)
    if not inputs:
        inputs = exercise.make_inputs(np.random.default_rng(0))
    if len(inputs) != len(exercise.arguments):
        raise TypeError(f"check: {name} takes {len(exercise.arguments)} inputs ({', '.join(exercise.arguments)}), "
                        f"got {len(inputs)}")
    code_file = getattr(getattr(mine, "__code__", None), "co_filename", None)
    result = _run(exercise, lambda: mine(*_copies(inputs)), inputs, timeout, code_file)
    constant = _constant_upstream(exercise, inputs)
    if constant:
        index = exercise.arguments.index(UPSTREAM[name])
        shape = np.shape(inputs[index])
        randomised = list(inputs)
        randomised[index] = np.random.default_rng(0).standard_normal(shape)
        second = _run(exercise, lambda: mine(*_copies(randomised)), randomised, timeout, code_file)
        words = (f"warning: your upstream gradient {UPSTREAM[name]} is {constant}, which hides mistakes (a "
                 f"softmax's Jacobian rows sum to 0); with a random {UPSTREAM[name]}: {second.verdict}")
        if ORDER.index(second.verdict) > ORDER.index(result.verdict):
            result = second
        result.warning = words
    (stream or sys.stdout).write(result.row() + "\n")
    return result


def _copies(inputs):
    return [np.copy(a) if isinstance(a, np.ndarray) else a for a in inputs]


def _constant_upstream(exercise, inputs):
    """"all ones" or "constant" when the learner's upstream gradient is one value repeated, else ""."""
    if exercise.name not in UPSTREAM:
        return ""
    upstream = np.asarray(inputs[exercise.arguments.index(UPSTREAM[exercise.name])])
    if upstream.size < 2 or upstream.dtype.kind not in "fiu" or not np.all(upstream == upstream.flat[0]):
        return ""
    return "all ones" if upstream.flat[0] == 1 else f"constant ({upstream.flat[0]:g} everywhere)"


def _check_timeout(caller, timeout):
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"{caller}: timeout must be a positive number of seconds, got {timeout!r}")


def _run(exercise, call, inputs, timeout, code_file):
    """The Result of call() (the learner's backward on copies of inputs), run isolated."""
    try:
        graph = exercise.graph(*inputs)
        correct = dict(zip(exercise.outputs, engine_gradients(graph)))
    except (TypeError, ValueError, IndexError) as error:
        raise ValueError(f"check: the engine cannot take these inputs for {exercise.name}"
                         f"({', '.join(exercise.arguments)}): {error}") from error
    outcome = run_isolated(call, timeout, code_file)
    if outcome.kind == "not written":
        return Result(exercise.name, "not written")
    if outcome.kind != "returned":
        return Result(exercise.name, {"raised": "error"}.get(outcome.kind, outcome.kind), message=outcome.message)
    gradients = _as_gradients(exercise, outcome.value)
    if isinstance(gradients, str):
        return Result(exercise.name, "wrong", message=gradients)
    numeric = dict(zip(exercise.outputs, finite_differences(graph)))
    specific = None
    results = []
    for name, axes in exercise.outputs.items():
        ours = gradients[name]
        if not np.all(np.isfinite(ours)):
            index = np.unravel_index(int(np.argmax(~np.isfinite(ours))), ours.shape)
            results.append(GradientResult(name, "wrong", None, None, _entry(name, axes, index), "not a finite number"))
            continue
        verdict = _judge(name, axes, ours, correct, numeric[name]) if ours.shape == correct[name].shape else \
            GradientResult(name, "wrong", None, None)
        if verdict.verdict == "wrong":
            specific = SPECIFIC[exercise.name](*inputs) if specific is None else specific
            verdict.diagnosis = diagnose(exercise, inputs, name, ours, correct, specific)
        results.append(verdict)
    return Result(exercise.name, max((g.verdict for g in results), key=ORDER.index), results)


class SolutionImportError(ImportError):
    """The learner's file does not import: it raises, exits the program or runs past the time
    limit at import. The message is what Python would print (e.g. the SyntaxError and its line)."""


def load_solutions(path):
    """The learner's file as a module (it is their own code: importing it runs it). Raises
    FileNotFoundError when there is no such file; what the file raises comes through."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"check_file: no file {os.fspath(path)!r}")
    spec = importlib.util.spec_from_file_location("npformer_exercises_solution", os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # dataclasses and pickling look their module up
    spec.loader.exec_module(module)
    return module


def _quiet_import(path):
    """The learner's module imported again in a function's child process, what its top level
    prints swallowed (it was printed once, at the first import)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return load_solutions(path)


def _kinds(path):
    """{exercise name: "function", "missing" or what the file's name holds instead}, read in the child."""
    module = load_solutions(path)
    return {name: ("missing" if getattr(module, name, None) is None else
                   "function" if callable(getattr(module, name)) else
                   f"{type(getattr(module, name)).__name__} ({getattr(module, name)!r:.40})")
            for name in EXERCISES}


def _imported(path, timeout):
    """The file's _kinds, imported in a child process; SolutionImportError when it does not import."""
    def kinds():
        try:
            return _kinds(path)
        except Exception as error:  # the learner's file: say why as Python would
            return SolutionImportError("".join(traceback.format_exception_only(error)).rstrip())
    outcome = run_isolated(kinds, timeout)
    if outcome.kind == "returned" and isinstance(outcome.value, SolutionImportError):
        raise outcome.value
    if outcome.kind != "returned":
        raise SolutionImportError(f"importing it {outcome.message or 'raised NotImplementedError'}")
    return outcome.value


def check_file(path: str | os.PathLike, stream: TextIO | None = None,
               timeout: float = DEFAULT_TIMEOUT_S) -> list[Result]:
    """Check every backward the file at `path` defines (a function missing from it counts as not
    written; a name that holds no function is an error of that name alone), printing the table
    to `stream` (stdout). The file is imported, and each function run, in a child process with
    `timeout` seconds each. Returns the Results, one per exercise. Raises FileNotFoundError for
    a missing file, SolutionImportError when the file does not import (it raises, exits or
    loops at import: the message says which)."""
    stream = stream or sys.stdout
    _check_timeout("check_file", timeout)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"check_file: no file {os.fspath(path)!r}")
    kinds = _imported(path, timeout)
    stream.write(HEADER + "\n")
    results = []
    for name, exercise in EXERCISES.items():
        if kinds[name] == "missing":
            result = Result(name, "not written", message=f"{path} defines no {name}")
        elif kinds[name] != "function":
            result = Result(name, "error", message=f"{name} is {kinds[name]}, expected a function")
        else:
            inputs = exercise.make_inputs(np.random.default_rng(0))
            copies = [np.copy(a) if isinstance(a, np.ndarray) else a for a in inputs]
            result = _run(exercise, lambda: getattr(_quiet_import(path), name)(*copies), inputs, timeout,
                          os.path.abspath(path))  # the file name its code objects carry
        stream.write(result.row() + "\n")
        results.append(result)
    return results


def summary(results: Sequence[Result]) -> str:
    """One line: how many functions pass, and which do not."""
    failing = [r.name for r in results if not r.passed]
    return (f"{len(results) - len(failing)} of {len(results)} backward functions pass"
            + (f"; still to fix: {', '.join(failing)}" if failing else ""))
