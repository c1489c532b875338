"""PowerLimits on a fake zeus GPU layer and monitor (no GPU needed): choosing, setting and restoring limits."""

import atexit
import signal

import pytest
import torch
from zeus.device.gpu import ZeusGPUInitError, ZeusGPUNoPermissionError
from zeus.monitor import Measurement
from zeus.optimizer import power_limit as zpl

from conveyor.config import parse_power_limit as check_power_limit_spec
from conveyor.energy._power import PowerLimits, ProfiledLimit

ORIGINAL_MW = 280_000  # every fake GPU starts here: neither the maximum nor a profiled limit, so a restore shows
LIMITS_W = (300, 250, 200, 150)  # range 100..300 W in steps of 50 W, profiled from the top: 300, 250, 200, 150, 100
# One profiling window's (time s, energy J) at each limit. Cost = eta * E + (1 - eta) * 300 W * T (one GPU):
#   eta = 0.5: 300: 1500 + 1500 = 3000   250: 1250 + 1575 = 2825   200: 1100 + 1800 = 2900
#              150: 1000 + 2400 = 3400   100: 1100 + 3750 = 4850   -> 250 W
#   eta = 1.0 (energy alone): 3000, 2500, 2200, 2000, 2200 -> 150 W;   eta = 0.0 (time alone): 10 s -> 300 W
WINDOW = {300: (10.0, 3000.0), 250: (10.5, 2500.0), 200: (12.0, 2200.0), 150: (16.0, 2000.0), 100: (25.0, 2200.0)}
# With wait_steps=1, warmup_steps=2, profile_steps=3: step 2 sets 300 W, steps 3-4 warm up (step 4 opens the
# window), steps 5-7 profile (step 7 closes it and sets 250 W); each further limit takes 2 + 3 = 5 steps, so the
# last window (100 W) closes at step 7 + 4 * 5 = 27.
AUTO = {"gpu_index": 1, "warmup_steps": 2, "profile_steps": 3, "pl_step_w": 50}
NO_PRIVILEGE = "setting GPU power limits needs the SYS_ADMIN capability (root, or docker run --cap-add SYS_ADMIN): "


class FakeGPUs:
    """What zeus's optimizer calls on ``get_gpus()``'s answer: two GPUs allowed 100..300 W (in mW)."""

    def __init__(self, deny_limits: bool = False, deny_persistence: bool = False) -> None:
        self.limits = [ORIGINAL_MW, ORIGINAL_MW]
        self.persistence = [False, False]
        self.sets: list[tuple[int, int]] = []
        self.deny_limits, self.deny_persistence = deny_limits, deny_persistence

    def __len__(self) -> int:
        return len(self.limits)

    def get_power_management_limit_constraints(self, index: int) -> tuple[int, int]:
        return 100_000, 300_000

    def get_power_management_limit(self, index: int) -> int:
        return self.limits[index]

    def set_power_management_limit(self, index: int, mw: int, block: bool = True) -> None:
        if self.deny_limits:
            raise ZeusGPUNoPermissionError("Insufficient Permissions")
        assert 100_000 <= mw <= 300_000
        self.limits[index] = mw
        self.sets.append((index, mw))

    def get_persistence_mode(self, index: int) -> bool:
        return self.persistence[index]

    def set_persistence_mode(self, index: int, enabled: bool, block: bool = True) -> None:
        if self.deny_persistence:
            raise ZeusGPUNoPermissionError("Insufficient Permissions")
        self.persistence[index] = enabled


