"""The planner's parts that the job, the command line and the benchmarks build on: the plan file a run writes
and reads back, the per-epoch factors it is priced with, and a stage's seconds under a topology. Not the public
API (:mod:`conveyor.plan` is)."""

from conveyor.plan._cost_model import stage_seconds
from conveyor.plan._epochs import EpochFactors
from conveyor.plan._planfile import layout_file, plan_file, read_plan_file
from conveyor.plan._predict import stage_times

__all__ = ["EpochFactors", "layout_file", "plan_file", "read_plan_file", "stage_seconds", "stage_times"]
