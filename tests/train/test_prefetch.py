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
