"""`WeightedSources`: several data sources trained on together, each a fixed share of every epoch.

(Not ntil_ds/data/mixture.py, which writes synthetic pretraining data; this mixes data sets at training
time: ``data.mixture: [{file: a.jsonl, weight: 0.7}, {file: b.parquet, weight: 0.3}]``.)

What the weights mean, exactly. Sources 1..k have n_1..n_k usable samples (after the checks) and weights
w_s > 0; p_s = w_s / sum(w). An epoch has M = n_1 + ... + n_k samples (what concatenating them would
give), and source s gives q_s of them: p_s * M rounded by largest remainder, so the q_s sum to M
exactly (a source whose share rounds to none is refused). Within a source, samples are drawn without
replacement: its draws are one endless stream of passes, each pass a permutation of its n_s samples
seeded by (seed, s, pass) (in order when data.shuffle=false), and epoch e takes draws e*q_s ..
(e+1)*q_s - 1 of it. So at any point the draw counts of one source's samples differ by at most one: a
source with q_s > n_s is gone through q_s/n_s times per epoch (upsampled), one with q_s < n_s gives a
different part of itself each epoch and all of itself every n_s/q_s epochs (downsampled). The epoch's
M draws are then shuffled together, seeded by (seed, epoch) (data.shuffle=false: interleaved evenly,
draw j of source s at (j + 1/2) / q_s).

The order is a function of (seed, epoch) only, so `ResumableDistributedSampler` shards and resumes it
as it does a single data set's permutation: the same samples in the same order after a resume.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from ntil_ds.data.dataset import DataReport
from ntil_ds.data.records import DataError


class MixtureReport(DataReport):
    """The sources' reports summed, and what each gives per epoch."""

    def __init__(self, reports: Sequence[DataReport], quotas: Sequence[int], weights: Sequence[float]):
        skipped = sum((Counter(r.skipped) for r in reports), Counter())
        examples = [e for r in reports for e in r.examples][:5]
        super().__init__(
            "mixture",
            sum(r.kept for r in reports),
            sum(r.truncated for r in reports),
            skipped,
            examples,
        )
        self.parts, self.quotas, self.weights = list(reports), list(quotas), list(weights)

    def summary(self) -> str:
        total = sum(self.quotas)
        parts = "; ".join(
            f"{r.summary()}, gives {q} of each epoch's {total} samples (weight {w:g}, {q / r.kept:.2f} passes)"
            for r, q, w in zip(self.parts, self.quotas, self.weights, strict=True)
        )
        return f"mixture of {len(self.parts)} sources: {parts}"


def quotas(sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Each source's samples per epoch: its weight's share of sum(sizes), by largest remainder."""
    total = sum(sizes)
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * total
    counts = np.floor(shares).astype(np.int64)
    for i in np.argsort(-(shares - counts), kind="stable")[: total - int(counts.sum())]:
        counts[i] += 1
    return [int(c) for c in counts]


class WeightedSources:
    """The samples of several datasets (index: source s's sample j is ``starts[s] + j``), with the epoch
    order of the weights (see the module docstring) for `ResumableDistributedSampler`."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], names: Sequence[str]) -> None:
        self.datasets, self.weights = list(datasets), [float(w) for w in weights]
        sizes = [len(d) for d in self.datasets]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.quotas = quotas(sizes, self.weights)
        empty = [name for name, q in zip(names, self.quotas, strict=True) if q == 0]
        if empty:
            raise DataError(
                f"data.mixture: the weight of {', '.join(empty)} is too small to give one sample per epoch"
            )
        self.epoch_length = sum(self.quotas)
        self.report = MixtureReport([d.report for d in self.datasets], self.quotas, self.weights)
        self.path = "mixture"

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        index = range(len(self))[index]
        source = int(np.searchsorted(self.starts, index, side="right")) - 1
        return source, index - int(self.starts[source])

    def __getitem__(self, index: int):
        source, local = self._locate(index)
        return self.datasets[source][local]

    def sample_name(self, index: int) -> str:
        """Where sample `index` is, in its own source ("file:line", "file:row n")."""
        source, local = self._locate(index)
        return self.datasets[source].sample_name(local)

    def num_tokens(self, index: int) -> int:
        source, local = self._locate(index)
        return self.datasets[source].num_tokens(local)

    def lengths(self) -> np.ndarray:
        """Every sample's token count, by index (the cached datasets' from their offsets)."""
        return np.concatenate(
            [
                d.lengths() if hasattr(d, "lengths") else [d.num_tokens(i) for i in range(len(d))]
                for d in self.datasets
            ]
        ).astype(np.int64)

    def epoch_order(self, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
        """The `epoch_length` sample indices of `epoch`, in training order."""
        draws, keys = [], []
        for s, (dataset, quota) in enumerate(zip(self.datasets, self.quotas, strict=True)):
            n = len(dataset)
            first, last = epoch * quota, (epoch + 1) * quota  # this epoch's draws of the source's stream
            passes = range(first // n, (last - 1) // n + 1)
            stream = np.concatenate(
                [
                    np.random.default_rng([seed, s, p]).permutation(n) if shuffle else np.arange(n)
                    for p in passes
                ]
            )
            start = first - passes[0] * n
            draws.append(self.starts[s] + stream[start : start + quota])
            keys.append((np.arange(quota) + 0.5) / quota)
        order = np.concatenate(draws)
        if shuffle:
            return order[np.random.default_rng([seed, epoch]).permutation(len(order))]
        return order[np.argsort(np.concatenate(keys), kind="stable")]


def load_weighted(sources: Sequence[tuple[str, float]], processor, max_seq_len: int, on_bad_sample, **kwargs):
    """`load_dataset` of each (file, weight) (each with its own cache); one source is that dataset itself."""
    from ntil_ds.data.cached_dataset import load_dataset

    datasets = [load_dataset(file, processor, max_seq_len, on_bad_sample, **kwargs) for file, _ in sources]
    if len(datasets) == 1:
        return datasets[0]
    return WeightedSources(datasets, [w for _, w in sources], [file for file, _ in sources])
