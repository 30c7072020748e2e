"""The terminal progress line of a training run (`Progress`)."""
import sys


class Progress:
    """tqdm when installed, else one line rewritten with a carriage return on a terminal (or a
    new line every ~10% of the run when stderr is a file). Disabled: `update` and `close` do
    nothing; `write` still prints its message (a skipped update is news, not progress).

    total: the step the run ends at; initial: the step it starts from (a resumed run)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.total, self.enabled, self.bar = total, enabled, None
        self.tty = enabled and sys.stderr.isatty()
        self.last_tenth = -1
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, step: int, text: str) -> None:
        """Show that `step` of `total` is done, with `text` (loss, lr, ...) after the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text, refresh=True)
            return
        width = 20
        filled = int(width * step / max(self.total, 1))
        line = f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (width - filled)}] {text}"
        if self.tty:
            sys.stderr.write("\r" + line + "\033[K")
            sys.stderr.flush()
        elif step * 10 // max(self.total, 1) != self.last_tenth or step == self.total:
            self.last_tenth = step * 10 // max(self.total, 1)
            print(line, file=sys.stderr, flush=True)

    def write(self, message: str) -> None:
        """A message on its own line (e.g. a skipped update), without breaking the bar."""
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        else:
            print(("\n" if self.tty else "") + message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\n")
