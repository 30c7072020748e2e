"""Does each piece of npformer's speed machinery earn its place? Each piece on and off, alternated
step by step, on the training steps of four configurations.

    python benchmarks/machinery.py [--configs tiny,demo,gpt_char,base] [--steps N] [--pieces a,b]

--configs: the configurations (default all four); --steps: alternations per piece and configuration
(default 20, base 8: its steps take ~1 s; the whole default run ~10 minutes on 2 cores); --pieces:
the pieces below by name, and "all" (default: every piece, then "all").

Configurations: tiny, gpt_char and base are benchmarks/train_step.py's (its Ours, dropout 0.1,
Adam / AdamW; the recorded step: Ours(cfg, "cpu", recorded=True)); demo is demos/reverse.py's
default preset (no dropout), its trainer's recorded step at the preset's batch of 64, every sequence
of the longest length (benchmarks/demo_step.py's trainer and one_shape: the batch keeps one shape).

For each piece and configuration: the median step time with the piece on and off, the steps
alternating on, off, on, off, ... (one untimed pair first), and off/on (above 1: the piece gains).
At the end a markdown table (piece x configuration, off/on) for BENCHMARKS.md, with a verdict per
piece: KEEP when it gains at least 3% (off/on >= 1.03) on at least one configuration, else
"candidate to delete"; then, with the piece "all": every piece off together against all on, and
the candidates to delete off together against all on (removing them should cost at most 5%).

The pieces and how each is switched off. Library code is not changed: the switches are the
library's own settings, or monkeypatches in this process.
- lookahead: NPFORMER_LOOKAHEAD=0 (npformer.runtime.lookahead reads it at each pass's first mask).
- small-mask-grouping: lookahead.SMALL_MASK = 0: no mask counts as small, none shares a draw
  (random's draw_together is never called); the masks are drawn ahead one by one.
- host-memory: NPFORMER_HOST_MEMORY=release. It is applied at import, so two worker processes
  (this script with --worker, one with keep, one with release) run the steps, alternately.
- recorded: the eager step (Ours(cfg, "cpu"), the trainer with record_steps=False) against the
  recorded one (a second model, built the same way).
- thread-pool: npformer.set_num_threads(1) against its default (with 1 thread BLAS gets its own
  threads back, and nothing is drawn ahead).
- blas-threads: threads.run_on_blas_threads replaced by a plain call (products too small to
  split run on BLAS's one thread; MIN_BLAS_THREADS_MACS).
- side-by-side: threads.side_by_side replaced by its own fallback (each piece of work on its
  row blocks, one after the other).
- cpu:<module>: every kernel table in npformer.runtime.kernels.TABLES that has a "cpu"
  implementation (a thread split or a CPU variant), grouped by the module of its reference: the
  module's tables lose their "cpu" implementation, so the reference runs.
- adam-grouping: Adam's _Together.step returns nothing: every parameter is updated alone.
- optimizer-scratch: Optimizer._scratch_like returns a new array instead of a view of the shared
  scratch buffer.
- philox-fresh-rounds: random._counter_words_cpu replaced by the generic _counter_words (the ten
  Philox rounds in full, without _fresh_rounds' cheaper first three).
- philox-scratch: random._scratch replaced by an object that keeps nothing, so each mask draw
  makes its temporaries afresh.
A switch is applied between steps, never inside the timed step (the thread pool's new threads
are started before the step). In the recorded step, ops chosen when it was recorded stay chosen:
with cpu:functional.attention off, its replays run the references of the flash path recorded,
where an eager step would choose the naive path (the "all" row records with everything off).

Found and not switched: the per-thread flag classes (threading.local subclasses with class-level
defaults, read without a miss: threads._Local, kernels._Mode, lookahead._Local, record._Local,
graphs._Local; also autograd's _Modes and _ForwardLevels, nn.module._Inference,
functional._common._Twins); threads.Task (a lighter fork-join hand-off than concurrent.futures'
Future) and run_tasks' taking back of blocks the pool has not started; kernels._REASONS (the
reasons of choose, made once per device); the tuned sizes (threads.MIN_PARALLEL_ENTRIES and
MIN_PARALLEL_MACS, random._CHUNK and _PARALLEL_CHUNK, lookahead.GROUP_VALUES): sizes, not pieces;
threads.blas_threads_in_caller (decoding only, not in a training step); deferred checks and
graphs (device code: on the CPU a check runs at once).
"""
import argparse
import inspect
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import demo_step  # noqa: E402
import train_step  # noqa: E402

