"""The gradient-check suite as a command: every case of the op-case registry (npformer.opcases:
every functional op and nn module, on ordinary inputs and their edge cases), in float64.

    python -m npformer.gradcheck [-k SUBSTRING] [--no-torch] [--no-modules] [--device DEVICE]

One row per case: `autograd.gradcheck` (every input and parameter against central finite
differences, eps 1e-6, pass when |analytic - numeric| <= 1e-5 + 1e-3 |numeric| everywhere, then
one random direction over all inputs together), then outputs and gradients against torch (when
it is installed) and against the composite twin (the same code run with npformer.functional's
ops swapped for the slow versions built from autograd primitives), to the registry's tolerances.
"abs" is the largest absolute difference, "rel" that divided by the largest reference magnitude.
Losses use a random upstream gradient, never a plain sum(). Exit status 1 when any row fails,
2 for a usage error: -k matches no case, or --device names a device that is not there.
"""
import argparse
import sys
import time

import numpy as np

from autograd import GradcheckError, backend
from npformer import interop, opcases


def _finite_differences(case, rng, device):
    """(max abs, max rel, passed) of autograd.gradcheck over the case."""
    report = []
    try:
        passed = opcases.gradcheck_case(case, rng, device, report=report)
    except GradcheckError:
        passed = False
    worst = max((err for _, err, _ in report), default=0.0)
    scale = max((magnitude for _, _, magnitude in report), default=0.0)
    return worst, worst / scale if scale else 0.0, passed


def run_case(case, torch=None, seed=0, device="cpu"):
    """One row: {"name", "fd", "torch", "twin": (abs, rel, passed) or None, "passed"}."""
    def columns(comparison):
        return comparison.max_abs, comparison.max_rel, comparison.passed

    row = {"name": case.name, "fd": None, "torch": None, "twin": None}
    if case.finite_differences:
        row["fd"] = _finite_differences(case, np.random.default_rng(seed), device)
    if torch is not None and case.torch is not None:
        row["torch"] = columns(opcases.compare_with_torch(case, torch, np.random.default_rng(seed), device))
    if case.twin:
        row["twin"] = columns(opcases.compare_with_twin(case, np.random.default_rng(seed), device))
    row["passed"] = all(r[2] for r in (row["fd"], row["torch"], row["twin"]) if r is not None)
    return row


def _cell(result):
    if result is None:
        return f"{'-':>9} {'-':>9}"
    return f"{result[0]:9.1e} {result[1]:9.1e}" + ("" if result[2] else "!")


def run(cases, torch=None, stream=None, seed=0, device="cpu"):
    """Run `cases`, print the table to `stream` (stdout); returns True when every row passed."""
    stream = stream or sys.stdout
    width = max([len("case (float64)")] + [len(c.name) for c in cases])
    stream.write(f"{'case (float64)':<{width}} | {'finite differences':^19} | {'torch':^19} | "
                 f"{'composite twin':^19} | result\n")
    stream.write(f"{'':<{width}} | " + " | ".join(f"{'max abs':>9} {'max rel':>9}" for _ in range(3)) + " |\n")
    all_passed = True
    for case in cases:
        row = run_case(case, torch, seed, device)
        all_passed &= row["passed"]
        stream.write(f"{row['name']:<{width}} | {_cell(row['fd']):<19} | {_cell(row['torch']):<19} | "
                     f"{_cell(row['twin']):<19} | {'PASS' if row['passed'] else 'FAIL'}\n")
        stream.flush()
    return all_passed


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m npformer.gradcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", dest="pattern", default="", help="only cases whose name or op family contains this")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch comparison")
    parser.add_argument("--no-modules", action="store_true", help="functional ops only")
    parser.add_argument("--device", default="cpu", choices=["cpu", "test", "cuda"],
                        help="where npformer runs (torch runs on the CPU)")
    args = parser.parse_args(argv)
    try:
        backend.module_for(args.device)
    except RuntimeError as e:  # cuda without CuPy or a GPU: say so before the first case
        parser.error(f"--device {args.device}: {e}")
    cases = opcases.select(args.pattern, modules=not args.no_modules)
    if not cases:
        print(f"no case matches -k {args.pattern!r}{' without modules' if args.no_modules else ''}; "
              f"the op families are: {', '.join(opcases.FAMILIES)}", file=sys.stderr)
        return 2
    torch = None
    if not args.no_torch:
        try:
            torch = interop._torch()
        except ImportError:
            print("torch is not installed: the torch column is skipped")
    start = time.perf_counter()
    passed = run(cases, torch, device=args.device)
    print(f"{len(cases)} checks in {time.perf_counter() - start:.1f} s: {'all passed' if passed else 'FAILURES'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
