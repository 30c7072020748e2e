"""The gradient-check suite as a command: every case of the op-case registry (npformer.opcases:
every functional op and nn module, on ordinary inputs and their edge cases), or the cases of
your own module.

    python -m npformer.gradcheck [-k SUBSTRING] [--module MODULE] [--no-torch] [--no-modules] [--device DEVICE]
                                 [--no-second-order] [--no-forward-mode]

One row per case: `autograd.gradcheck` in float64 (every input and parameter against central
finite differences, eps 1e-6, pass when |yours - reference| <= 1e-5 + 1e-3 |reference|
everywhere, yours the backward's gradient and the reference the differences; then one random direction over all inputs together), then outputs and gradients
against torch in float64 and float32 (when torch is installed and the case has a torch
reference) and against the case's twin (for npformer's own ops the composite twin: the same
code run with npformer.functional's ops swapped for the slow versions built from autograd
primitives), to the registry's tolerances; then "create_graph = plain": the first derivative taken
with create_graph=True (each op's differentiable_backward, what second derivatives differentiate)
against the plain backward's, to 1e-10 of the largest entry (`autograd.gradcheck.check_create_graph`;
no torch needed); then "second order": `autograd.gradgradcheck` against
finite differences and the Hessian-vector product against torch's double backward, and "forward
mode": `gradcheck(check_forward_ad=True)` and J u against `torch.func.jvp` (float64, torch's
attention on its math backend), each cell the worse of its two checks. An op that is
differentiable once or has no jvp rule fails that column with the error naming it. "abs" is the largest absolute difference, "rel"
that divided by the largest reference magnitude. Losses use a random upstream gradient, never
a plain sum(). Under a failing row, the messages name the input, the worst index, yours and
the reference's values; a case that raises is an ERROR row with the exception.

--module MODULE imports your module (`mypkg.ops`: Functions and the cases it registers with
`npformer.opcases.register`) and runs only its cases. Exit status 1 when any row fails, 2 for
a usage error: -k matches no case, --module cannot be imported or registers no case, or
--device names a device that is not there.
"""
import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np

from autograd import GradcheckError, backend
from npformer import interop, opcases

__all__ = ["COLUMNS", "main", "run", "run_case"]

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
    worst = max((err for _, err, _ in report), default=0.0)
    scale = max((magnitude for _, _, magnitude in report), default=0.0)
    return (worst, worst / scale if scale else 0.0, passed), message


def _compared(comparison):
    return (comparison.max_abs, comparison.max_rel, comparison.passed), "; ".join(comparison.failures) or None


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
    return (max(fd_abs, t_abs), max(fd_rel, t_rel), fd_passed and t_passed), "\n".join(messages) or None


def run_case(case: opcases.OpCase, torch: Any = None, seed: int = 0, device: str = "cpu",
             second_order: bool = True, forward_mode: bool = True) -> dict:
    """One row: {"name", "fd", "torch", "torch32", "twin", "create_graph", "second", "forward": (abs,
    rel, passed), "ERROR" or None (not run), "messages": what failed, by column, "passed"}. A column
    that raises (an op differentiable once, or without a jvp rule: the engine's error names it)
    is an ERROR cell and its exception a message: the row fails, the table goes on.
    second_order, forward_mode: run those columns (gradgradcheck and the HVP against torch;
    check_forward_ad and the JVP against torch.func.jvp)."""
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
    row = {"name": case.name, "messages": []}
    for column, check in checks.items():
        row[column] = None
        if not check:
            continue
        try:
            row[column], message = check(np.random.default_rng(seed))
        except Exception as e:  # noqa: BLE001  (a broken case is a row of the table, never its end)
            row[column], message = "ERROR", f"{type(e).__name__}: {e}"
        if message:
            row["messages"].append(f"{COLUMNS[column]}: {message}")
    row["passed"] = all(row[c] is None or row[c] != "ERROR" and row[c][2] for c in COLUMNS)
    return row


def _cell(result):
    """A column's text, 20 characters: abs and rel, "!" after a failed one."""
    if result is None:
        return f"{'-':>9} {'-':>9} "
    if result == "ERROR":
        return f"{'ERROR':>19} "
    return f"{result[0]:9.1e} {result[1]:9.1e}" + (" " if result[2] else "!")


def run(cases: Sequence[opcases.OpCase], torch: Any = None, stream: TextIO | None = None, seed: int = 0,
        device: str = "cpu", second_order: bool = True, forward_mode: bool = True) -> bool:
    """Run `cases`, print the table to `stream` (stdout), the messages of a failing row under
    it; returns True when every row passed. second_order, forward_mode: see run_case."""
    stream = stream or sys.stdout
    width = max([len("case")] + [len(c.name) for c in cases])
    stream.write(f"{'case':<{width}} | " + " | ".join(f"{title:^20}" for title in COLUMNS.values()) + " | result\n")
    stream.write(f"{'':<{width}} | " + " | ".join(f"{'max abs':>9} {'max rel':>9} " for _ in COLUMNS) + " |\n")
    all_passed = True
    for case in cases:
        row = run_case(case, torch, seed, device, second_order, forward_mode)
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
    parser.add_argument("--device", default="cpu", choices=["cpu", "test", "cuda"],
                        help="where npformer runs (torch runs on the CPU)")
    args = parser.parse_args(argv)
    try:
        backend.module_for(args.device)
    except RuntimeError as e:  # cuda without CuPy or a GPU: say so before the first case
        parser.error(f"--device {args.device}: {e}")
    among = None
    if args.module:
        try:
            among = opcases.from_module(args.module)
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
                 forward_mode=not args.no_forward_mode)
    print(f"{len(cases)} checks in {time.perf_counter() - start:.1f} s: {'all passed' if passed else 'FAILURES'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
