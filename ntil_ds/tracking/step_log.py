"""What a job reports of its steps, on rank 0: ``metrics.jsonl``, the progress bar with a line every
``train.log_every`` steps, and the tracker at the same cadence. Other ranks report nothing.

``metrics.jsonl`` (in ``output_dir``): one JSON object per line, ``{"split": "train", "step": 3,
"loss": ..., "ce": ..., "ntil": ..., "emd": ..., "rel": ..., "mag": ..., "lr": ..., "grad_norm": ...,
"tokens_per_s": ...}``, ``{"split": "eval", "step": ..., "loss": ..., "token_acc": ..., "digit_acc": ...}``
(teacher-forced) and ``{"split": "generate", "step": ..., "parse_rate": ..., "abs_error": ...}`` (the
scores of generated answers; in the tracker as ``eval/<score>``). After a resume the steps past the
checkpoint appear again: the last line of a step is the one that counts.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ntil_ds.data.progress import progress
from ntil_ds.tracking.base import Tracker

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def metric_key(name: str) -> str:
    """MLflow keys allow letters, digits, _ - . / and spaces: "acc@0.5" -> "acc_at_0.5"."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", name.replace("@", "_at_"))


class StepLog:
    def __init__(
        self,
        tracker: Tracker,
        output_dir: Path,
        *,
        max_steps: int,
        log_every: int,
        is_main: bool,
        first_step: int,
    ) -> None:
        self.tracker, self.output_dir, self.is_main = tracker, Path(output_dir), is_main
        self.max_steps, self.log_every = max_steps, log_every
        # progress: in a log file (a SLURM .out) one line every ~30 s, not one per step
        self.progress = progress(
            total=max_steps,
            initial=first_step,
            desc="train",
            unit="step",
            disable=not is_main,
            dynamic_ncols=True,
        )

    def should_log(self, step: int) -> bool:
        """Whether step ``step`` goes to the tracker and gets a line (the file gets every step)."""
        return step % self.log_every == 0 or step == self.max_steps

    def train(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        self._append({"split": "train", "step": step, **metrics})
        self.progress.update(1)
        self.progress.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", refresh=False)
        if self.should_log(step):
            self.tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=step)
            self.progress.write(
                f"step {step}/{self.max_steps} loss {metrics['loss']:.4f} ce {metrics['ce']:.4f} "
                f"ntil {metrics['ntil']:.4f} (emd {metrics['emd']:.4f} rel {metrics['rel']:.4f} "
                f"mag {metrics['mag']:.4f}) lr {metrics['lr']:.3e} grad_norm {metrics['grad_norm']:.3f} "
                f"tokens/s {metrics['tokens_per_s']:.0f}"
            )

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        """Teacher-forced evaluation (ntil_ds/evaluation/teacher_forced.py)."""
        if not self.is_main:
            return
        self._append({"split": "eval", "step": step, **metrics})
        self.tracker.log_metrics({f"eval/{k}": v for k, v in metrics.items()}, step=step)
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        log.info("eval at step %d: %s", step, shown)
        tqdm.write(f"eval step {step}: {shown}")

    def numeric(self, step: int, scores: dict[str, float]) -> None:
        """The scores of generated answers (ntil_ds/evaluation/numeric.py)."""
        if not self.is_main:
            return
        self._append({"split": "generate", "step": step, **scores})
        self.tracker.log_metrics({metric_key(f"eval/{k}"): v for k, v in scores.items()}, step=step)
        shown = " ".join(f"{k} {v:.4g}" for k, v in scores.items())
        log.info("generated answers at step %d: %s", step, shown)
        tqdm.write(f"generate step {step}: {shown}")

    def close(self) -> None:
        self.progress.close()

    def _append(self, record: dict[str, Any]) -> None:
        with (self.output_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
