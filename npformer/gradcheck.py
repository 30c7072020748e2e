"""The gradient-check suite as a command: every case of the op-case registry (npformer.opcases:
every functional op and nn module, on ordinary inputs and their edge cases), or the cases of
your own module.

    python -m npformer.gradcheck [-k SUBSTRING] [--module MODULE] [--no-torch] [--no-modules] [--device DEVICE]
                                 [--no-second-order] [--no-forward-mode] [--require COLUMNS]
                                 [--time-limit SECONDS (or --timeout, as python -m npformer.exercises)]

One row per case, each column judged on its own: `autograd.gradcheck` in float64 (every input
and parameter against central finite differences, eps 1e-6, pass when |yours - reference| <=
1e-5 + 1e-3 |reference| everywhere, yours the backward's gradient and the reference the
differences; then one random direction over all inputs together, an in-place write into the
upstream gradient and the same values in non-contiguous arrays), then outputs and gradients
against torch in float64 and float32 (when torch is installed and the case has a torch
reference) and against the case's twin (for npformer's own ops the composite twin: the same
code run with npformer.functional's ops swapped for the slow versions built from autograd
primitives), to the registry's tolerances; then "create_graph = plain": the first derivative taken
with create_graph=True (each op's differentiable_backward, what second derivatives differentiate)
against the plain backward's, to 1e-10 of the largest entry (`autograd.gradcheck.check_create_graph`;
no torch needed; where they differ and create_graph's agrees with finite differences, the plain
backward is the wrong one and fails its own columns only); then "second order":
`autograd.gradgradcheck` against finite differences and the Hessian-vector product against
torch's double backward (not judged where the first derivative already differs), and "forward
mode": the jvp rules against finite differences and the transpose identity (where the
backward is right: `gradcheck(check_forward_ad=True, check_backward_ad=False)`) and J u against
`torch.func.jvp` (float64, torch's attention on its math backend), each cell the worse of its
two checks. An op that is differentiable once (has no jvp rule) shows "not defined" in the
second-order (forward-mode) column and passes, unless the case (`OpCase.require`; npformer's
own cases require both) or --require asks for it: then the column fails with the error naming
the op. "abs" is the largest absolute difference (NaN where one is), "rel" that divided by the
largest reference magnitude. Losses use a random upstream gradient, never a plain sum(). Under
a row, the messages name the input, the worst index, yours and the reference's values and,
where it can be told, the kind of mistake; a column that raises is an ERROR cell with the
exception (a later column raising the same error is "not judged"), and a case that does not
return within --time-limit seconds a TIME LIMIT cell: the table goes on.

--module MODULE imports your module (a dotted name, `mypkg.ops`, or a path, `mypkg/ops.py`:
Functions and the cases it registers with `npformer.opcases.register`) and runs only its cases.
Exit status 1 when any row fails, 2 for a usage error: -k matches no case, --module cannot be
imported (or does not return within the time limit) or registers no case, --require names an
unknown column, or --device names a device that is not there.
"""
import argparse
import contextlib
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import numpy as np

from autograd import GradcheckError, backend
from npformer import interop, opcases

__all__ = ["COLUMNS", "DEFAULT_TIME_LIMIT", "TimeLimitExceeded", "main", "run", "run_case", "summary",
           "time_limit"]

DEFAULT_TIME_LIMIT = 300.0  # seconds per case: the library's largest (nn.Transformer) needs a small part of it

COLUMNS = {"fd": "finite differences", "torch": "torch float64", "torch32": "torch float32", "twin": "twin",
           "create_graph": "create_graph = plain", "second": "second order", "forward": "forward mode"}


def _finite_differences(check, case, rng, device, only=None):
    """(max abs, max rel, passed) of an autograd.gradcheck-style `check` of the case (its report's
    entries whose name starts with `only`, else all), and its message on failure."""
    report = []
    try:
        passed, message = check(case, rng, device, report=report), None
    except GradcheckError as e:
        passed, message = False, str(e)
    report = [entry for entry in report if only is None or entry[0].startswith(only)]
    worst = _largest(err for _, err, _ in report)
    scale = _largest(magnitude for _, _, magnitude in report)
    return (worst, worst / scale if scale else 0.0, passed), message


