"""flash_models.bench.measure: the user-facing benchmark helpers."""

import pytest


def test_the_old_name_of_bench_measure_warns_and_gives_its_functions():
    import importlib
    import sys

    from flash_models.bench import measure

    sys.modules.pop("flash_models.bench.utils", None)
    with pytest.warns(DeprecationWarning, match="flash_models.bench.measure"):
        old = importlib.import_module("flash_models.bench.utils")
    assert old.benchmark_forward is measure.benchmark_forward
