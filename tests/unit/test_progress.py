"""Progress bars in a log file (ntil_ds/data/progress.py): at most a line every interval, on the encoding
bar and on the training step bar; a terminal keeps tqdm's own redraws."""

import io
import time

from tqdm import tqdm

from ntil_ds.data.progress import LOG_INTERVAL_S, progress
from ntil_ds.tracking.base import NullTracker
from ntil_ds.tracking.step_log import StepLog


def _redraws(text: str) -> list[str]:
    """What a log shows: each line, and each carriage-return redraw within one."""
    return [part for line in text.splitlines() for part in line.split("\r") if part.strip()]


def test_a_log_file_gets_at_most_a_line_per_interval():
    log = io.StringIO()
    started = time.monotonic()
    for _ in progress(range(200_000), file=log, desc="encoding", unit="line"):
        pass
    elapsed = time.monotonic() - started
    lines = _redraws(log.getvalue())
    assert len(lines) <= 2 + elapsed / LOG_INTERVAL_S, lines  # the first, the last, one per interval
    assert "\r" not in log.getvalue() and "200000/200000" in lines[-1]
    # what tqdm alone writes to the same file: a redraw every 0.1 s (the check above can fail)
    plain = io.StringIO()
    for _ in tqdm(range(200_000), file=plain, mininterval=0):
        pass
    assert len(_redraws(plain.getvalue())) > 1000


def test_each_line_has_rate_and_time_left_and_the_interval_holds():
    log = io.StringIO()
    started = time.monotonic()
    for _ in progress(range(40), file=log, interval=0.05, desc="encoding", unit="line"):
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    lines = _redraws(log.getvalue())
    assert 3 <= len(lines) <= 2 + elapsed / 0.05, lines
    assert all("line/s" in line or "s/line" in line or "?line/s" in line for line in lines)
    assert "<" in lines[1]  # [elapsed<left, rate]


def test_a_terminal_keeps_tqdms_redraws():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    bar = progress(range(3), file=Terminal())
    assert bar.mininterval == 0.1 and bar.fp._wrapped.__class__ is Terminal
    bar.close()


def test_the_step_bar_in_a_log_file(tmp_path, capsys):
    steps = 300
    metrics = {k: 0.5 for k in ("loss", "ce", "ntil", "emd", "rel", "mag", "lr", "grad_norm", "tokens_per_s")}
    step_log = StepLog(NullTracker(), tmp_path, max_steps=steps, log_every=100, is_main=True, first_step=0)
    started = time.monotonic()
    for step in range(1, steps + 1):
        step_log.train(step, metrics)
    step_log.close()
    elapsed = time.monotonic() - started
    captured = capsys.readouterr()
    bar_lines = _redraws(captured.err)
    assert len(bar_lines) <= 2 + elapsed / LOG_INTERVAL_S, bar_lines  # not one per step
    assert f"{steps}/{steps}" in bar_lines[-1]
    assert len([line for line in captured.out.splitlines() if line.startswith("step ")]) == 3  # log_every
