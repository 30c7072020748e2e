"""Run a learner's code in a child process with a time limit, so that nothing it does can end,
hang or pass for the checker: `sys.exit` and `os._exit`, an infinite loop, a crash or a kill of
the process each become an outcome the checker reports as a verdict.

The child is a fork of the checking process (it sees the function as it is, closures and
notebook definitions included); it sends back what the function returned, or what it raised.
Where the platform cannot fork, the function runs in the checking process without the limit.
"""
import dataclasses
import multiprocessing
import pickle
import signal
import traceback

DEFAULT_TIMEOUT_S = 10.0


@dataclasses.dataclass
class Outcome:
    """How one call ended. kind: "returned" (value holds what it returned), "raised" (message: the
    exception and the learner's line), "not written" (it raised NotImplementedError), "timeout",
    "exited" (sys.exit, os._exit, a crash or a signal; message says which)."""

    kind: str
    value: object = None
    message: str = ""


@dataclasses.dataclass(frozen=True)
class Unsendable:
    """Stands for a returned object that cannot leave the child process (e.g. a generator)."""

    type_name: str


def _where(code_file, error):
    """" (line N)" of the learner's file where `error` came from, when it did."""
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == code_file]
    return f" (line {lines[-1]})" if lines else ""


def _sendable(value):
    """value, with each element that cannot be pickled replaced by an Unsendable."""
    def one(v):
        try:
            pickle.dumps(v)
            return v
        except Exception:  # any object the learner returns: a lambda, a generator, an open file
            return Unsendable(type(v).__name__)
    if isinstance(value, (tuple, list)):
        return type(value)(one(v) for v in value)
    return one(value)


def outcome_of(call, code_file=None):
    """Call call() here and describe how it ended (the child's half; also the no-fork path)."""
    try:
        return Outcome("returned", call())
    except NotImplementedError:
        return Outcome("not written")
    except SystemExit as error:
        return Outcome("exited", message=f"exited the program (sys.exit({error.code!r}))")
    except KeyboardInterrupt:
        return Outcome("exited", message="exited the program (KeyboardInterrupt)")
    except Exception as error:  # the learner's bug, reported on its row
        return Outcome("raised", message=f"raised {type(error).__name__}: {error}{_where(code_file, error)}")


def _child(call, code_file, writer):
    outcome = outcome_of(call, code_file)
    if outcome.kind == "returned":
        outcome.value = _sendable(outcome.value)
    writer.send(outcome)
    writer.close()


def run_isolated(call, timeout=DEFAULT_TIMEOUT_S, code_file=None):
    """call() in a forked child, for at most `timeout` seconds: its Outcome. code_file: the file
    whose line numbers an exception's message names (the learner's)."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return outcome_of(call, code_file)
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(call, code_file, writer), daemon=True)
    process.start()
    writer.close()                    # the child holds the only writer: its end reads as EOF here
    try:
        if not reader.poll(timeout):
            process.kill()
            process.join()
            return Outcome("timeout", message=f"did not return within {timeout:g} s")
        try:
            outcome = reader.recv()
        except EOFError:              # the child ended without a word: os._exit, a crash or a signal
            outcome = None
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
    finally:
        reader.close()
    if outcome is not None:
        return outcome
    code = process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        return Outcome("exited", message=f"the process was killed ({name})")
    return Outcome("exited", message=f"exited the program (exit status {code}, e.g. os._exit)")
