"""The CPU thread governor (runtime/worker/threads.py): the cores a process may use, the load
other processes put on them, the count it picks and when it changes it. Logic, not timings."""

import os
import subprocess
import sys
import time

import pytest
import torch

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.worker import threads as T


class FakeLoad:
    """Hands out the `others` readings it is given, one per call."""

    def __init__(self, readings):
        self.readings = list(readings)

    def others(self):
        return self.readings.pop(0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def governor(readings, cores=2, setting="auto"):
    clock, applied = Clock(), []
    g = T.ThreadGovernor(
        setting, cores=cores, load=FakeLoad(readings), clock=clock, apply=applied.append
    )
    return g, clock, applied


def ticks(g, clock, n, dt=0.5):
    seen = []
    for _ in range(n):
        clock.t += dt
        seen.append(g.tick())
    return seen


@pytest.mark.parametrize(
    "cores, others, want",
    [
        (2, 0.0, 2),
        (2, 0.3, 2),
        (2, 0.49, 2),
        (2, 0.5, 1),
        (2, 0.67, 1),  # one busy process sharing a core with our two threads
        (2, 1.0, 1),
        (2, 3.0, 1),  # never below one
        (16, 1.0, 15),
        (16, 0.4, 16),
        (16, 2.6, 13),
        (1, 0.9, 1),
    ],
)
def test_threads_for_leaves_the_cores_others_use(cores, others, want):
    assert T.threads_for(cores, others) == want


def test_first_reading_applies_at_once_later_ones_need_two_in_a_row():
    g, clock, applied = governor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.1])
    assert applied == [2] and g.threads == 2  # the start: every core
    assert ticks(g, clock, 1) == [1]  # first reading: one process busy -> one thread at once
    assert g.changes == 1
    # 1.0 (stays), 0.0 (one reading: pending), 1.0 (back: the blip is forgotten), 0.0, 0.0 -> 2
    assert ticks(g, clock, 5) == [1, 1, 1, 1, 2]
    assert g.changes == 2 and applied[-1] == 2


def test_readings_wait_for_the_interval():
    g, clock, _ = governor([1.0])
    clock.t = 0.2
    assert g.tick() == 2 and g.readings == 0  # too early: no reading taken
    clock.t = 0.6
    assert g.tick() == 1 and g.readings == 1


def test_no_reading_keeps_the_count():
    g, clock, _ = governor([None, None])
    assert ticks(g, clock, 2) == [2, 2] and g.changes == 0


def test_a_fixed_count_ignores_the_load_and_puts_itself_back():
    g, clock, applied = governor([], setting=3)
    assert g.threads == 3 and applied == [3] and g.load is None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # somebody else changed it
        clock.t += 10
        assert g.tick() == 3 and applied == [3, 3]
    finally:
        torch.set_num_threads(before)
    assert "fixed" in g.describe()


