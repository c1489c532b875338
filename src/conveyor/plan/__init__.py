"""Planning: profiles, cluster topologies, per-worker memory, PipeDream's and 2BW's planners, plan files (no torch)."""

from conveyor.plan._cost_model import COST_MODELS, allreduce_s
from conveyor.plan._memory import in_flight, stage_bytes, weight_versions, worker_bytes
from conveyor.plan._optimizer import Plan, PlanError, PlannedStage, optimize, step_microbatches
from conveyor.plan._planfile import PlanFileError, PlanSpec
from conveyor.plan._planner2bw import Candidate, plan_2bw
from conveyor.plan._predict import Prediction, RuntimeCosts, predict
from conveyor.plan._profiles import Layer, Profile, ProfileError, read_graph_txt
from conveyor.plan._shortlist import SimulatedLayout, layout_key, shortlist
from conveyor.plan._topology import Level, Topology, TopologyError

__all__ = [
    "COST_MODELS",
    "Candidate",
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
    "SimulatedLayout",
    "Topology",
    "TopologyError",
    "allreduce_s",
    "in_flight",
    "layout_key",
    "optimize",
    "plan_2bw",
    "predict",
    "read_graph_txt",
    "shortlist",
    "stage_bytes",
    "step_microbatches",
    "weight_versions",
    "worker_bytes",
]
