"""Wall-clock medians (``nefl_zoo.timing``) on a fake clock, and the memory check of a batch
(``nefl_zoo.memory``) on fake ``/proc/meminfo`` and cgroup files: exact numbers and messages."""

import itertools

import pytest

from nefl_zoo import memory, timing


class FakeClock:
    """``time.perf_counter`` whose every timed call of ``fn`` lasts the next of ``durations`` ms."""

    def __init__(self, durations_ms):
        self.durations = iter(durations_ms)
        self.now = 0.0
        self.reads = 0

    def perf_counter(self):
        self.reads += 1
        if self.reads % 2 == 0:  # the read after a call: that call's duration has passed
            self.now += next(self.durations) / 1e3
        return self.now


def test_median_ms_times_only_the_runs_after_the_warmup(monkeypatch):
    clock = FakeClock([3.0, 1.0, 2.0])
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    calls = []
    assert timing.median_ms(lambda: calls.append(1), runs=3, warmup=2) == pytest.approx(2.0)
    assert len(calls) == 5 and clock.reads == 6  # 2 untimed calls, then 3 timed ones


def test_median_ms_of_an_even_count_is_the_mean_of_the_middle_two(monkeypatch):
    monkeypatch.setattr(timing.time, "perf_counter", FakeClock([4.0, 1.0, 3.0, 2.0]).perf_counter)
    calls = []
    assert timing.median_ms(lambda: calls.append(1), runs=4) == pytest.approx(2.5)
    assert len(calls) == 5  # the default warmup is one call


def test_interleaved_medians_take_turns_and_skip_the_warmup_rounds(monkeypatch):
    order = []
    durations = {"a": itertools.count(10.0, 10.0), "b": itertools.count(1.0, 1.0)}  # a: 10, 20, 30 ms; b: 1, 2, 3
    clock = FakeClock(iter(lambda: next(durations[order[-1]]), None))
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    medians = timing.interleaved_median_ms(fns, rounds=2, warmup_rounds=1)
    assert order == ["a", "b"] * 3  # every function in turn, round by round
    assert medians == {"a": pytest.approx(25.0), "b": pytest.approx(2.5)}  # round 1 (10 ms, 1 ms) untimed


def test_interleaved_medians_pass_runs_and_warmup_to_each_turn(monkeypatch):
    clock = FakeClock(itertools.repeat(1.0))
    monkeypatch.setattr(timing.time, "perf_counter", clock.perf_counter)
    calls = []
    assert timing.interleaved_median_ms({"x": lambda: calls.append(1)}, rounds=2, runs=3, warmup=1) == {"x": pytest.approx(1.0)}
    assert len(calls) == 2 * (3 + 1) and clock.reads == 2 * 3 * 2


# -- memory -------------------------------------------------------------------------------------
@pytest.fixture
def fake_system(tmp_path, monkeypatch):
    """``memory``'s view of /proc and /sys redirected into ``tmp_path``; returns a writer."""
    monkeypatch.setattr(memory, "Path", lambda path: tmp_path / str(path).lstrip("/"))

    def write(path: str, text: str) -> None:
        target = tmp_path / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)

    return write


def test_available_memory_is_memavailable_in_bytes(fake_system):
    fake_system("/proc/meminfo", "MemTotal: 900 kB\nMemFree: 100 kB\nMemAvailable: 500 kB\nBuffers: 1 kB\n")
    fake_system("/sys/fs/cgroup/memory.max", "max\n")  # no cgroup limit
    fake_system("/sys/fs/cgroup/memory.current", "1\n")
    assert memory.available_memory_bytes() == 500 * 1024


def test_a_cgroup_limit_caps_the_available_memory(fake_system):
    fake_system("/proc/meminfo", "MemAvailable: 500 kB\n")
    fake_system("/sys/fs/cgroup/memory.max", "300000\n")
    fake_system("/sys/fs/cgroup/memory.current", "100000\n")
    assert memory.available_memory_bytes() == 200000
    fake_system("/sys/fs/cgroup/memory.max", "900000\n")  # a limit above MemAvailable does not raise it
    assert memory.available_memory_bytes() == 500 * 1024
    fake_system("/sys/fs/cgroup/memory.current", "950000\n")  # over the limit: nothing left, never negative
    assert memory.available_memory_bytes() == 0


def test_without_meminfo_the_physical_memory_is_the_bound(fake_system, monkeypatch):
    monkeypatch.setattr(memory.os, "sysconf", {"SC_PHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}.__getitem__)
    assert memory.available_memory_bytes() == 4096000
    fake_system("/proc/meminfo", "MemTotal: 900 kB\n")  # no MemAvailable line
    assert memory.available_memory_bytes() == 4096000


def test_unknown_memory_is_none(fake_system, monkeypatch):
    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(memory.os, "sysconf", no_sysconf)
    assert memory.available_memory_bytes() is None
    fake_system("/proc/meminfo", "MemAvailable: many kB\n")  # unreadable: skipped as absent
    assert memory.available_memory_bytes() is None


@pytest.mark.parametrize("n,shown", [(0, "0 bytes"), (1023, "1,023 bytes"), (1024, "1.0 KiB"), (1536 * 1024, "1.5 MiB"),
                                     (3 * 1024**3, "3.0 GiB"), (1024**4, "1.0 TiB"), (5 * 1024**6, "5,120.0 PiB")])
def test_sizes_are_shown_in_binary_units(n, shown):
    assert memory._size(n) == shown


def test_a_batch_that_fits_passes_and_one_that_does_not_names_the_largest_that_fits(monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: 10 * 1024)
    memory.check_batch_memory(9, 1024, fixed_bytes=1024)  # exactly all of it
    with pytest.raises(ValueError) as refused:
        memory.check_batch_memory(10, 1024, fixed_bytes=1024, what="4x the working set")
    assert str(refused.value) == ("batch 10: needs about 11.0 KiB (4x the working set), more than the 10.0 KiB of "
                                  "memory available; use a batch of at most 9")
    with pytest.raises(ValueError, match=r"^batch 3: needs about 12.0 KiB, more than the 10.0 KiB of memory "
                                         r"available; use a batch of at most 0$"):
        memory.check_batch_memory(3, 0, fixed_bytes=12 * 1024)  # the fixed part alone does not fit
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: None)
    memory.check_batch_memory(10**12, 1024)  # unknown memory: not checked