import npformer  # noqa: E402
from autograd import backend  # noqa: E402
from npformer.optim import optimizer as optimizers  # noqa: E402
from npformer.runtime import kernels, lookahead, random, threads  # noqa: E402

CONFIGS = ("tiny", "demo", "gpt_char", "base")
DEFAULT_STEPS = {"tiny": 20, "demo": 20, "gpt_char": 20, "base": 8}  # base's steps take ~1 s: ~10 min in all
WARMUP = 3       # untimed steps of a new runner: eager, recorded, first replay
GAINS = 1.03     # a piece is kept when off/on reaches this on some configuration
WHOLE = 1.05     # the candidates to delete, off together, may cost at most this much


class Demo:
    """The demo's trainer step (demo_step.trainer) at the preset's batch, every sequence of the longest length."""

    def __init__(self, recorded):
        settings = demo_step.one_shape()
        self.trainer = demo_step.trainer(settings["batch_size"], settings, record_steps=recorded)

    def step(self):
        self.trainer.train_step()


def make_runner(config, recorded=True):
    """A runner of the configuration's training step (its step() runs one), warmed up."""
    if config == "demo":
        runner = Demo(recorded)
    else:
        runner = train_step.Ours(dict(train_step.CONFIGS[config]), "cpu", recorded=recorded)
    for _ in range(WARMUP):
        runner.step()
    return runner


def timed_step(runner):
    start = time.perf_counter()
    runner.step()
    return time.perf_counter() - start


# -- the switches: switch(on) puts a piece on (True) or off (False) -----------------------------

def env_switch(variable, on_value, off_value):
    def switch(on):
        os.environ[variable] = on_value if on else off_value
    return switch


def attribute_switch(owner, name, off_value):
    on_value = inspect.getattr_static(owner, name)  # a classmethod as it is in the class

    def switch(on):
        setattr(owner, name, on_value if on else off_value)
    return switch


def function_switch(original, replacement):
    """Every npformer module's name for `original` (its own module's, and any module's that
    imported it by name) set to `replacement` when off."""
    places = []

    def switch(on):
        if not places:
            places.extend((module, name) for module in list(sys.modules.values())
                          if getattr(module, "__name__", "").startswith("npformer")
                          for name, value in list(vars(module).items()) if value is original)
        for module, name in places:
            setattr(module, name, original if on else replacement)
    return switch


def threads_switch(default):
    def switch(on):
        npformer.set_num_threads(default if on else 1)
        task = threads.submit(int)  # the new pool's threads started now, not in the timed step (None: no pool)
        if task is not None:
            task.result()
    return switch


def kernels_switch(tables):
    implementations = {table: table.implementations["cpu"] for table in tables}

    def switch(on):
        for table, implementation in implementations.items():
            if on:
                table.implementations["cpu"] = implementation
            else:
                table.implementations.pop("cpu", None)
    return switch


def one_after_the_other(pieces, entries, like=None):
    """threads.side_by_side's fallback for every call: each piece on its own row blocks, in turn."""
    for kernel, rows, own in pieces:
        threads.for_rows(kernel, rows, own, like)


def new_scratch(self, data):
    """Optimizer._scratch_like without the shared buffer: a new array each time."""
    return backend.get_array_module(data).empty_like(data)


class KeepsNothing:
    """A stand-in for random._scratch: what a draw leaves there is forgotten."""

    def __setattr__(self, name, value):
        pass


def kernel_families():
    """{module: [tables]}: the kernel tables with a "cpu" implementation, by their reference's module."""
    families = {}
    for table in kernels.TABLES:
        if "cpu" in table.implementations:
            families.setdefault(table.reference.__module__, []).append(table)
    return families


class Piece:
    """A piece of machinery: its name, how it is switched off, and how it is measured: kind
    "switch" (switch(on) in this process), "runner" (the eager runner against the recorded one)
    or "process" (two worker processes, one with the piece off)."""

    def __init__(self, name, how, switch=None, kind="switch"):
        self.name, self.how, self.switch, self.kind = name, how, switch, kind


