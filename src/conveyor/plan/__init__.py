"""Planning: profiles, cluster topologies, per-worker memory, PipeDream's and 2BW's planners, plan files (no torch)."""

from conveyor.plan._cost_model import COST_MODELS, allreduce_s, stage_seconds
from conveyor.plan._epochs import EpochFactors
from conveyor.plan._memory import in_flight, stage_bytes, weight_versions, worker_bytes
from conveyor.plan._optimizer import Plan, PlanError, PlannedStage, optimize, step_microbatches
from conveyor.plan._planfile import PlanFileError, PlanSpec, layout_file, plan_file, read_plan_file
from conveyor.plan._planner2bw import Candidate, plan_2bw
from conveyor.plan._predict import Prediction, RuntimeCosts, predict, stage_times
from conveyor.plan._profiles import Layer, Profile, ProfileError, read_graph_txt
from conveyor.plan._topology import Level, Topology, TopologyError

__all__ = [
    "COST_MODELS",
    "Candidate",
    "EpochFactors",
    "Layer",
    "Level",
    "Plan",
    "PlanError",
    "PlanFileError",
    "PlanSpec",
    "PlannedStage",
    "Prediction",
    "Profile",
    "ProfileError",
    "RuntimeCosts",
    "Topology",
    "TopologyError",
    "allreduce_s",
    "in_flight",
    "layout_file",
    "optimize",
    "plan_2bw",
    "plan_file",
    "predict",
    "read_graph_txt",
    "read_plan_file",
    "stage_bytes",
    "stage_seconds",
    "stage_times",
    "step_microbatches",
    "weight_versions",
    "worker_bytes",
]
