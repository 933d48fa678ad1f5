"""StepPrefetcher: loading a step ahead never moves the data position, and stale batches are not used."""

import torch

from flash_models.train.data import StepSampler, collate_lm
from flash_models.train.prefetch import StepPrefetcher


def _dataset(n=10, seq=4):
    return [{"input_ids": torch.full((seq,), i), "labels": torch.full((seq,), i), "seqlens": None} for i in range(n)]


def _prefetcher(sampler):
    return StepPrefetcher(sampler, _dataset(), 2, collate_lm, torch.device("cpu"),
                          units=lambda b: int(b["labels"].numel()))


def test_prefetched_steps_are_the_sampler_steps_and_keep_its_position():
    plain = StepSampler(10, global_batch=4, seed=3)
    sampler = StepSampler(10, global_batch=4, seed=3)
    loader = _prefetcher(sampler)
    for _ in range(6):  # crosses epochs (10 items, 4 per step)
        before = sampler.state_dict()
        loader.prefetch()
        assert sampler.state_dict() == before, "prefetching moved the position a checkpoint records"
        step = loader.next_step()
        expected = plain.next_step()
        assert step.indices == expected
        assert [int(b["input_ids"][r, 0]) for b in step.batches for r in range(2)] == expected
        assert step.units == [8, 8]
        assert sampler.state_dict() == plain.state_dict()


def test_a_sampler_moved_after_prefetch_invalidates_the_prefetched_step():
    sampler = StepSampler(10, global_batch=4, seed=3)
    loader = _prefetcher(sampler)
    first = loader.next_step().indices
    loader.prefetch()  # would be the second step
    sampler.load_state_dict({"epoch": 0, "cursor": 0})  # a checkpoint from the start is loaded
    assert loader.next_step().indices == first


class _RandomlyAugmented:
    """Items that draw from torch's, Python's and numpy's generators as they load, as timm's crops do."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        import random

        import numpy as np

        noise = float(torch.rand(())) + random.random() + float(np.random.rand())
        return {"input_ids": torch.full((4,), i), "labels": torch.full((4,), noise), "seqlens": None}


def test_prefetching_leaves_the_generators_where_loading_the_step_then_would():
    """A checkpoint taken after a prefetch records the generators; a run resumed from it loads that step itself,
    and must draw what the uninterrupted run drew for it."""
    from flash_models.train.checkpoint import rng_state, set_rng_state

    torch.manual_seed(0)
    sampler = StepSampler(10, global_batch=4, seed=3)
    loader = StepPrefetcher(sampler, _RandomlyAugmented(), 2, collate_lm, torch.device("cpu"), units=lambda b: 8)
    loader.next_step()
    before = rng_state()
    loader.prefetch()
    assert torch.equal(torch.get_rng_state(), before["torch"]), "prefetching moved the generators a checkpoint records"
    prefetched = loader.next_step()
    after_prefetched = torch.rand(3)

    set_rng_state(before)  # a resumed run: same generators and data position, nothing prefetched
    resumed = StepSampler(10, global_batch=4, seed=3)
    resumed.load_state_dict(StepSampler(10, global_batch=4, seed=3).state_dict() | {"cursor": 4})
    loaded = StepPrefetcher(resumed, _RandomlyAugmented(), 2, collate_lm, torch.device("cpu"), units=lambda b: 8).next_step()
    assert loaded.indices == prefetched.indices
    for a, b in zip(loaded.batches, prefetched.batches):
        assert torch.equal(a["labels"], b["labels"])
    assert torch.equal(torch.rand(3), after_prefetched), "the step after the load drew different numbers"
