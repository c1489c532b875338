"""The job's parts that the command line and the benchmarks build on: a config's device, backend and worker
count, the workers a fixed layout needs and that layout itself, the classes a split model scores, and the
profiler's context. Not the public API (:mod:`conveyor.job` is)."""

from conveyor.job._config import explicit_workers, job_devices
from conveyor.job._fit import scored_classes
from conveyor.job._layout import fixed_layout
from conveyor.job._trace import torch_profiled

__all__ = ["explicit_workers", "fixed_layout", "job_devices", "scored_classes", "torch_profiled"]
