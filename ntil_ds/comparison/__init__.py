"""Does NTIL help on this task? One recipe trained under several losses and seeds, every run scored on
the test split, the losses compared (``launch/compare.py`` is the command).

- :mod:`~ntil_ds.comparison.results`: the runs' records and their aggregation (mean +- sample std over
  seeds, the change against the baseline, the table); pure, unit-tested on hand-computed cases.
- :mod:`~ntil_ds.comparison.plan`: the plan, fixed before the first job (recipe checked, splits and base
  hashed by content); :mod:`~ntil_ds.comparison.grid`: the grid itself, up to ``--jobs`` jobs at once,
  each a :mod:`~ntil_ds.comparison.worker` process (training through the real launcher, scoring) that
  leaves a :mod:`~ntil_ds.comparison.records` record, so a grid started again runs only what is missing;
  :mod:`~ntil_ds.comparison.outputs`: the outputs rewritten after every job, the MLflow parent run.
- :mod:`~ntil_ds.comparison.stats` and :mod:`~ntil_ds.comparison.paired`: each loss against the baseline
  seed by seed (paired t and log-ratio intervals, the exact sign test, the seeds x items bootstrap).
- :mod:`~ntil_ds.comparison.controls`: answer-ignoring constants and the shuffled-input check.
- :mod:`~ntil_ds.comparison.splits` and :mod:`~ntil_ds.comparison.merge`: grids read as one, their test
  splits compared by content, a test item in a training split refused.
"""