def _largest(values) -> float:
    """The largest of some floats, NaN when one is NaN (a NaN must show in its cell), 0 for none."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def _compared(comparison):
    return ((comparison.max_abs, comparison.max_rel, comparison.passed),
            "; ".join(comparison.failures + comparison.notes) or None)


def _both(case, torch, rng, device, check, compared, only=None):
    """One column from finite differences (`check`, see _finite_differences) and, with torch and a
    torch reference, `compared` (case, torch, rng, device) -> Comparison: the larger abs and rel,
    passed when both passed; their messages, each named."""
    (fd_abs, fd_rel, fd_passed), fd_message = _finite_differences(check, case, rng, device, only)
    if torch is None or case.torch is None:
        return (fd_abs, fd_rel, fd_passed), fd_message
    (t_abs, t_rel, t_passed), t_message = _compared(compared(case, torch, rng, device))
    messages = [m for m in (fd_message and f"finite differences: {fd_message}",
                            t_message and f"torch: {t_message}") if m]
    return ((_largest([fd_abs, t_abs]), _largest([fd_rel, t_rel]), fd_passed and t_passed),
            "\n".join(messages) or None)


class TimeLimitExceeded(BaseException):
    """A case ran past the time limit (a BaseException: a user's `except Exception` cannot swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise TimeLimitExceeded in the block after `seconds` (None or 0: no limit). A timer signal
    (SIGALRM): it interrupts Python code, such as a loop that never ends, not one long call into
    compiled code until that returns; off the main thread, or where there is no SIGALRM, no limit."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise TimeLimitExceeded(seconds)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_RULES = {"second-order": ("second", "differentiable_backward", "differentiable once"),
          "forward-mode": ("forward", "jvp", "no forward-mode rule")}


def run_case(case: opcases.OpCase, torch: Any = None, seed: int = 0, device: str = "cpu",
             second_order: bool = True, forward_mode: bool = True, require: Sequence[str] = (),
             seconds: float | None = None) -> dict:
    """One row: {"name", "fd", "torch", "torch32", "twin", "create_graph", "second", "forward": (abs,
    rel, passed), "ERROR", "NOT DEFINED", "NOT JUDGED", "TIME LIMIT" or None (not run), "messages":
    what failed (or was not judged), by column, "passed"}. A column that raises is an ERROR cell
    and its exception a message: the row fails, the table goes on; a later column that raises the
    same error (a backward that returns a wrong dtype, in every column that runs it) is "not
    judged", so that the mistake fails one column. Floating-point warnings are off: a NaN or inf
    shows in its cell and its message names the entry.
    second_order, forward_mode: run those columns (gradgradcheck and the HVP against torch;
    forward mode judged on its own and the JVP against torch.func.jvp). require: higher columns
    that must be defined (opcases.REQUIREMENTS), besides the case's own `require`: a case whose
    ops lack a differentiable_backward (a jvp rule) shows "not defined" in a column that is not
    required, and passes; in a required one the engine's error names the op and the row fails.
    seconds: the time limit of the row (see `time_limit`): a case that does not return in time
    is a TIME LIMIT cell, "did not return within N s", and the table goes on."""
    checks = {
        "fd": case.finite_differences and (lambda rng: _finite_differences(opcases.gradcheck_case, case, rng, device)),
        "torch": torch is not None and case.torch is not None
        and (lambda rng: _compared(opcases.compare_with_torch(case, torch, rng, device))),
        "torch32": torch is not None and case.torch is not None and case.float32
        and (lambda rng: _compared(opcases.compare_with_torch(case, torch, rng, device, "float32"))),
        "twin": case.twin is not None and (lambda rng: _compared(opcases.compare_with_twin(case, rng, device))),
        "create_graph": (lambda rng: _finite_differences(opcases.create_graph_case, case, rng, device)),
        "second": second_order and case.finite_differences and (lambda rng: _both(
            case, torch, rng, device, opcases.gradgradcheck_case, opcases.compare_hvp_with_torch)),
        "forward": forward_mode and case.finite_differences and (lambda rng: _both(
            case, torch, rng, device, opcases.forward_mode_case, opcases.compare_jvp_with_torch,
            only=opcases.FORWARD_MODE_CHECKS)),
    }
    required = set(case.require) | set(require)
    row = {"name": case.name, "messages": [], **{column: None for column in COLUMNS}}
    column, timed_out, raised = None, False, {}
    try:
        with time_limit(seconds):
            undefined = _undefined(case, seed, device, [r for r in opcases.REQUIREMENTS if r not in required
                                                        and checks[_RULES[r][0]]])
            for column, check in checks.items():
                if not check:
                    continue
                if column in undefined:
                    row[column] = "NOT DEFINED"
                    row["messages"].append(f"{COLUMNS[column]}: {undefined[column]}")
                    continue
                try:
                    with np.errstate(all="ignore"):   # a NaN or inf is judged where it lands, its entry named
                        row[column], message = check(np.random.default_rng(seed))
                except Exception as e:  # noqa: BLE001  (a broken case is a row of the table, never its end)
                    row[column], message = "ERROR", f"{type(e).__name__}: {e}"
                    if message in raised:   # the same error again (the backward's, in every column that runs it)
                        row[column], message = "NOT JUDGED", f"not judged: the error of {COLUMNS[raised[message]]}"
                    raised.setdefault(message, column)
                if message:
                    row["messages"].append(f"{COLUMNS[column]}: {message}")
    except TimeLimitExceeded:
        timed_out = True
        if column is not None:
            row[column] = "TIME LIMIT"
        row["messages"].append(f"{COLUMNS[column] if column else 'the case'}: did not return within {seconds:g} s "
                               "(the time limit: --time-limit)")
    row["passed"] = not timed_out and all(row[c] in (None, "NOT DEFINED", "NOT JUDGED") or isinstance(row[c], tuple) and row[c][2]
                                          for c in COLUMNS)
    return row