def test_auto_is_capped_by_omp_num_threads(monkeypatch):
    monkeypatch.setattr(T, "usable_cores", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    g = T.ThreadGovernor("auto", load=FakeLoad([]), apply=lambda n: None)
    assert g.cores == 3 and g.threads == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    g = T.ThreadGovernor("auto", load=FakeLoad([]), apply=lambda n: None)
    assert g.cores == 8


@pytest.mark.parametrize(
    "value, want", [("auto", "auto"), ("AUTO", "auto"), (None, "auto"), ("3", 3), (2, 2)]
)
def test_cpu_threads_setting_reads(value, want):
    assert T.parse_cpu_threads(value) == want


@pytest.mark.parametrize("value", ["two", "0", 0, -1, True, "1.5"])
def test_cpu_threads_setting_refuses_with_one_line(value, tiny_checkpoint):
    with pytest.raises(ValueError, match=r"^cpu_threads: .*") as e:
        EngineConfig(model=str(tiny_checkpoint), cpu_threads=value)
    assert "\n" not in str(e.value)


# -- the cores this process may use ----------------------------------------------------------


def _cgroup_v2(tmp_path, quota, nested_quota=None):
    root = tmp_path / "cg"
    inner = root / "a" / "b"
    inner.mkdir(parents=True)
    (root / "a" / "cpu.max").write_text(f"{quota} 100000\n")
    (inner / "cpu.max").write_text(f"{nested_quota or 'max'} 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    return root, proc


def test_cgroup_v2_quota_the_tightest_ancestor_counts(tmp_path):
    root, proc = _cgroup_v2(tmp_path, 150000)
    assert T.cgroup_cpu_limit(root, proc) == pytest.approx(1.5)
    root, proc = _cgroup_v2(tmp_path / "2", 400000, nested_quota=250000)
    assert T.cgroup_cpu_limit(root, proc) == pytest.approx(2.5)
    root, proc = _cgroup_v2(tmp_path / "3", "max")
    assert T.cgroup_cpu_limit(root, proc) is None


def test_cgroup_v1_quota(tmp_path):
    d = tmp_path / "cg" / "cpu,cpuacct" / "job"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("50000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job\n3:cpu,cpuacct:/job\n")
    assert T.cgroup_cpu_limit(tmp_path / "cg", proc) == pytest.approx(0.5)
    (d / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert T.cgroup_cpu_limit(tmp_path / "cg", proc) is None


def test_usable_cores_are_the_affinity_within_the_quota():
    assert T.usable_cores([0, 1, 2, 3], None) == 4
    assert T.usable_cores([0, 1, 2, 3], 1.5) == 1  # a container given 1.5 CPUs: one thread
    assert T.usable_cores([0, 1, 2, 3], 2.0) == 2
    assert T.usable_cores([0, 1], 8.0) == 2
    assert T.usable_cores([0], 0.2) == 1


# -- the readings --------------------------------------------------------------------------------


def test_proc_stat_busy_counts_only_our_cpus_and_includes_steal(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  100 0 100 1000 0 0 0 0 0 0\n"
        "cpu0 10 1 20 500 7 2 3 4 0 0\n"  # busy: 10+1+20+2+3+4 = 40 (idle, iowait left out)
        "cpu1 50 0 50 500 0 0 0 0 0 0\n"
        "cpu2 1000 0 0 0 0 0 0 0 0 0\n"
        "intr 5\n"
    )
    assert T.read_cpu_busy([0, 1], stat) == 140
    assert T.read_cpu_busy([0], stat) == 40
    assert T.read_cpu_busy([7], stat) is None


def test_own_ticks_read_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    stat = tmp_path / "stat"
    rest = "S 1 2 3 4 5 6 7 8 9 10 " + "123 45" + " 0 0 20 0 3"
    stat.write_text(f"4242 (py (x) thing) {rest}\n")
    assert T.read_own_ticks(stat) == 168


def test_cpu_load_is_others_busy_ticks_over_time():
    clock = Clock()
    busy, own = iter([1000, 1150]), iter([500, 550])
    load = T.CpuLoad([0, 1], clock=clock, busy=lambda cpus: next(busy), own=lambda: next(own))
    clock.t = 1.0
    # 150 busy ticks in 1 s, 50 of them ours: others used 100 ticks = one core at 100 Hz
    assert load.others() == pytest.approx(100 / T._TICKS)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_busy_process_on_the_machine_is_seen_and_a_thread_steps_aside():
    """The real /proc readings: one spinning child shows up as about a core of others' work, and
    the governor gives the engine one thread fewer (and all of them back once it stops)."""
    cpus = sorted(os.sched_getaffinity(0))
    g = T.ThreadGovernor("auto", cores=len(cpus), interval_s=0.3, apply=lambda n: None)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 10
        while g.threads == len(cpus) and time.monotonic() < deadline:
            time.sleep(0.35)
            g.tick()
        assert g.others is not None and g.others > 0.5
        assert g.threads <= len(cpus) - 1
    finally:
        spin.kill()
        spin.wait()
    deadline = time.monotonic() + 10
    while g.threads < len(cpus) and time.monotonic() < deadline:
        time.sleep(0.35)
        g.tick()
    assert g.threads == len(cpus) - (1 if g.others and g.others >= T.ROUND_AT else 0)


def test_the_engine_computes_with_the_governed_threads(tiny_checkpoint):
    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.llm import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_checkpoint), device="cpu", cpu_threads=1, dtype="float32")
        torch.set_num_threads(2)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert torch.get_num_threads() == 1  # the step put its fixed count back
        stats = llm.engine.stats()
        assert (stats.cpu_threads, stats.cpu_thread_changes) == (1, 0)
    finally:
        torch.set_num_threads(before)


def test_the_serve_flag_reaches_the_engine(tiny_checkpoint):
    from slimserve.runtime.serve_options import ServeOptions, engine_kwargs

    kw = engine_kwargs(ServeOptions(artifact=str(tiny_checkpoint), cpu_threads="3"))
    assert EngineConfig(**kw).cpu_threads == 3
    kw = engine_kwargs(ServeOptions(artifact=str(tiny_checkpoint)))
    assert EngineConfig(**kw).cpu_threads == "auto"
