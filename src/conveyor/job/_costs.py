"""The figures a training job measures before it plans (:mod:`conveyor.job._measure` measures them, every worker
at once): the model's profile, the messages between workers, the runtime's own cost per action, an update and a
forward through a weight version as the executor makes them, and one worker alone for comparison.

The profile and the runtime's cost per action are put per core (times the workers' share of the cores), and the
simulator shares the cores among the workers that want one at each moment (:class:`~conveyor.plan.RuntimeCosts`).
The first worker keeps the figures; the plan and its prediction rest on them. ``single_worker_samples_per_s`` is a
plain PyTorch loop (forward, backward, optimizer step on whole batches) on the first worker alone with the cores
others leave free (all of them on a quiet machine), the baseline a job with more workers has to beat.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from conveyor.plan import Level, Profile, RuntimeCosts, Topology
from conveyor.runtime import MeasuredLink

__all__ = ["Costs"]


@dataclass(frozen=True)
class Costs:
    """The measured figures a job plans and predicts with (see the module docstring).

    Attributes:
        profile: the model at the microbatch size, its times measured with every worker busy.
        link: messages between two workers (``None`` with one worker).
        allreduce: seconds per step and bytes per second of a ring all-reduce among all the workers
            (``None`` with one worker).
        overhead_s: the executor's own time per compute action.
        single_worker_samples_per_s: a plain PyTorch loop on one worker with every core (``None`` where the
            model was built on the meta device: it was not run whole).
        workers: the job's workers.
        cores: the cores the workers share (``None`` on GPUs or emulated devices: one each).
        network: the emulated network's topology, when the job runs on one.
        alone_batch_s: a batch's mean seconds (one microbatch each) as the first worker alone trains whole epochs of
            the job's feed, each epoch's own costs included, with the threads of the plain loop: what a one-worker
            layout runs (``None`` where the plain loop did not run).
        spread: how much the plain loop's batches varied: the interquartile range of their times over the median
            (0: not measured, as on emulated devices, where it measures the quota's stops). Figures whose ratio is
            within it are not told apart: the planner takes the simpler layout then (:func:`~conveyor.plan.shortlist`'s
            ``tie``).
        update_factors: an update as the executor makes it in a run, over the profile's optimizer step (the sum
            of the layers' ``step_s``): without weight versions, and on a stage that keeps them and extrapolates
            them (:func:`~conveyor.runtime.measure_updates`); ``(1, 1)``: not measured.
        stashed_forward_factor: a forward through a weight version over one through the module itself (the same
            measurement; 1: not measured).
        source: where the figures come from: measured by this run, or kept from an earlier one
            (:mod:`conveyor.job._measured`).
        kept_at: the file they were read from, where they were kept (``None``: measured by this run).
        key: what they are kept under (:func:`~conveyor.job._measured.costs_key`; ``None``: not kept).
        layout_ratios: by :func:`~conveyor.plan.layout_key`, what a run of a layout planned with these figures
            measured over its simulated rate, where that missed (:meth:`RunSummary.layout_missed`): the planner
            predicts the layout at its simulated rate times this (:func:`~conveyor.plan.shortlist`'s ``ratios``).
    """

    profile: Profile
    link: MeasuredLink | None
    allreduce: tuple[float, float] | None
    overhead_s: float
    single_worker_samples_per_s: float | None
    workers: int
    cores: int | None
    network: Topology | None = None
    alone_batch_s: float | None = None
    spread: float = 0.0
    update_factors: tuple[float, float] = (1.0, 1.0)
    stashed_forward_factor: float = 1.0
    source: str = "measured at start-up"
    kept_at: str | None = None
    key: str | None = None
    layout_ratios: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        """The figures as JSON (:meth:`from_json` reads them back; ``source`` and ``key`` are the reader's to
        say)."""
        figures = {k: v for k, v in asdict(self).items() if k not in ("profile", "source", "kept_at", "key")}
        return json.dumps({**figures, "profile": json.loads(self.profile.to_json())}, indent=1)

    @classmethod
    def from_json(cls, text: str, *, source: str, kept_at: str | None = None, key: str | None = None) -> Costs:
        """:meth:`to_json`'s figures.

        Raises:
            ValueError: ``text`` holds no such figures (a file of another version, or cut short).
        """
        d = json.loads(text)
        try:
            network = None if d["network"] is None else Topology(tuple(Level(**lv) for lv in d["network"]["levels"]))
            return cls(
                profile=Profile.from_json(json.dumps(d["profile"])),
                link=None if d["link"] is None else MeasuredLink(**d["link"]),
                allreduce=None if d["allreduce"] is None else (float(d["allreduce"][0]), float(d["allreduce"][1])),
                overhead_s=float(d["overhead_s"]),
                single_worker_samples_per_s=d["single_worker_samples_per_s"],
                workers=int(d["workers"]),
                cores=d["cores"],
                network=network,
                alone_batch_s=d["alone_batch_s"],
                spread=float(d["spread"]),
                update_factors=(float(d["update_factors"][0]), float(d["update_factors"][1])),
                stashed_forward_factor=float(d["stashed_forward_factor"]),
                source=source,
                kept_at=kept_at,
                key=key,
                layout_ratios={str(k): float(v) for k, v in d.get("layout_ratios", {}).items()},
            )
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a job's start-up figures ({type(exc).__name__}: {exc})") from exc

    @property
    def topology(self) -> Topology:
        """The emulated network (each level's latency plus the measured one of a message over a link that adds
        none), or else the job's workers as one level joined by the measured link."""
        if self.network is not None:
            base = self.link.latency if self.link else 0.0
            return Topology(tuple(replace(level, latency=level.latency + base) for level in self.network.levels))
        if self.link is None:  # one worker sends nothing
            return Topology((Level(self.workers, 1e12),))
        return Topology((Level(self.workers, self.link.bandwidth, self.link.latency),))

    def within_sites(self) -> Costs:
        """These costs for a job whose replicas all-reduce inside each data centre only (``--wan gaia`` or
        ``diloco``): the emulated network's outer level, the WAN, joined as fast as the level inside it. What
        crosses the WAN (gaia's significant updates, diloco's rounds) is not predicted.

        Example:
            >>> wan = Topology((Level(2, 1.25e9), Level(3, 6.25e6, 1e-3)))
            >>> Costs(None, None, None, 0.0, 1.0, workers=6, cores=2, network=wan).within_sites().network.levels[-1]
            Level(count=3, bandwidth=1250000000.0, latency=0.0)
        """
        if self.network is None or len(self.network.levels) < 2:
            return self
        *inside, outer = self.network.levels
        joined = replace(outer, bandwidth=inside[-1].bandwidth, latency=inside[-1].latency)
        return replace(self, network=Topology((*inside, joined)))

    @property
    def runtime(self) -> RuntimeCosts:
        """The runtime's own costs, for the simulator. On an emulated network an all-reduce's rate is that of
        the slowest link its ring crosses (the one measured spans all the workers, and so the slowest level)."""
        link = self.link or MeasuredLink(0.0, 0.0, 0.0, 1e12)
        latency, bandwidth = self.allreduce or (None, None)
        if self.network is not None:
            bandwidth = None
        plain, stashed = self.update_factors
        return RuntimeCosts(
            action_s=self.overhead_s,
            send_s=link.send_s,
            recv_s=link.recv_s,
            allreduce_latency=latency,
            allreduce_bandwidth=bandwidth,
            cores=self.cores,
            update_factor=plain,
            stashed_update_factor=stashed,
            stashed_forward_factor=self.stashed_forward_factor,
        )

    def alone(self, *, batch: int, microbatches: int) -> Profile | None:
        """The profile one worker alone runs with, on ``microbatches`` microbatches of a ``batch``-sample batch: the
        layers' times in the proportions profiled, scaled so that a batch (each layer's forward and backward in
        proportion to its samples, one update: the optimizer step times :attr:`update_factors`' first, as the
        simulator charges it) takes what a batch took on one worker alone at start-up (:attr:`alone_batch_s`; else
        the plain loop's), less the simulator's per-action charge: one worker alone may use more than the core a
        worker of the job was profiled on (``None`` where neither ran).

        Example (a layer of 1 s forward and backward for 8 samples, none for the step, and a loop of 4 samples/s):
            >>> p = Profile.chain("toy", [0.5], [0.5], [0], [0], batch_size=8)
            >>> c = Costs(p, None, None, 0.0, 4.0, workers=2, cores=2)
            >>> a = c.alone(batch=16, microbatches=2)
            >>> a.batch_size, a.layers[0].forward_s + a.layers[0].backward_s  # two of 2 s: the loop's 4 s a batch
            (8, 2.0)
        """
        prof = self.profile
        if self.single_worker_samples_per_s is None or not prof.batch_size:
            return None
        grow = batch / prof.batch_size  # a layer's time grows with its samples; the optimizer's step does not
        update = self.update_factors[0]  # the simulator charges an update this times the layers' steps
        modelled = sum((lay.forward_s + lay.backward_s) * grow + lay.step_s * update for lay in prof.layers)
        measured = batch / self.single_worker_samples_per_s
        if self.alone_batch_s is not None:  # the simulator charges each of the batch's actions the executor's cost
            measured = max(measured, self.alone_batch_s - (2 * microbatches + 2) * self.overhead_s)
        factor = measured / modelled
        per_microbatch = grow / microbatches * factor
        layers = tuple(
            replace(
                lay,
                forward_s=lay.forward_s * per_microbatch,
                backward_s=lay.backward_s * per_microbatch,
                step_s=lay.step_s * factor,
            )
            for lay in prof.layers
        )
        return replace(prof, layers=layers, batch_size=batch // microbatches)

    def summary(self) -> dict[str, Any]:
        """The figures for the run folder (the profile is in the plan's own terms)."""
        return {
            "link": None if self.link is None else asdict(self.link),
            "allreduce_latency_s": None if self.allreduce is None else self.allreduce[0],
            "allreduce_bandwidth_bytes_per_s": None if self.allreduce is None else self.allreduce[1],
            "overhead_s_per_action": self.overhead_s,
            "single_worker_samples_per_s": self.single_worker_samples_per_s,
            "workers": self.workers,
            "cores": self.cores,
            "spread": self.spread,
            "update_factors": list(self.update_factors),
            "stashed_forward_factor": self.stashed_forward_factor,
            "source": self.source,
            "kept_at": self.kept_at,
            "key": self.key,
            "layout_ratios": self.layout_ratios,
        }