def _undefined(case, seed, device, optional):
    """{column: why it is not defined} for the `optional` requirements whose rule some op of the
    case lacks; {} when the case cannot even run (its columns then show the error)."""
    if not optional:
        return {}
    try:
        missing = opcases.undefined_rules(case, np.random.default_rng(seed), device)
    except Exception:  # noqa: BLE001  (the columns report it)
        return {}
    result = {}
    for requirement in optional:
        column, rule, what = _RULES[requirement]
        if missing[requirement]:
            result[column] = (f"not defined: {', '.join(missing[requirement])} has no {rule} ({what}); "
                              f"--require {requirement} (or OpCase(require=(\"{requirement}\",))) makes this a failure")
    return result


_VERDICT = re.compile(r": wrong|in-place write|max abs difference|did not return|Error: |: shape ")
_WORST = re.compile(r"^(?P<what>.*?): wrong, max diff \S+(?P<nonfinite>, yours has [^(]*\([^)]*\)\))?, "
                    r"worst at index (?P<index>\([^)]*\)): yours (?P<yours>\S+), reference (?P<reference>[^ ;]+)")


def summary(row: dict, name: bool = True) -> str:
    """A failed row in one line, the essentials first: the first failing column's first verdict that
    names an input and an entry ("x: wrong at index (2, 1): yours 0.505194, reference 0.00657986"),
    the column and the other failing columns, after the case's name (name=False: without it).
    "<case>: passed" for a row that passed."""
    failing = [c for c in COLUMNS if row[c] not in (None, "NOT DEFINED", "NOT JUDGED") and not (isinstance(row[c], tuple) and row[c][2])]
    prefix = f"{row['name']}: " if name else ""
    if not failing and row["passed"]:
        return f"{prefix}passed"
    by_column = {message.split(":", 1)[0]: message for message in row["messages"]}
    first = COLUMNS[failing[0]] if failing else next(iter(by_column), "the case")
    lines = [line.strip() for line in by_column.get(first, "").splitlines()]
    line = next((line for line in lines if _VERDICT.search(line)), lines[0] if lines else "failed")
    line = line.removeprefix(f"{first}: ").removeprefix("finite differences: ").removeprefix("torch: ")
    worst = _WORST.match(line)
    if worst:
        line = (f"{worst['what']}: wrong at index {worst['index']}: yours {float(worst['yours']):.6g}, "
                f"reference {float(worst['reference']):.6g}{worst['nonfinite'] or ''}")
    elif "in-place write" not in line:
        line = line.split("; ")[0]
    others = [COLUMNS[c] for c in failing[1:]]
    return f"{prefix}{line} ({first}" + (f"; also failed: {', '.join(others)})" if others else ")")


def _cell(result):
    """A column's text, 20 characters: abs and rel ("nan" where one is NaN), "!" after a failed one."""
    if result is None:
        return f"{'-':>9} {'-':>9} "
    if result in ("ERROR", "TIME LIMIT"):
        return f"{result:>19} "
    if result in ("NOT DEFINED", "NOT JUDGED"):
        return f"{result.lower():>19} "
    return f"{result[0]:9.1e} {result[1]:9.1e}" + (" " if result[2] else "!")


