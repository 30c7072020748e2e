"""The terminal progress line of a training run (`Progress`).

Best-effort, like every progress output: a process without stderr (closed: `sys.stderr` is
None), a reader that went away (a broken pipe, e.g. `2>&1 | head`) or any other OSError or
ValueError (a closed file) while writing silences the line for the rest of the run; the
training it reports on goes on."""
import sys


class Progress:
    """tqdm when installed, else one line rewritten with a carriage return on a terminal (or a
    new line every ~10% of the run when stderr is a file). Disabled: `update` and `close` do
    nothing; `write` still prints its message (a skipped update is news, not progress).

    total: the step the run ends at; initial: the step it starts from (a resumed run)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.total, self.enabled, self.bar = total, enabled, None
        self.stream = sys.stderr  # None once writing to it has failed (or when there is none)
        self.tty = enabled and self._attempt(lambda: self.stream.isatty()) is True
        self.last_tenth = -1
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = self._attempt(lambda: tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                                                      file=self.stream))

    def _attempt(self, output):
        """output() unless stderr is gone; when it fails, stderr is given up for the rest of the run."""
        if self.stream is None:
            return None
        try:
            return output()
        except (OSError, ValueError):  # a broken pipe, a full disk, a closed file
            self.stream = None
            if self.bar is not None:
                self.bar.disable = True  # tqdm's close (and its __del__) then write nothing more
            return None

    def update(self, step: int, text: str) -> None:
        """Show that `step` of `total` is done, with `text` (loss, lr, ...) after the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self._attempt(lambda: self.bar.set_postfix_str(text, refresh=True))
            return
        width = 20
        filled = int(width * step / max(self.total, 1))
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (width - filled)}] {text}"
        if self.tty:
            self._attempt(lambda: self._print("\r" + line + "\033[K", end=""))
        elif step * 10 // max(self.total, 1) != self.last_tenth or step == self.total:
            self.last_tenth = step * 10 // max(self.total, 1)
            self._attempt(lambda: self._print(line))

    def write(self, message: str) -> None:
        """A message on its own line (e.g. a skipped update), without breaking the bar."""
        if self.bar is not None:
            self._attempt(lambda: self.bar.write(message, file=self.stream))
        else:
            self._attempt(lambda: self._print(("\n" if self.tty else "") + message))

    def close(self) -> None:
        if self.bar is not None:
            self._attempt(self.bar.close)
        elif self.tty:
            self._attempt(lambda: self._print(""))

    def _print(self, text, end="\n"):
        print(text, end=end, file=self.stream, flush=True)
