"""python -m npformer.explore RUN_OR_CHECKPOINTS [--out F]: write the explorer of a saved run.

    python -m npformer.explore runs/reverse                  # its explorer.json (or its checkpoints)
    python -m npformer.explore runs/reverse --recompute      # from its checkpoints *.npz
    python -m npformer.explore runs/x/checkpoint-step150.npz runs/x/checkpoint.npz --out x.html

RUN: a run folder of demos/reverse.py. With explorer.json (the data the demo collects while
training, every few steps), the page shows it; otherwise, or with --recompute, each checkpoint
in the folder is one step: the model is loaded and the held-out examples (from the task settings
and seed in the checkpoint's "demo" entry) are run forward and backward again. Checkpoints given
as files must come from one run. The curves come from the latest checkpoint's trainer history.
Default output: explorer.html in the folder of the run (or of the first checkpoint). A bad
source is one line on stderr, exit status 2.
"""
import argparse
import os
import sys

from . import DATA_FILE, ExploreError, from_source, write_page

PROG = "python -m npformer.explore"


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("sources", nargs="+", metavar="RUN_OR_CHECKPOINTS")
    p.add_argument("--out", help="the HTML file to write (default: explorer.html beside the run's checkpoints)")
    p.add_argument("--examples", type=int, default=3, help="held-out examples to show when recomputing (default 3)")
    p.add_argument("--recompute", action="store_true", help=f"use the run folder's checkpoints even where {DATA_FILE} "
                                                            "exists")
    args = p.parse_args(argv)
    if args.examples < 1:
        p.error(f"--examples: expected a positive integer, got {args.examples}")
    try:
        data = from_source(args.sources, args.examples, args.recompute)
    except ExploreError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    first = args.sources[0]
    out = args.out or os.path.join(first if os.path.isdir(first) else os.path.dirname(first) or ".", "explorer.html")
    write_page(out, data)
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.2f} MB, {len(data['snapshots'])} steps)")
    return out


if __name__ == "__main__":
    main()
