"""The CPU's measured matmul peak, cached on disk (``minishard.run.profiling``): measured once per
machine, measured again on request (the higher kept) or when the cache is unreadable, and a cache
that cannot be written never stops a run. The measurement itself is stubbed: these tests are about
the cache."""

from __future__ import annotations

import json

import jax
import pytest

from minishard.run import profiling
from minishard.run.profiling import MEASURE_AGAIN, PEAK_CACHE, cache_directory, cached_peak, peak_key


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """The cache under ``tmp_path`` (never the user's home); the peaks "measured", 1, 2, 3 ... GFLOP/s."""
    monkeypatch.setenv("MINISHARD_CACHE_DIR", str(tmp_path / "minishard"))
    monkeypatch.delenv(MEASURE_AGAIN, raising=False)
    calls: list[tuple[jax.Device, ...]] = []

    def measure(devices):
        calls.append(devices)
        return 1e9 * len(calls)

    monkeypatch.setattr(profiling, "measured_peak", measure)
    return calls


def devices(n: int = 2) -> tuple[jax.Device, ...]:
    return tuple(jax.devices()[:n])


def test_the_peak_is_measured_once_and_read_back(measured, tmp_path):
    path = tmp_path / "minishard" / PEAK_CACHE
    flops, said = cached_peak(devices())
    assert (flops, said) == (1e9, f"measured: a 512² matmul on each device; cached in {path}")
    entry = json.loads(path.read_text())[peak_key(devices())]
    assert entry["flops"] == 1e9
    again, said = cached_peak(devices())
    assert again == 1e9 and len(measured) == 1
    assert said.startswith(f"a 512² matmul on each device, measured {entry['measured']}, cached in {path}")
    assert said.endswith(f"; {MEASURE_AGAIN}=1 measures again")


def test_another_device_count_is_another_entry(measured, tmp_path):
    assert cached_peak(devices(2))[0] == 1e9
    assert cached_peak(devices(4))[0] == 2e9
    assert cached_peak(devices(2))[0] == 1e9 and len(measured) == 2
    assert len(json.loads((tmp_path / "minishard" / PEAK_CACHE).read_text())) == 2


def test_the_key_names_what_the_peak_depends_on(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    key = peak_key(devices(4))
    assert key.startswith("4 x cpu cpu; ") and f"jax {jax.__version__}" in key and "512² float32" in key
    assert "XLA_FLAGS --xla_force_host_platform_device_count=8" in key
    assert profiling.cpu_model() in key
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
    assert peak_key(devices(4)) != key  # a slower compiler's peak is not the default's


def test_measured_again_a_higher_peak_replaces_the_entry(measured, monkeypatch, tmp_path):
    cached_peak(devices())
    monkeypatch.setenv(MEASURE_AGAIN, "1")
    flops, said = cached_peak(devices())
    assert flops == 2e9 and said.startswith("measured again: a 512² matmul on each device; cached in")
    monkeypatch.setenv(MEASURE_AGAIN, "0")  # 0 is off
    assert cached_peak(devices())[0] == 2e9 and len(measured) == 2


def test_a_peak_measured_again_on_a_busy_machine_keeps_the_cached_higher_one(monkeypatch, tmp_path):
    monkeypatch.setenv("MINISHARD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(MEASURE_AGAIN, raising=False)
    runs = iter([3e9, 1e9])  # a quiet minute's peak, then a busy one's
    monkeypatch.setattr(profiling, "measured_peak", lambda devices: next(runs))
    cached_peak(devices())
    entry = json.loads((tmp_path / PEAK_CACHE).read_text())[peak_key(devices())]
    monkeypatch.setenv(MEASURE_AGAIN, "1")
    flops, said = cached_peak(devices())
    assert flops == 3e9
    kept = f"kept the higher, {entry['measured']}'s in {tmp_path / PEAK_CACHE}"
    assert said == f"measured again: a 512² matmul on each device at 1 GFLOP/s, {kept}"
    assert json.loads((tmp_path / PEAK_CACHE).read_text())[peak_key(devices())] == entry


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{not json", "JSONDecodeError: Expecting property name"),
        ('{"key": {"flops": "fast", "measured": "today"}}', 'not {key: {"flops": F, "measured": T}, ...}'),
        ("[1e9]", 'not {key: {"flops": F, "measured": T}, ...}'),
        (b"\xff\xfe", "UnicodeDecodeError"),
    ],
)
def test_an_unreadable_cache_is_measured_again_rewritten_and_said(measured, tmp_path, text, why):
    path = tmp_path / "minishard" / PEAK_CACHE
    path.parent.mkdir()
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    flops, said = cached_peak(devices())
    assert flops == 1e9 and len(measured) == 1
    assert said.startswith(f"measured: a 512² matmul on each device; the cache was unreadable ({why}")
    assert said.endswith(f"; cached in {path}")
    (entry,) = json.loads(path.read_text()).items()
    assert entry[0] == peak_key(devices()) and entry[1]["flops"] == 1e9


def test_a_cache_that_cannot_be_written_is_measured_and_said_and_the_run_goes_on(measured, tmp_path):
    (tmp_path / "minishard").write_text("a file where the cache's directory would be")
    path = tmp_path / "minishard" / PEAK_CACHE
    flops, said = cached_peak(devices())
    assert flops == 1e9 and said.startswith(
        "measured: a 512² matmul on each device; the cache was unreadable"
    )
    assert said.endswith(f"; not cached: cannot write {path} (File exists)")
    assert cached_peak(devices())[0] == 2e9  # nothing was kept: measured again (in a run, once a process)


def test_a_failed_write_leaves_no_half_written_file(measured, monkeypatch, tmp_path):
    def refuse(source, target):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(profiling.os, "replace", refuse)
    flops, said = cached_peak(devices())
    path = tmp_path / "minishard" / PEAK_CACHE
    assert flops == 1e9 and said.endswith(f"; not cached: cannot write {path} (Permission denied)")
    assert list(path.parent.iterdir()) == []


def test_the_cache_directory_is_minishards_own_else_xdgs_else_the_homes(monkeypatch, tmp_path):
    monkeypatch.setenv("MINISHARD_CACHE_DIR", str(tmp_path / "own"))  # the suite's (conftest)
    assert cache_directory() == tmp_path / "own"
    monkeypatch.delenv("MINISHARD_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory() == tmp_path / "xdg" / "minishard"
    for unset in ("", "relative/cache"):  # the XDG spec: a relative path is ignored
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert cache_directory() == tmp_path / "home" / ".cache" / "minishard"
