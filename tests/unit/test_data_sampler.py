"""ResumableDistributedSampler: disjoint and complete over data-parallel ranks, identical within a
tensor-parallel group, deterministic from the seed, and resumable at the next unseen sample."""

import itertools

import pytest

from ntil_ds.data import ResumableDistributedSampler


def _take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def _stream(num_samples, dp_size, per_rank, seed=0, shuffle=True):
    """The global order rebuilt from what each rank drew: position k*dp + r is rank r's k-th sample."""
    ranks = [
        _take(ResumableDistributedSampler(num_samples, r, dp_size, seed, shuffle), per_rank)
        for r in range(dp_size)
    ]
    return [ranks[position % dp_size][position // dp_size] for position in range(per_rank * dp_size)]


@pytest.mark.parametrize(("num_samples", "dp_size"), [(12, 3), (10, 3), (7, 2), (5, 1)])
def test_every_epoch_covers_every_sample_once_over_the_ranks(num_samples, dp_size):
    epochs = 3
    per_rank = num_samples * epochs // dp_size
    stream = _stream(num_samples, dp_size, per_rank)
    whole_epochs = len(stream) // num_samples
    orders = [stream[e * num_samples : (e + 1) * num_samples] for e in range(whole_epochs)]
    for order in orders:
        assert sorted(order) == list(range(num_samples))
    assert len({tuple(o) for o in orders}) == len(orders)  # reshuffled each epoch


def test_same_seed_same_order_and_no_shuffle_is_in_order():
    assert _stream(50, 2, 40, seed=7) == _stream(50, 2, 40, seed=7)
    assert _stream(50, 2, 40, seed=7) != _stream(50, 2, 40, seed=8)
    assert _stream(6, 2, 6, shuffle=False) == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]


def test_tensor_parallel_ranks_get_identical_samples():
    tp_size, dp_size = 2, 2  # 4 processes: ranks (0, 1) and (2, 3) form tensor-parallel groups
    draws = [
        _take(ResumableDistributedSampler(20, rank // tp_size, dp_size, seed=3), 15) for rank in range(4)
    ]
    assert draws[0] == draws[1] and draws[2] == draws[3]
    assert not set(draws[0][:10]) & set(draws[2][:10])


def test_resume_continues_with_the_next_unseen_sample():
    uninterrupted = _stream(13, 2, 20, seed=1)
    ranks = [ResumableDistributedSampler(13, r, 2, seed=1) for r in range(2)]
    seen = [_take(s, 7) for s in ranks]  # 7 steps of one sample per rank
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()  # any rank's state serves all
    assert state["consumed_samples"] == 14
    resumed = [ResumableDistributedSampler(13, r, 2, seed=1) for r in range(2)]
    for sampler in resumed:
        sampler.load_state_dict(state)
    after = [_take(s, 13) for s in resumed]
    rebuilt = [[*seen[r], *after[r]] for r in range(2)]
    assert [rebuilt[p % 2][p // 2] for p in range(40)] == uninterrupted


def test_resume_on_a_different_number_of_ranks():
    uninterrupted = _stream(11, 1, 30, seed=2)
    two = [ResumableDistributedSampler(11, r, 2, seed=2) for r in range(2)]
    for sampler in two:
        _take(sampler, 6)  # 12 samples consumed in all
    three = [ResumableDistributedSampler(11, r, 3, seed=2) for r in range(3)]
    for sampler in three:
        sampler.load_state_dict(two[0].state_dict())
    assert [_take(s, 1)[0] for s in three] == uninterrupted[12:15]
    four = ResumableDistributedSampler(11, 0, 5, seed=2)
    with pytest.raises(ValueError, match="not a multiple of the 5 data-parallel ranks"):
        four.load_state_dict(two[0].state_dict())


def test_resume_refuses_other_data_or_seed():
    state = ResumableDistributedSampler(10, 0, 1, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_samples=10.*same data file"):
        ResumableDistributedSampler(11, 0, 1, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0"):
        ResumableDistributedSampler(10, 0, 1, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="dp_rank must be in"):
        ResumableDistributedSampler(10, 2, 2, seed=0)