def all_pieces():
    """{name: Piece}, in the order measured."""
    default = npformer.get_num_threads()
    pieces = [
        Piece("lookahead", "NPFORMER_LOOKAHEAD=0", env_switch("NPFORMER_LOOKAHEAD", "1", "0")),
        Piece("small-mask-grouping", "lookahead.SMALL_MASK = 0", attribute_switch(lookahead, "SMALL_MASK", 0)),
        Piece("host-memory", "NPFORMER_HOST_MEMORY=release (two worker processes)", kind="process"),
        Piece("recorded", "the eager step", kind="runner"),
        Piece("thread-pool", f"npformer.set_num_threads(1), its default {default}", threads_switch(default)),
        Piece("blas-threads", "threads.run_on_blas_threads a plain call",
              function_switch(threads.run_on_blas_threads, lambda kernel, *args: kernel(*args))),
        Piece("side-by-side", "threads.side_by_side one piece after the other",
              function_switch(threads.side_by_side, one_after_the_other)),
    ]
    for module, tables in kernel_families().items():
        name = module.removeprefix("npformer.")
        pieces.append(Piece(f"cpu:{name}", "no cpu implementation: " + ", ".join(t.__name__ for t in tables),
                            kernels_switch(tables)))
    pieces += [
        Piece("adam-grouping", "Adam's _Together.step does nothing",
              attribute_switch(optimizers._Together, "step", classmethod(lambda cls, optimizer, index, group: []))),
        Piece("optimizer-scratch", "Optimizer._scratch_like a new array",
              attribute_switch(optimizers.Optimizer, "_scratch_like", new_scratch)),
        Piece("philox-fresh-rounds", "random._counter_words_cpu = random._counter_words",
              function_switch(random._counter_words_cpu, random._counter_words)),
        Piece("philox-scratch", "random._scratch keeps nothing", attribute_switch(random, "_scratch", KeepsNothing())),
    ]
    return {piece.name: piece for piece in pieces}


# -- measuring ------------------------------------------------------------------------------------

def alternate(on_step, off_step, steps):
    """([on seconds], [off seconds]): `steps` pairs on_step(), off_step() after one untimed pair."""
    on, off = [], []
    for i in range(steps + 1):
        t_on, t_off = on_step(), off_step()
        if i:
            on.append(t_on)
            off.append(t_off)
    return on, off


def measure_switch(runner, piece, steps):
    def side(on):
        piece.switch(on)
        return timed_step(runner)
    try:
        return alternate(lambda: side(True), lambda: side(False), steps)
    finally:
        piece.switch(True)


