"""What `lowprec run`, `profile` and `plan` show on the terminal, and the run's log file.

    with Console("run", verbose=args.verbose) as console:   # entered by the command, nowhere else
        console.log_to(out / "lowprec.log")                  # once the run folder exists
        bar = console.progress(300, mix=state.flops_share)   # one line: step, tokens/s, loss, mix, ETA
        bar.update(step + 1, loss=loss, tokens=n)
        bar.close()
        console.print(summary)                               # the command's result: stdout
        console.say("tracking failed ...")                   # stderr: "lowprec run: tracking failed ..."

**lowprec's own lines.** On stdout: what the command prints as its result (the run's
summary, the profile's table). On stderr: lines that begin with `lowprec`, a name and a
colon (`OWN_LINE`: `lowprec run: `, `lowprec tracking: `): the progress line, lowprec's
warnings and errors, warnings that concern the user's run. On a terminal the progress line
is a `tqdm` bar rewritten in place (`lowprec run:  45%|####5     | 9/20 [00:03<00:04, ...]`);
when stderr is not a terminal (a pipe, a CI log) it is a plain line every `every` steps
(default: a twentieth of the run) and at the end.

**Everything else goes to the log file** (`lowprec.log` in the run folder; what comes before
the folder exists is held in a temporary file until then, and dropped if the command stops
before): what other libraries write to `sys.stdout`/`sys.stderr` (lm-eval's progress bars
and "bootstrapping for stddev", datasets' "Generating ... split" bars), log records of level
INFO and up from every logger (MLflow's database-table and system-metrics lines), and, when
stdout and stderr are the process's own file descriptors 1 and 2, what subprocesses write
there (lm-eval's `git describe`). A progress bar rewritten with `\\r` is one line in the log,
its last state. With `verbose` all of it is shown on the terminal as well.

**Warnings that concern the user's run still show**: a Python warning is shown (`lowprec
run: warning: Category: message`) unless the code that raised it belongs to one of
`BACKGROUND`, the libraries lowprec drives on the user's behalf (tracking, evaluation, their
storage); a log record of level WARNING or up likewise, unless its logger is one of theirs.
Both are in the log either way.

What the `with` block changes it undoes when it ends, and nothing happens at `import
lowprec`: `sys.stdout`, `sys.stderr`, file descriptors 1 and 2, the root logger's level and
handlers, `warnings.showwarning` (the previous one is still called, with a file that is
thrown away, so a `warnings.catch_warnings(record=True)` around the command still records).
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import deque
from pathlib import Path
from typing import Callable, Mapping

__all__ = ["Console", "Progress", "BACKGROUND", "OWN_LINE", "LOG_NAME"]

LOG_NAME = "lowprec.log"
OWN_LINE = re.compile(r"lowprec( [\w.-]+)*: ")   # the start of every line lowprec writes to stderr
# top-level packages (and logger names) whose output is chatter for a lowprec user
PROGRESS_LOG = "lowprec.progress"   # INFO records of this logger are progress lines on the terminal
BACKGROUND = frozenset({"mlflow", "alembic", "sqlalchemy", "lm_eval", "lm-eval", "datasets", "evaluate",
                        "huggingface_hub", "fsspec", "urllib3", "filelock", "codecarbon", "pynvml", "git",
                        "matplotlib", "PIL", "absl", "sacrebleu", "pyarrow", "multiprocess"})
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _background_file(filename: str) -> bool:
    """True when `filename` is code of a BACKGROUND library (or import machinery, `<frozen ...>`)."""
    if filename.startswith("<"):
        return True
    parts = Path(filename).parts
    for i, part in enumerate(parts[:-1]):
        if part in ("site-packages", "dist-packages"):
            return parts[i + 1].removesuffix(".py") in BACKGROUND
    return False


class _Sink:
    """The log: a temporary file until `attach`, then the log file (both written through their fd,
    which fds 1 and 2 may point at too). Text is held until its newline; of a line rewritten
    with carriage returns only the last state is kept."""

    def __init__(self):
        self._tmp = tempfile.TemporaryFile()
        self.fd = self._tmp.fileno()
        self._partial = ""
        self._lock = threading.RLock()

    def write(self, text: str) -> int:
        with self._lock:
            text = self._partial + text
            head, sep, self._partial = text.rpartition("\n")
            if sep:
                lines = [line.rstrip("\r").rpartition("\r")[2] for line in head.split("\n")]
                self._raw("".join(line + "\n" for line in lines))
        return len(text)

    def _raw(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        while data:
            data = data[os.write(self.fd, data):]

    def flush(self) -> None:
        pass

    def finish_line(self) -> None:
        with self._lock:
            if self._partial.strip("\r"):
                self.write("\n")
            self._partial = ""

    def attach(self, path: Path) -> int:
        """Move to the log file at `path` (appended to), with what was held so far; its fd."""
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.lseek(self.fd, 0, os.SEEK_SET)
            while chunk := os.read(self.fd, 1 << 20):
                os.write(fd, chunk)
            if self._tmp is not None:
                self._tmp.close()
                self._tmp = None
            else:
                os.close(self.fd)
            self.fd = fd
            return fd

    def close(self) -> None:
        with self._lock:
            self.finish_line()
            if self._tmp is not None:
                self._tmp.close()
                self._tmp = None
            else:
                os.close(self.fd)


class _Capture(io.TextIOBase):
    """What `sys.stdout` / `sys.stderr` are while a command runs: the log (and the terminal, verbose)."""

    def __init__(self, sink: _Sink, tee, fd: int | None):
        self._sink, self._tee, self._fd = sink, tee, fd

    def write(self, text: str) -> int:
        self._sink.write(text)
        if self._tee is not None:
            self._tee.write(text)
        return len(text)

    def flush(self) -> None:
        if self._tee is not None:
            self._tee.flush()

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        if self._fd is None:
            raise io.UnsupportedOperation("fileno")
        return self._fd

    @property
    def encoding(self) -> str:
        return "utf-8"


class _TerminalHandler(logging.Handler):
    """Log records on the terminal, as lowprec's own lines (the full record is in the log)."""

    def __init__(self, console: "Console"):
        super().__init__(logging.INFO)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        if not self.console.verbose and record.name.split(".")[0] in BACKGROUND:
            return
        if record.levelno < logging.WARNING and record.name != PROGRESS_LOG and not self.console.verbose:
            return   # INFO reaches the terminal only as a progress line (a long eval's, say)
        try:
            lines = record.getMessage().strip().splitlines() or [""]
        except Exception:  # noqa: BLE001 - a bad format string in someone's log call
            self.handleError(record)
            return
        text = lines[0] + (" [...]" if len(lines) > 1 else "")
        if record.name == PROGRESS_LOG and record.levelno < logging.WARNING:
            text = f"lowprec {self.console.command}: {text}"
        elif not OWN_LINE.match(text):
            where = "" if record.name.split(".")[0] == "lowprec" else f" ({record.name})"
            text = f"lowprec {self.console.command}: {record.levelname.lower()}{where}: {text}"
        self.console.err_line(text)