def run(cases: Sequence[opcases.OpCase], torch: Any = None, stream: TextIO | None = None, seed: int = 0,
        device: str = "cpu", second_order: bool = True, forward_mode: bool = True, require: Sequence[str] = (),
        seconds: float | None = None, rows: list | None = None) -> bool:
    """Run `cases`, print the table to `stream` (stdout), the messages of a row under it (what
    failed, what is not defined); returns True when every row passed. second_order,
    forward_mode, require, seconds: see run_case. rows: a list, or None; each row is appended."""
    stream = stream or sys.stdout
    width = max([len("case")] + [len(c.name) for c in cases])
    stream.write(f"{'case':<{width}} | " + " | ".join(f"{title:^20}" for title in COLUMNS.values()) + " | result\n")
    stream.write(f"{'':<{width}} | " + " | ".join(f"{'max abs':>9} {'max rel':>9} " for _ in COLUMNS) + " |\n")
    all_passed = True
    for case in cases:
        row = run_case(case, torch, seed, device, second_order, forward_mode, require, seconds)
        if rows is not None:
            rows.append(row)
        all_passed &= row["passed"]
        cells = " | ".join(_cell(row[c]) for c in COLUMNS)
        stream.write(f"{row['name']:<{width}} | {cells} | {'PASS' if row['passed'] else 'FAIL'}\n")
        for message in row["messages"]:
            stream.write("".join(f"    {line}\n" for line in message.splitlines()))
        stream.flush()
    return all_passed


def main(argv: Sequence[str] | None = None) -> int:
    """The command: parse `argv` (sys.argv[1:]), run the table; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m npformer.gradcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="pattern", default="", help="only cases whose name or op family contains this")
    parser.add_argument("--module", help="import this module (yours: mypkg.ops) and run only the cases it registers")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch comparisons")
    parser.add_argument("--no-modules", action="store_true", help="functional ops only")
    parser.add_argument("--no-second-order", action="store_true", help="skip the second-order column")
    parser.add_argument("--no-forward-mode", action="store_true", help="skip the forward-mode column")
    parser.add_argument("--require", default="", metavar="COLUMNS",
                        help="higher columns every case must define, comma-separated: "
                             f"{','.join(opcases.REQUIREMENTS)} (else an op without a double backward or a jvp rule "
                             "shows 'not defined' there, unless its case requires it)")
    parser.add_argument("--time-limit", "--timeout", dest="time_limit", type=float, default=DEFAULT_TIME_LIMIT,
                        metavar="SECONDS",
                        help="a case (and importing --module) that does not return within this many seconds is a "
                             "failed row, and the table goes on (0: no limit; default %(default)g)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "test", "cuda"],
                        help="where npformer runs (torch runs on the CPU)")
    args = parser.parse_args(argv)
    if not 0 <= args.time_limit < math.inf:
        parser.error(f"--time-limit: expected a number of seconds >= 0 (0: no limit), got {args.time_limit}")
    require = [r.strip() for r in args.require.split(",") if r.strip()]
    unknown = [r for r in require if r not in opcases.REQUIREMENTS]
    if unknown:
        parser.error(f"--require: expected a comma-separated list of {', '.join(opcases.REQUIREMENTS)}, "
                     f"got {', '.join(unknown)}")
    skipped = {"second-order": args.no_second_order, "forward-mode": args.no_forward_mode}
    if any(skipped[r] for r in require):
        parser.error(f"--require {args.require}: a required column cannot be skipped (--no-second-order, "
                     "--no-forward-mode)")
    try:
        backend.module_for(args.device)
    except RuntimeError as e:  # cuda without CuPy or a GPU: say so before the first case
        parser.error(f"--device {args.device}: {e}")
    among = None
    if args.module:
        try:
            with time_limit(args.time_limit):
                among = opcases.from_module(args.module)
        except TimeLimitExceeded:
            parser.error(f"--module {args.module}: importing it did not return within {args.time_limit:g} s")
        except Exception as e:  # noqa: BLE001  (the user's module: what importing it raised)
            parser.error(f"--module {args.module}: importing it raised {type(e).__name__}: {e}")
        if not among:
            parser.error(f"--module {args.module}: it registers no case "
                         "(call npformer.opcases.register(OpCase(...)) in it)")
    cases = opcases.select(args.pattern, modules=not args.no_modules, among=among)
    if not cases:
        print(f"no case matches -k {args.pattern!r}{' without modules' if args.no_modules else ''}; "
              f"the op families are: {', '.join(opcases.FAMILIES)}", file=sys.stderr)
        return 2
    torch = None
    if not args.no_torch:
        try:
            torch = interop._torch()
        except ImportError:
            print("torch is not installed: the torch columns are skipped")
    start = time.perf_counter()
    passed = run(cases, torch, device=args.device, second_order=not args.no_second_order,
                 forward_mode=not args.no_forward_mode, require=require, seconds=args.time_limit)
    print(f"{len(cases)} checks in {time.perf_counter() - start:.1f} s: {'all passed' if passed else 'FAILURES'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
