"""Several sources mixed with weights (ntil_ds/data/weighted.py, data.mixture): each source's share of
every epoch, drawn without replacement, deterministic from the seed, resumed exactly."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ntil_ds.config import load_config
from ntil_ds.data import ResumableDistributedSampler, load_processor
from ntil_ds.data.cached_dataset import load_dataset
from ntil_ds.data.weighted import WeightedSources, load_weighted, quotas
from ntil_ds.tiny import build_tiny_model_folder
from ntil_ds.typed_config import ConfigError


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(build_tiny_model_folder("qwen2", tmp_path_factory.mktemp("tiny") / "m"))


def _rows(tag, n):
    return [
        {"messages": [{"role": "user", "content": f"{tag} {i}?"}, {"role": "assistant", "content": str(i)}]}
        for i in range(n)
    ]


@pytest.fixture
def sources(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in _rows("a", 10)) + "not json\n")
    b = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(_rows("b", 30)), b)
    return [(str(a), 0.7), (str(b), 0.3)]


def _mixed(sources, processor):
    return load_weighted(sources, processor, 64, "skip", cache_dir=sources[0][0] + ".cache")


def test_each_source_gives_its_share_of_every_epoch_without_replacement(sources, processor):
    mixed = _mixed(sources, processor)
    assert isinstance(mixed, WeightedSources) and len(mixed) == 40 and mixed.quotas == [28, 12]
    a, b = (load_dataset(f, processor, 64, "skip", cache=False) for f, _ in sources)
    for index, (dataset, local) in {3: (a, 3), 10: (b, 0), 39: (b, 29)}.items():
        assert torch.equal(mixed[index]["input_ids"], dataset[local]["input_ids"])
    assert list(mixed.lengths()) == [a.num_tokens(i) for i in range(10)] + [
        b.num_tokens(i) for i in range(30)
    ]
    epochs = [mixed.epoch_order(seed=5, epoch=e, shuffle=True) for e in range(5)]
    for e, order in enumerate(epochs):
        assert len(order) == mixed.epoch_length == 40
        assert ((order < 10).sum(), (order >= 10).sum()) == (28, 12)  # 0.7 and 0.3 of 40
        # without replacement: after any epoch, no sample of a source was drawn twice more than another
        seen = np.concatenate(epochs[: e + 1])
        for low, high in ((0, 10), (10, 40)):
            counts = np.bincount(seen[(seen >= low) & (seen < high)] - low, minlength=high - low)
            assert counts.max() - counts.min() <= 1, (e, low)
    assert set(np.concatenate([o[o < 10] for o in epochs[:1]]).tolist()) == set(range(10))  # a: 2.8 passes
    b_drawn = np.concatenate([o[o >= 10] for o in epochs[:2]])  # 24 of b's 30: none twice
    assert len(set(b_drawn.tolist())) == 24
    assert set(np.concatenate([o[o >= 10] for o in epochs[:3]]).tolist()) == set(range(10, 40))
    assert "a.jsonl: 10 samples kept" in mixed.report.summary() and "1 skipped" in mixed.report.summary()
    assert "gives 28 of each epoch's 40 samples (weight 0.7, 2.80 passes)" in mixed.report.summary()
    assert mixed.report.kept == 40 and mixed.report.num_skipped == 1


def test_order_is_deterministic_from_the_seed_and_unshuffled_is_interleaved(sources, processor):
    mixed = _mixed(sources, processor)
    same = _mixed(sources, processor)
    assert np.array_equal(mixed.epoch_order(1, 3, True), same.epoch_order(1, 3, True))
    assert not np.array_equal(mixed.epoch_order(1, 3, True), mixed.epoch_order(2, 3, True))
    assert not np.array_equal(mixed.epoch_order(1, 3, True), mixed.epoch_order(1, 4, True))
    plain = mixed.epoch_order(1, 0, shuffle=False)
    assert plain[:10].tolist() == [0, 10, 1, 2, 3, 11, 4, 5, 12, 6]  # a, a, b ... evenly, each in order
    assert quotas([10, 30], [1, 1]) == [20, 20] and sum(quotas([7, 5, 3], [0.5, 0.25, 0.25])) == 15


def test_resume_continues_the_same_samples_in_the_same_order(sources, processor):
    mixed = _mixed(sources, processor)
    whole = ResumableDistributedSampler.for_dataset(mixed, dp_rank=0, dp_size=1, seed=3)
    stream = [next(iter(whole)) for _ in range(130)]  # past three epochs
    ranks = [ResumableDistributedSampler.for_dataset(mixed, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for sampler in ranks:
        sampler.skip(25)  # 50 samples trained on 2 ranks, then saved
    state = ranks[0].state_dict()
    resumed = ResumableDistributedSampler.for_dataset(
        _mixed(sources, processor), dp_rank=0, dp_size=1, seed=3
    )
    resumed.load_state_dict(state)
    assert [next(iter(resumed)) for _ in range(80)] == stream[50:]
    assert [next(iter(ranks[1])) for _ in range(3)] == stream[51:56:2]


def test_recipe_mixture_keys(tmp_path):
    base = ["model.name_or_path=m"]
    cfg = load_config(
        None, [*base, "data.mixture=[{file: a.jsonl, weight: 0.7}, {file: b.parquet, weight: 0.3}]"]
    )
    assert [(m.file, m.weight) for m in cfg.data.mixture] == [("a.jsonl", 0.7), ("b.parquet", 0.3)]
    with pytest.raises(ConfigError, match=r"unknown config key 'data.mixture\[0\].wieght'; did you mean"):
        load_config(None, [*base, "data.mixture=[{file: a.jsonl, wieght: 1}]"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, [*base, "data.train_file=a.jsonl", "data.mixture=[{file: b.jsonl}]"])
    with pytest.raises(ConfigError, match=r"data.mixture\[1\] needs a file and a weight > 0"):
        load_config(None, [*base, "data.mixture=[{file: a.jsonl}, {file: b.jsonl, weight: 0}]"])


def test_non_finite_step_names_each_samples_own_source_file_and_row(sources, processor):
    """With data.mixture, data.train_file is empty: the message names each sample's file and line/row."""
    from ntil_ds.data.batch import MicroBatch
    from ntil_ds.dist import DistInfo
    from ntil_ds.nonfinite import NonFiniteLossError, raise_non_finite_gradient, raise_non_finite_loss

    mixed = _mixed(sources, processor)
    cfg = load_config(None, ["model.name_or_path=m", "data.mixture=[{file: a.jsonl, weight: 1}]"])
    tensors = {"targets": torch.tensor([[5, -100]]), "attention_mask": torch.ones(1, 2, dtype=torch.long)}
    batches = [MicroBatch([3, 12], tensors), MicroBatch([39], tensors)]
    a, b = (file for file, _ in sources)
    with pytest.raises(NonFiniteLossError) as loss_error:
        raise_non_finite_loss(2, cfg, DistInfo(), batches, [1.0, float("nan")], mixed, applied=False)
    assert f"micro-batch 1 of the step, samples [39] ({b}:row 29): loss_sum=nan" in str(loss_error.value)
    assert "micro-batch 0" not in str(loss_error.value)
    with pytest.raises(NonFiniteLossError) as gradient_error:
        raise_non_finite_gradient(2, cfg, DistInfo(), batches, mixed)
    # a.jsonl's sample 3 is its line 4; b.parquet's rows count from 0 (sample 12 is mixed index 10 + 2)
    assert f"samples of the step: [3, 12, 39] ({a}:4, {b}:row 2, {b}:row 29)." in str(gradient_error.value)
    plain = load_dataset(a, processor, 64, "skip", cache=False)  # the uncached dataset names them too
    assert [plain.sample_name(i) for i in (0, 9)] == [f"{a}:1", f"{a}:10"]
