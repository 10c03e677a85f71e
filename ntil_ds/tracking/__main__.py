"""``python -m ntil_ds.tracking import JOURNAL --uri URI``: send a job's tracking journal to a store.

Use it when a job ended while its tracking server was away (its log says so and names the journal,
``<output_dir>/tracking/journal.jsonl``). What the run already has is skipped, so running it twice,
or on a journal that was sent completely, adds nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ntil_ds.tracking", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    importer = commands.add_parser("import", help="send a journal's records to an MLflow store")
    importer.add_argument("journal", type=Path, help="<output_dir>/tracking/journal.jsonl")
    importer.add_argument(
        "--uri",
        default=os.environ.get("MLFLOW_TRACKING_URI", ""),
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI), e.g. http://mlflow:5000 or sqlite:///x.db",
    )
    args = parser.parse_args(argv)
    if not args.journal.is_file():
        parser.error(f"journal {args.journal} does not exist (it is <output_dir>/tracking/journal.jsonl)")
    if not args.uri:
        parser.error("give --uri (or set MLFLOW_TRACKING_URI): the store to import into")

    from ntil_ds.tracking.mlflow_import import import_journal

    for session, writer in import_journal(args.journal, args.uri):
        print(
            f"session {session}: run {writer.run_id}: {writer.sent_metrics} metric values sent, "
            f"{writer.repeated_metrics} already there"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