class Console:
    """The terminal and the log of one command (see the module docstring)."""

    def __init__(self, command: str, verbose: bool = False):
        self.command, self.verbose = command, verbose
        self.log_path: Path | None = None

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> "Console":
        self._sink = _Sink()
        self._saved_streams = (sys.stdout, sys.stderr)
        self._saved_fds: list[tuple[int, int]] = []
        self.out = self._terminal(sys.stdout, 1)
        self.err = self._terminal(sys.stderr, 2)
        redirected = {fd for fd, _ in self._saved_fds}
        sys.stdout = _Capture(self._sink, self.out if self.verbose else None, 1 if 1 in redirected else None)
        sys.stderr = _Capture(self._sink, self.err if self.verbose else None, 2 if 2 in redirected else None)
        root = logging.getLogger()
        self._root_level = root.level
        self._handlers = [logging.StreamHandler(self._sink), _TerminalHandler(self)]
        self._handlers[0].setLevel(logging.INFO)
        self._handlers[0].setFormatter(logging.Formatter(_LOG_FORMAT))
        for h in self._handlers:
            root.addHandler(h)
        if root.level == logging.NOTSET or root.level > logging.INFO:
            root.setLevel(logging.INFO)
        self._showwarning = warnings.showwarning
        warnings.showwarning = self._show_warning
        self._bars: list[Progress] = []
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for bar in list(self._bars):
            bar.close()
        if exc_type is not None and not issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            self._sink.write("".join(traceback.format_exception(exc_type, exc, tb)))
        warnings.showwarning = self._showwarning
        root = logging.getLogger()
        for h in self._handlers:
            root.removeHandler(h)
        root.setLevel(self._root_level)
        sys.stdout, sys.stderr = self._saved_streams
        for fd, saved in self._saved_fds:
            os.dup2(saved, fd)
            os.close(saved)
        for stream in (self.out, self.err):
            stream.flush()
            if stream not in self._saved_streams:
                stream.close()
        self._sink.close()

    def _terminal(self, stream, fd: int):
        """The terminal side of stdout/stderr. When the stream is the process's own fd (and not
        verbose), the fd itself is pointed at the log, so that subprocesses write there too; the
        terminal is then a new stream on a copy of the fd."""
        try:
            real = not self.verbose and stream.fileno() == fd
        except (AttributeError, OSError, ValueError):
            real = False
        if not real:
            return stream
        stream.flush()
        saved = os.dup(fd)
        os.dup2(self._sink.fd, fd)
        self._saved_fds.append((fd, saved))
        return open(os.dup(saved), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8",
                    errors="replace")

    # ------------------------------------------------------------------ output
    def log_to(self, path: str | os.PathLike) -> Path:
        """Keep the log in `path` from now on (with what came before); returns it."""
        self.log_path = Path(path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._sink.attach(self.log_path)
        for target, _ in self._saved_fds:
            os.dup2(fd, target)
        return self.log_path

    def print(self, text: str = "") -> None:
        """The command's result, on stdout (and in the log)."""
        self._sink.write(text + "\n")
        with self._bars_cleared():
            self.out.write(text + "\n")
            self.out.flush()

    def say(self, text: str) -> None:
        """A line of lowprec's on stderr: `lowprec <command>: <text>` (and in the log)."""
        self.err_line(f"lowprec {self.command}: {text}", log=True)

    def err_line(self, line: str, log: bool = False) -> None:
        if log:
            self._sink.write(line + "\n")
        with self._bars_cleared():
            self.err.write(line + "\n")
            self.err.flush()

    def _bars_cleared(self):
        if any(b.bar is not None for b in self._bars):
            from tqdm import tqdm
            return tqdm.external_write_mode(file=self.err)
        import contextlib
        return contextlib.nullcontext()

    def _show_warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if file is not None:   # written where the caller asked
            self._showwarning(message, category, filename, lineno, file, line)
            return
        self._sink.write(warnings.formatwarning(message, category, filename, lineno, line))
        if self.verbose or not _background_file(str(filename)):
            first = (str(message).strip().splitlines() or [""])[0]
            self.err_line(f"lowprec {self.command}: warning: {category.__name__}: {first}")
        # the previous one still sees it (a catch_warnings(record=True) records it); its text is ours above
        self._showwarning(message, category, filename, lineno, io.StringIO(), line)

    def progress(self, total: int, *, unit: str = "step", mix: Callable[[], Mapping[str, float]] | None = None,
                 every: int | None = None) -> "Progress":
        """A progress line for `total` units (see `Progress`)."""
        bar = Progress(self, total, unit=unit, mix=mix, every=every)
        self._bars.append(bar)
        return bar

    @property
    def is_terminal(self) -> bool:
        try:
            return bool(self.err.isatty())
        except (AttributeError, ValueError):
            return False


class Progress:
    """One progress line: `step 9/20 (45%), 8,268 tokens/s, loss 4.7531, fp8_tensorwise 60% bf16 40%,
    ETA 0:04` (the fields given). A tqdm bar on a terminal; plain lines every `every` units
    (default a twentieth of `total`) and at the end otherwise. `update(n)` may go back (a rewind)."""

    def __init__(self, console: Console, total: int, *, unit: str = "step",
                 mix: Callable[[], Mapping[str, float]] | None = None, every: int | None = None):
        self.console, self.total, self.unit, self.mix = console, max(int(total), 1), unit, mix
        self.every = every or max(1, self.total // 20)
        self.n, self._next, self._printed = 0, self.every, -1
        self._loss: float | None = None
        self._window: deque[tuple[float, int, int]] = deque(maxlen=32)   # (time, n, tokens so far)
        self._tokens = 0
        self._window.append((time.monotonic(), 0, 0))
        self.bar = None
        if console.is_terminal:
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, desc=f"lowprec {console.command}", unit=unit, file=console.err,
                            mininterval=0.25, smoothing=0.1, leave=True)

    def update(self, n: int, *, loss: float | None = None, tokens: int = 0) -> None:
        """`n` units done so far (a step index after its step); `tokens` processed by this update."""
        self._tokens += int(tokens)
        self._loss = loss if loss is not None else self._loss
        self._window.append((time.monotonic(), int(n), self._tokens))
        if self.bar is not None:
            self.bar.set_postfix_str(self._fields(eta=False), refresh=False)
            self.bar.update(int(n) - self.bar.n)
        elif n >= self._next or n >= self.total:
            self.console.say(self.line(n))
            self._printed = n
            self._next = (n // self.every + 1) * self.every
        self.n = int(n)

    def line(self, n: int) -> str:
        return f"{self.unit} {n}/{self.total} ({n / self.total:.0%}), {self._fields(eta=True)}".rstrip(", ")

    def _fields(self, eta: bool) -> str:
        (t0, n0, k0), (t1, n1, k1) = self._window[0], self._window[-1]
        dt = t1 - t0
        parts = []
        if k1 > k0 and dt > 0:
            parts.append(f"{(k1 - k0) / dt:,.0f} tokens/s")
        if self._loss is not None:
            parts.append(f"loss {self._loss:.4f}")
        if self.mix is not None:
            share = sorted(self.mix().items(), key=lambda kv: -kv[1])
            parts.append(" ".join(f"{k} {v:.0%}" for k, v in share if v >= 0.005))
        if eta and n1 > n0 and dt > 0:
            from tqdm import tqdm
            parts.append(f"ETA {tqdm.format_interval(max(self.total - n1, 0) * dt / (n1 - n0))}")
        return ", ".join(parts)

    def close(self) -> None:
        if self in self.console._bars:
            self.console._bars.remove(self)
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self._printed != self.n and self.n > 0:
            self.console.say(self.line(self.n))
            self._printed = self.n
