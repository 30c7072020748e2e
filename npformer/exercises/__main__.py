"""The exercises as a command.

    python -m npformer.exercises [-o PATH] [--force]   write the starter file (default my_backprop.py)
    python -m npformer.exercises check PATH [--timeout S]   check the backward functions PATH defines
    python -m npformer.exercises train PATH [--steps N] [--seed S] [--out DIR]
                                   train the reversal model on PATH's backward passes beside the engine's

Exit status of `train`: 0 when your run's curve never parts from the engine's, 1 when it
parts or stops, or the file does not import; 2 for a usage error.
Exit status of `check`: 0 when every function is exact or close, 1 while one is wrong, raises,
or is not written, or the file does not import; 2 for a usage error (a missing file, a starter
file that exists already).
"""
import argparse
import os
import pathlib
import sys

from .checker import SolutionImportError, check_file, summary
from .isolated import DEFAULT_TIMEOUT_S
from .starter import write_starter


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        return train_command(argv[1:])
    if argv[:1] == ["check"]:
        parser = argparse.ArgumentParser(prog="python -m npformer.exercises check",
                                         description="Check your backward functions against the engine.")
        parser.add_argument("path", help="your file, e.g. my_backprop.py")
        parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                            help=f"seconds each function may run (default {DEFAULT_TIMEOUT_S:g})")
        args = parser.parse_args(argv[1:])
        if not 0 < args.timeout < float("inf"):
            parser.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
        if not pathlib.Path(args.path).is_file():
            parser.error(f"{args.path}: no such file; write the starter with python -m npformer.exercises")
        try:
            results = check_file(args.path, timeout=args.timeout)
        except SolutionImportError as error:  # the learner's file does not import: say why, as Python would
            print(f"cannot import {args.path}:\n{error}")
            return 1
        print(summary(results))
        return 0 if all(r.passed for r in results) else 1
    parser = argparse.ArgumentParser(prog="python -m npformer.exercises", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", dest="path", default="my_backprop.py", help="where to write (default my_backprop.py)")
    parser.add_argument("--force", action="store_true", help="overwrite the file if it exists")
    args = parser.parse_args(argv)
    try:
        path = write_starter(args.path, force=args.force)
    except FileExistsError as error:
        parser.error(str(error))
    print(f"wrote {path}: fill in the backward functions, then run python -m npformer.exercises check {path}")
    return 0


def train_command(argv):
    parser = argparse.ArgumentParser(prog="python -m npformer.exercises train",
                                     description="Train the reversal model on your backward passes beside the "
                                                 "engine's (npformer/exercises/train.py says how).")
    parser.add_argument("path", help="your file, e.g. my_backprop.py")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each run (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of both runs (default 0)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out sequences decoded (default 200)")
    parser.add_argument("--out", default=os.path.join("runs", "exercises-train"),
                        help="folder of curves.png (default runs/exercises-train)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds each function may run when checked (default {DEFAULT_TIMEOUT_S:g})")
    args = parser.parse_args(argv)
    if not pathlib.Path(args.path).is_file():
        parser.error(f"{args.path}: no such file; write the starter with python -m npformer.exercises")
    if args.steps < 1 or args.heldout < 1:
        parser.error(f"--steps and --heldout: expected positive integers, got {args.steps} and {args.heldout}")
    if not 0 < args.timeout < float("inf"):
        parser.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    from .train import train_file
    try:
        report = train_file(args.path, steps=args.steps, seed=args.seed, out=args.out, heldout=args.heldout,
                            timeout=args.timeout)
    except SolutionImportError as error:
        print(f"cannot import {args.path}:\n{error}")
        return 1
    return 0 if report["yours"] is not None and report["parted"] is None and not report["yours"].stopped else 1


if __name__ == "__main__":
    sys.exit(main())