class Worker:
    """This script in another process (--worker): the configuration's runner with the pieces `off`
    switched off (host-memory through NPFORMER_HOST_MEMORY, set before its import; recorded: the
    eager runner), one timed step per request."""

    def __init__(self, config, off):
        env = dict(os.environ, NPFORMER_HOST_MEMORY="release" if "host-memory" in off else "keep")
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", config,
                                         "--off", ",".join(off)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env)

    def read(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker process stopped (exit status {self.process.wait()}): {self.process.args}")
        return line.strip()

    def step(self):
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        return float(self.read())

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def measure_processes(config, off, steps):
    """(on times, off times) of two worker processes alternated: all on, and the pieces `off` off."""
    workers = [Worker(config, ()), Worker(config, off)]
    try:
        for worker in workers:
            if worker.read() != "ready":
                raise RuntimeError(f"a worker process did not start: {worker.process.args}")
        return alternate(workers[0].step, workers[1].step, steps)
    finally:
        for worker in workers:
            worker.close()


def work(config, off):
    """A worker process: the runner built and warmed up with the pieces `off` off, then one timed
    step for each line on stdin, its seconds a line on stdout (anything else printed goes to stderr)."""
    answers, sys.stdout = sys.stdout, sys.stderr
    pieces = all_pieces()
    for name in off:
        if pieces[name].kind == "switch":
            pieces[name].switch(False)
    runner = make_runner(config, recorded="recorded" not in off)
    print("ready", file=answers, flush=True)
    for _ in sys.stdin:
        print(repr(timed_step(runner)), file=answers, flush=True)


# -- the report ---------------------------------------------------------------------------------

def row(config, name, on, off):
    """The printed line of one measurement; returns off/on of the medians."""
    on_s, off_s = statistics.median(on), statistics.median(off)
    print(f"{config:>8}  {name:<28} on {on_s * 1e3:9.2f} ms  off {off_s * 1e3:9.2f} ms  "
          f"off/on {off_s / on_s:6.3f}  ({len(on)} alternation{'s' if len(on) != 1 else ''})", flush=True)
    return off_s / on_s


def verdict(ratios):
    return "KEEP" if any(r >= GAINS for r in ratios.values()) else "candidate to delete"


def table(ratios, configs, extra):
    """The markdown table: a row per piece (off/on per configuration, the verdict), then `extra`
    rows [(name, {config: ratio}, note)]."""
    lines = ["| piece | " + " | ".join(configs) + " | verdict |", "|---|" + "---:|" * len(configs) + "---|"]
    for name, by_config in ratios.items():
        cells = " | ".join(f"{by_config[c]:.2f}" if c in by_config else "" for c in configs)
        lines.append(f"| {name} | {cells} | {verdict(by_config)} |")
    for name, by_config, note in extra:
        cells = " | ".join(f"{by_config[c]:.2f}" if c in by_config else "" for c in configs)
        lines.append(f"| {name} | {cells} | {note} |")
    return "\n".join(lines)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse(argv, names):
    parser = Parser(prog="machinery.py", description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help="configurations, separated by commas")
    parser.add_argument("--steps", type=int, help="alternations (on, off) per piece and configuration "
                                                  f"(default {DEFAULT_STEPS})")
    parser.add_argument("--pieces", help="pieces, separated by commas (default: every piece and 'all')")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--off", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        parser.error(f"--configs: expected some of {','.join(CONFIGS)}, got {unknown or args.configs}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps: expected a positive integer, got {args.steps}")
    args.pieces = args.pieces.split(",") if args.pieces else names + ["all"]
    unknown = [p for p in args.pieces if p not in names + ["all"]]
    if unknown:
        parser.error(f"--pieces: unknown {','.join(unknown)}; expected some of {','.join(names + ['all'])}")
    return args


def main(argv=None):
    pieces = all_pieces()
    args = parse(argv, list(pieces))
    if args.worker:
        return work(args.worker, [name for name in args.off.split(",") if name])
    print(f"npformer's threads: {npformer.get_num_threads()}; numpy's BLAS: {train_step.blas_info()}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("pieces, and how each is switched off:")
    for name in args.pieces:
        how = pieces[name].how if name in pieces else "every piece off, then the candidates to delete (two processes)"
        print(f"  {name}: {how}")
    ratios = {}  # piece -> {config: off/on}
    for config in args.configs:
        steps = args.steps or DEFAULT_STEPS[config]
        recorded = make_runner(config)
        for name in args.pieces:
            piece = pieces.get(name)
            if piece is None:   # "all": at the end
                continue
            if piece.kind == "switch":
                on, off = measure_switch(recorded, piece, steps)
            elif piece.kind == "runner":
                eager = make_runner(config, recorded=False)
                on, off = alternate(lambda: timed_step(recorded), lambda: timed_step(eager), steps)
                del eager
            else:
                on, off = measure_processes(config, [name], steps)
            ratios.setdefault(name, {})[config] = row(config, name, on, off)
        del recorded
    extra = []
    if "all" in args.pieces:
        candidates = [name for name, by_config in ratios.items() if verdict(by_config) != "KEEP"]
        together = [("all pieces off", list(pieces), "every piece off together")]
        if candidates:
            together.append(("candidates off", candidates, None))
        for label, off, note in together:
            by_config = {}
            for config in args.configs:
                on_times, off_times = measure_processes(config, off, args.steps or DEFAULT_STEPS[config])
                by_config[config] = row(config, label, on_times, off_times)
            if note is None:
                worst = max(by_config.values())
                note = (f"the candidates together: within {WHOLE - 1:.0%}" if worst <= WHOLE else
                        f"the candidates together: over {WHOLE - 1:.0%}, keep some")
            extra.append((label, by_config, note))
    print()
    print(f"off/on: the median step with the piece off over the median with it on (above 1: the piece gains); "
          f"KEEP when >= {GAINS} on some configuration")
    print()
    print(table(ratios, args.configs, extra))


if __name__ == "__main__":
    main()