class FakeMonitor:
    """A ZeusMonitor on one GPU whose windows last and cost what ``WINDOW`` says for the limit they ran at."""

    def __init__(self, gpus: FakeGPUs, index: int = 1) -> None:
        self.gpus, self.gpu_indices = gpus, [index]
        self.log: list[tuple[str, int]] = []
        self.open: dict[str, int] = {}

    def begin_window(self, key: str, sync_execution: bool = True) -> None:
        self.open[key] = self.gpus.limits[self.gpu_indices[0]]
        self.log.append(("begin", self.open[key] // 1000))

    def end_window(self, key: str, sync_execution: bool = True, cancel: bool = False) -> Measurement:
        limit = self.open.pop(key)
        assert self.gpus.limits[self.gpu_indices[0]] == limit  # the limit held for the whole window
        self.log.append(("cancel" if cancel else "end", limit // 1000))
        time_s, energy_j = (0.0, 0.0) if cancel else WINDOW[limit // 1000]
        return Measurement(time=time_s, gpu_energy={self.gpu_indices[0]: energy_j})


@pytest.fixture(autouse=True)
def exits(monkeypatch: pytest.MonkeyPatch) -> list:
    """The atexit callbacks registered (ours and zeus's), kept here instead of in the interpreter; and SIGTERM's
    handler put back after each test."""
    registered: list = []
    monkeypatch.setattr(atexit, "register", lambda func: registered.append(func) or func)
    monkeypatch.setattr(atexit, "unregister", lambda func: registered.remove(func) if func in registered else None)
    handler = signal.getsignal(signal.SIGTERM)
    yield registered
    signal.signal(signal.SIGTERM, handler)


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> FakeGPUs:
    fake = FakeGPUs()
    monkeypatch.setattr(zpl, "get_gpus", lambda ensure_homogeneous=False: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return fake


def steps(power: PowerLimits, n: int) -> None:
    for _ in range(n):
        power.step_begin()


def test_auto_profiles_every_limit_then_keeps_the_cheapest(gpus: FakeGPUs) -> None:
    monitor = FakeMonitor(gpus)
    with PowerLimits("auto", eta=0.5, monitor=monitor, **AUTO) as power:
        assert gpus.limits[1] == 300_000 and gpus.persistence[1]  # zeus starts at the maximum, persistence on
        steps(power, 26)
        assert power.chosen is None and len(power.profile) == 4
        steps(power, 1)  # step 27 closes the 100 W window
        assert power.chosen == 250 and gpus.limits[1] == 250_000
        assert monitor.log == [(event, w) for w in (*LIMITS_W, 100) for event in ("begin", "end")]
        assert power.profile == [ProfiledLimit(w, *WINDOW[w]) for w in (*LIMITS_W, 100)]
        steps(power, 5)
        power.epoch_end()
        assert gpus.limits[1] == 250_000 and len(monitor.log) == 10  # done: nothing more changes
    assert gpus.limits == [ORIGINAL_MW, ORIGINAL_MW] and gpus.persistence == [False, False]
    assert {index for index, _ in gpus.sets} == {1}  # only this worker's GPU was touched


class StillCounterMonitor(FakeMonitor):
    """Zeus's monitor where NVML's energy counter has not moved during a window (an H200 running the digits' MLP
    for 50 ms windows): 0 J, unless built with ``approx_instant_energy``, which counts power x time (say 100 W)."""

    def __init__(self, gpus: FakeGPUs, index: int, approx_instant_energy: bool) -> None:
        super().__init__(gpus, index)
        self.approx = approx_instant_energy

    def end_window(self, key: str, sync_execution: bool = True, cancel: bool = False) -> Measurement:
        window = super().end_window(key, sync_execution, cancel)
        energy = 100.0 * window.time if self.approx else 0.0
        return Measurement(time=window.time, gpu_energy={self.gpu_indices[0]: energy})


def test_auto_with_its_own_monitor_profiles_windows_the_energy_counter_missed(
    gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zeus refuses a profiling window of 0 J (a validation error that stopped the worker on the H200); the
    monitor PowerLimits builds for itself counts such a window as power x time, so every limit is profiled."""
    import zeus.monitor

    def monitor(gpu_indices: list[int], cpu_indices: list[int], approx_instant_energy: bool = False) -> FakeMonitor:
        return StillCounterMonitor(gpus, gpu_indices[0], approx_instant_energy)

    monkeypatch.setattr(zeus.monitor, "ZeusMonitor", monitor)
    with PowerLimits("auto", eta=1.0, **AUTO) as power:
        steps(power, 27)
        assert len(power.profile) == 5 and all(p.energy_j == 100.0 * p.time_s for p in power.profile)
        assert power.chosen == 300  # energy is power x time at one power here: the fastest window is cheapest


@pytest.mark.parametrize(("eta", "chosen"), [(0.5, 250), (1.0, 150), (0.0, 300)])
def test_auto_choice_follows_eta(gpus: FakeGPUs, eta: float, chosen: int) -> None:
    with PowerLimits("auto", eta=eta, monitor=FakeMonitor(gpus), **AUTO) as power:
        steps(power, 27)
        assert power.chosen == chosen and gpus.limits[1] == chosen * 1000


def test_window_cut_by_epoch_end_is_retried(gpus: FakeGPUs) -> None:
    monitor = FakeMonitor(gpus)
    with PowerLimits("auto", monitor=monitor, **AUTO) as power:
        steps(power, 10)  # the 250 W window opened at step 9
        power.epoch_end()
        assert monitor.log[-2:] == [("begin", 250), ("cancel", 250)] and gpus.limits[1] == 300_000
        # Next epoch: step 1 sets 250 W again, 2 warm up, 3 more profile (6 steps), then 3 limits * 5 = 15 steps.
        steps(power, 20)
        assert power.chosen is None
        steps(power, 1)
        assert power.chosen == 250
        assert monitor.log[4:8] == [("begin", 250), ("end", 250), ("begin", 200), ("end", 200)]
        assert [p.limit_w for p in power.profile] == [*LIMITS_W, 100]  # the cut window is not among them
    assert gpus.limits[1] == ORIGINAL_MW


@pytest.mark.parametrize(("spec", "expected_w"), [("max", 300), ("200", 200), (150, 150), (" MAX ", 300)])
def test_max_and_fixed_watts(gpus: FakeGPUs, exits: list, spec: str | int, expected_w: int) -> None:
    with PowerLimits(spec, gpu_index=1) as power:
        assert gpus.limits == [ORIGINAL_MW, expected_w * 1000]
        assert power.chosen == expected_w and power.profile == [] and power.original_w == 280.0
        steps(power, 50)
        power.epoch_end()
        assert gpus.limits[1] == expected_w * 1000
        assert len(exits) == 1  # our restore, until closed
    assert gpus.limits == [ORIGINAL_MW, ORIGINAL_MW] and exits == []
    power.close()  # twice is harmless
    assert gpus.limits[1] == ORIGINAL_MW


def test_out_of_range_watts_refused_in_one_line(gpus: FakeGPUs, exits: list) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError) as error:
        PowerLimits("350", gpu_index=1)
    message = (
        "--power-limit 350 W is outside GPU 1's allowed range 100..300 W: pick a wattage in it, or 'max' or 'auto'"
    )
    assert str(error.value) == message
    assert gpus.sets == [] and exits == [] and signal.getsignal(signal.SIGTERM) == handler
    with pytest.raises(ValueError, match="GPU index 2 does not exist: NVML sees 2 GPU"):
        PowerLimits("max", gpu_index=2)


def test_restored_after_an_exception_in_the_with_block(gpus: FakeGPUs) -> None:
    with pytest.raises(KeyError), PowerLimits("auto", monitor=FakeMonitor(gpus), **AUTO) as power:
        steps(power, 14)  # 200 W: set at step 12, its window opened at step 14
        assert gpus.limits[1] == 200_000
        raise KeyError("boom")
    assert gpus.limits[1] == ORIGINAL_MW and not gpus.persistence[1]


def test_original_limit_wins_over_zeus_atexit(gpus: FakeGPUs, exits: list) -> None:
    power = PowerLimits("auto", monitor=FakeMonitor(gpus), **AUTO)
    steps(power, 14)
    assert gpus.limits[1] == 200_000
    ours, zeus = exits  # ours registered first, so the interpreter (last-in first-out) runs it last
    assert ours == power._at_exit and "GlobalPowerLimitOptimizer" in zeus.__qualname__
    zeus()
    assert gpus.limits[1] == 300_000  # zeus's own callback alone would leave the maximum
    for callback in reversed(exits):  # interpreter exit without close(): zeus's, then ours
        callback()
    assert gpus.limits[1] == ORIGINAL_MW and not gpus.persistence[1]


def test_closed_then_exit_leaves_the_original(gpus: FakeGPUs, exits: list) -> None:
    with PowerLimits("auto", monitor=FakeMonitor(gpus), **AUTO) as power:
        steps(power, 14)
    assert gpus.limits[1] == ORIGINAL_MW
    written = len(gpus.sets)
    for callback in reversed(exits):  # close() made zeus's a no-op; ours finds nothing to change
        callback()
    assert gpus.limits[1] == ORIGINAL_MW and len(gpus.sets) == written


def test_sigterm_restores_then_runs_the_earlier_handler(gpus: FakeGPUs) -> None:
    seen: list[int] = []

    def earlier(signum: int, frame: object) -> None:
        seen.append(gpus.limits[1])

    signal.signal(signal.SIGTERM, earlier)
    power = PowerLimits("max", gpu_index=1)
    assert gpus.limits[1] == 300_000
    signal.raise_signal(signal.SIGTERM)
    assert seen == [ORIGINAL_MW]  # restored before the earlier handler ran
    assert signal.getsignal(signal.SIGTERM) == earlier
    power.step_begin()  # closed: changes nothing
    assert power.chosen == 300 and gpus.limits[1] == ORIGINAL_MW


def test_sigterm_default_terminates_after_restoring(gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    PowerLimits("200", gpu_index=1)
    raised: list[int] = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)  # instead of ending the test process
    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # what a real SIGTERM runs
    assert gpus.limits[1] == ORIGINAL_MW and raised == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_no_gpu_is_one_line_saying_how_to_fix(gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    message = "--power-limit needs NVIDIA GPUs (CUDA); this run has none: drop --power-limit"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError) as error:
        PowerLimits("auto")
    assert str(error.value) == message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def no_nvml(ensure_homogeneous: bool = False) -> FakeGPUs:
        raise ZeusGPUInitError("NVML and AMDSMI unavailable.\nFailed to initialize GPU management library.")

    monkeypatch.setattr(zpl, "get_gpus", no_nvml)
    with pytest.raises(RuntimeError) as error:
        PowerLimits("max")
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("spec", "deny"),
    [("auto", {"deny_persistence": True}), ("auto", {"deny_limits": True}), ("250", {"deny_limits": True})],
)
def test_no_permission_is_one_line_saying_how_to_fix(
    monkeypatch: pytest.MonkeyPatch, exits: list, spec: str, deny: dict
) -> None:
    fake = FakeGPUs(**deny)
    monkeypatch.setattr(zpl, "get_gpus", lambda ensure_homogeneous=False: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    handler = signal.getsignal(signal.SIGTERM)
    # zeus wraps a refused persistence mode in a RuntimeError, and lets a refused limit through as it is.
    with pytest.raises(RuntimeError) as error:
        PowerLimits(spec, monitor=FakeMonitor(fake), **AUTO)
    assert str(error.value) == NO_PRIVILEGE + "Insufficient Permissions; grant it or drop --power-limit"
    # Anything changed before the refusal (zeus turns persistence on before setting a limit) is put back.
    assert fake.limits[1] == ORIGINAL_MW and not fake.persistence[1]
    assert exits == [] and signal.getsignal(signal.SIGTERM) == handler


@pytest.mark.parametrize("spec", ["auto", "MAX", "250", " 300 "])
def test_spec_accepted(spec: str) -> None:
    check_power_limit_spec(spec)


@pytest.mark.parametrize("spec", ["", "0", "-5", "250W", "2.5", "fast", "²"])
def test_spec_refused_in_one_line(spec: str) -> None:
    with pytest.raises(ValueError, match=r"^--power-limit must be 'auto', 'max' or a whole number of watts") as error:
        check_power_limit_spec(spec)
    assert "\n" not in str(error.value)


def test_bad_knobs_refused_before_touching_a_gpu(gpus: FakeGPUs) -> None:
    with pytest.raises(ValueError, match=r"eta weighs energy against time and must lie in \[0, 1\], got 1.5"):
        PowerLimits("auto", eta=1.5)
    with pytest.raises(ValueError, match="warmup_steps must be at least 1, got 0"):
        PowerLimits("auto", warmup_steps=0)
    with pytest.raises(ValueError, match="monitor watches GPUs"):
        PowerLimits("auto", monitor=FakeMonitor(gpus, index=0), **AUTO)
    assert gpus.limits == [ORIGINAL_MW, ORIGINAL_MW] and not gpus.persistence[1]


def test_windows_sized_to_the_epoch_choose_a_limit_where_zeus_defaults_never_would(gpus: FakeGPUs) -> None:
    """Epochs of 8 steps: Zeus' 10 warm-up and 40 measured steps are cut by every epoch's end, so nothing is ever
    measured (what --power-limit auto did on the digits' 23 steps an epoch); windows that fit an epoch
    (profiling_window) measure one limit an epoch from the second (the first waits a step before it begins) and
    choose after six."""
    from conveyor.job._energy import profiling_window

    def epochs(power: PowerLimits, n: int) -> None:
        for _ in range(n):
            steps(power, 8)
            power.epoch_end()

    with PowerLimits("auto", monitor=FakeMonitor(gpus), gpu_index=1, pl_step_w=50) as power:
        epochs(power, 10)
        assert power.profile == [] and power.chosen is None and power.candidates == 5
    warmup, profile = profiling_window(8)
    assert (warmup, profile) == (1, 6)
    sized = {"warmup_steps": warmup, "profile_steps": profile}
    with PowerLimits("auto", monitor=FakeMonitor(gpus), gpu_index=1, pl_step_w=50, **sized) as power:
        epochs(power, 6)
        assert [p.limit_w for p in power.profile] == [300, 250, 200, 150, 100] and power.chosen == 250
