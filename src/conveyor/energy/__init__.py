"""Energy: measure it, and spend less of it (Zeus, NSDI'23): batch size and power limit of recurring jobs."""

from conveyor.energy._bandit import BatchSizeSearch, Choice, Recurrence, zeus_cost
from conveyor.energy._meter import Meter, MeterStatus, describe_meters, open_meter
from conveyor.energy._power import PowerLimits, ProfiledLimit
from conveyor.energy._recurring import CostMeter, Recurring, candidate_sizes, scaled_lr
from conveyor.energy._replay import ReplayOutcome, Workload, WorkloadTrace, load_traces, replay, search_policy
from conveyor.energy._store import JobSettings, RecurrenceStore, Started, default_store_path

__all__ = [
    "BatchSizeSearch",
    "Choice",
    "CostMeter",
    "JobSettings",
    "Meter",
    "MeterStatus",
    "PowerLimits",
    "ProfiledLimit",
    "Recurrence",
    "RecurrenceStore",
    "Recurring",
    "ReplayOutcome",
    "Started",
    "Workload",
    "WorkloadTrace",
    "candidate_sizes",
    "default_store_path",
    "describe_meters",
    "load_traces",
    "open_meter",
    "replay",
    "scaled_lr",
    "search_policy",
    "zeus_cost",
]
