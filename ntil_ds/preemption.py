"""Stop cleanly when the cluster asks: a preemption request that all ranks agree on at a step boundary.

A request reaches a training process in one of two ways:

* a signal (SIGUSR1 or SIGTERM by default) delivered to that process; or
* a flag file that exists. ``slurm/train.sh`` traps SLURM's warning signal (``--signal=B:USR1@N``) in
  the batch shell and touches the file, because launchers (torchrun, deepspeed) do not forward USR1
  to their children.

Either way only *some* ranks may see it, and at different moments. So :meth:`PreemptionWatcher.requested`
is a collective: every rank calls it at the same step boundary and they all get the same answer (a MAX
all-reduce of the local flags). The trainer then saves a checkpoint on all ranks together and the entry
point exits with :data:`EXIT_PREEMPTED`, which tells the batch script to requeue the job.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from pathlib import Path
from types import FrameType

from ntil_ds.dist import any_rank

# launch/train.py exits with this code after a preemption checkpoint (0 when training completed).
# slurm/train.sh requeues the job on exactly this code; any other non-zero code is a failure.
EXIT_PREEMPTED = 85


class PreemptionWatcher:
    """Watches for a preemption request; :meth:`requested` turns it into one decision for all ranks.

    Args:
        flag_file: a path whose existence is a request (None: signals only). The file is only read,
            never created or removed here: the batch script owns it.
        signals: signals whose arrival is a request. Their handlers only set a flag, so the process
            no longer dies on them: the step in flight finishes and the trainer checkpoints.
    """

    def __init__(
        self,
        flag_file: str | Path | None = None,
        signals: Iterable[signal.Signals] = (signal.SIGUSR1, signal.SIGTERM),
    ) -> None:
        self.flag_file = Path(flag_file) if flag_file else None
        self._signal_received: signal.Signals | None = None
        self._agreed = False
        self._previous_handlers = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs between two bytecodes of the main thread: keep it to setting a flag.
        self._signal_received = signal.Signals(signum)

    @property
    def reason(self) -> str | None:
        """Why this rank wants to stop (for the log), or None when it has seen no request."""
        if self._signal_received is not None:
            return f"signal {self._signal_received.name}"
        if self.flag_file is not None and self.flag_file.exists():
            return f"flag file {self.flag_file}"
        return None

    def requested(self) -> bool:
        """True on every rank when any rank has seen a request. COLLECTIVE: call it on all ranks.

        Call it at the same point of every step (a step boundary). Without an initialized process
        group it answers for this process alone. Once True it stays True without further collectives
        (all ranks turned True at the same call, so they stay in step).
        """
        if self._agreed:
            return True
        self._agreed = any_rank(self.reason is not None)
        return self._agreed

    def close(self) -> None:
        """Put back the signal handlers that were installed before this watcher."""
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}
