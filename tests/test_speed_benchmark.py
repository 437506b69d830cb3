"""benchmarks/speed.py's helpers: the split of configs into runs that fit the machine's memory, and
its probe of what touching fresh memory costs."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "speed.py"


@pytest.fixture(scope="module")
def speed():
    spec = importlib.util.spec_from_file_location("speed_benchmark", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFIGS = ["default", "lc", "adaptive"]


def test_configs_that_fit_run_together(speed) -> None:
    assert speed.config_groups(CONFIGS, 256, 21 << 30) == [CONFIGS]
    assert speed.config_groups(CONFIGS, 1024, 128 << 30) == [CONFIGS]
    assert speed.config_groups(CONFIGS, 1024, None) == [CONFIGS]


def test_a_1_gb_run_of_three_configs_is_split_on_a_24_gb_machine(speed) -> None:
    # the configuration the OOM killer stopped (23 GiB machine, ~20 GiB available)
    groups = speed.config_groups(CONFIGS, 1024, 20 << 30)
    assert groups == [["default", "lc"], ["adaptive"]]


def test_every_config_runs_once_and_at_least_one_per_run(speed) -> None:
    for memory in (1 << 30, 8 << 30, 16 << 30, 40 << 30):
        groups = speed.config_groups(CONFIGS, 1024, memory)
        assert [c for g in groups for c in g] == CONFIGS
        assert all(groups)


def test_available_memory_reads_meminfo(speed) -> None:
    memory = speed.available_memory()
    if pathlib.Path("/proc/meminfo").exists():
        assert memory is not None and memory > 0
    else:
        assert memory is None


def test_first_touch_probe_times_two_fresh_regions(speed) -> None:
    cold, warm = speed.first_touch_ms_per_mb(4)
    assert 0 < cold < 1e4 and 0 < warm < 1e4
