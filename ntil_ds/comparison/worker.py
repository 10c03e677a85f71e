"""One job of a comparison grid, in a process of its own (``python -m ntil_ds.comparison.worker JOB.json``):
train through the real launcher, score the export, write the job's record.

The grid (comparison.grid) starts one of these per job, up to ``--jobs`` at once, each with the grid's
thread count, and reads the record it leaves. A job whose training finished earlier (``trained.json`` in
its folder names the same job, and its export is there) is scored without training again. A job stopped
while it trains leaves no record: the grid trains it again from zero (docs/comparison.md, "Resume").
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

TRAINED_FILE = "trained.json"
PORT_TRIES = 3  # jobs side by side choose their rendezvous ports apart: one may lose the race (below)


def run_job(job: dict) -> dict:
    """Train (unless trained already) and score ``job``; returns its record (also written)."""
    import torch

    from ntil_ds.comparison.records import atomic_write_json, generate_records, item_rows
    from ntil_ds.comparison.results import RunResult
    from ntil_ds.evaluation.generate import score_exported_model, write_report
    from ntil_ds.jobs import job_env, log_tail, run_training_job
    from ntil_ds.tracking.step_log import METRICS_FILE

    torch.set_num_threads(job["threads"])  # the scoring's threads: the training ranks' (same sums)
    run_dir = Path(job["run_dir"])
    run = RunResult(label=job["label"], loss=job["loss"], seed=job["seed"], output_dir=str(run_dir))
    record = {"key": job["key"], "kind": job["kind"], "identity": job["identity"], "samples": [], "curve": []}

    def finish() -> dict:
        record["result"] = asdict(run) | {"record": ""}
        atomic_write_json(Path(job["record"]), record)
        return record

    trained_file = run_dir / TRAINED_FILE
    trained = json.loads(trained_file.read_text()) if trained_file.is_file() else {}
    if trained.get("key") == job["key"] and (run_dir / "export" / "config.json").is_file():
        print(f"trained earlier ({trained_file}): scoring only", flush=True)
        run.exit_code, run.train_s = 0, trained["train_s"]
    else:
        log = run_dir / "train.log"
        env = job_env(OMP_NUM_THREADS=str(job["threads"]))
        for _ in range(PORT_TRIES):
            started = time.perf_counter()
            run.exit_code = run_training_job(
                job["recipe"], job["overrides"], nproc=job["nproc"], log_path=log, env=env
            ).returncode
            run.train_s = time.perf_counter() - started
            if run.exit_code == 0 or not _lost_port_race(log):
                break
            print("the rendezvous port was taken by a job beside this one: starting again", flush=True)
        if run.exit_code != 0:
            run.status, run.stage = "failed", "train"
            run.error = f"exit code {run.exit_code}; last lines of {log}:\n{log_tail(log)}"
            return finish()
        atomic_write_json(trained_file, {"key": job["key"], "train_s": run.train_s})
    record["curve"] = generate_records(run_dir / METRICS_FILE)
    started = time.perf_counter()
    try:
        report = score_exported_model(
            run_dir / "export", Path(job["score_split"]), job["task"], batch_size=32
        )
        write_report(report, run_dir / job["eval_file"])
    except Exception as e:  # one bad export must not end the comparison
        run.status, run.stage = "failed", "evaluate"
        run.error = "".join(traceback.format_exception_only(type(e), e)).strip()
        return finish()
    run.metrics, run.status = report["metrics"], "ok"
    record["samples"] = item_rows(report)
    if job["shuffled"]:  # the same export on the shuffled split: does it read its images?
        try:
            report = score_exported_model(
                run_dir / "export", Path(job["shuffled"]), job["task"], batch_size=32
            )
            write_report(report, run_dir / "eval_shuffled.json")  # NaN scores become None there
            run.shuffled = report["metrics"]
        except Exception as e:  # the check is a control: its failure is recorded, the run stands
            run.shuffled = {"error": "".join(traceback.format_exception_only(type(e), e)).strip()}
    run.eval_s = time.perf_counter() - started
    return finish()


def _lost_port_race(log: Path) -> bool:
    """Did the launcher fail to bind its rendezvous port? The port was free when chosen (jobs.free_port)
    and taken by another job's launcher before this one bound it: nothing had started, so start again."""
    return "EADDRINUSE" in log.read_text(errors="replace")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ntil_ds.comparison.worker JOB.json", file=sys.stderr)
        return 2
    run_job(json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
