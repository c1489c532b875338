"""Heterogeneity-aware cluster scheduling (Gavel): policies as linear programs, rounds, a simulator, real jobs."""

from conveyor.cluster._backends import Backend, Launched, LocalBackend, RayBackend
from conveyor.cluster._generate import generate_jobs
from conveyor.cluster._mechanism import ClusterDevice, Devices, Rounds
from conveyor.cluster._planned import planned_throughputs
from conveyor.cluster._policies import SCHEDULING_POLICIES, allocate
from conveyor.cluster._problem import Allocation, Problem
from conveyor.cluster._real import DeviceTypes, RealRun, parse_device_types, run_real
from conveyor.cluster._simulate import JobRecord, Simulation, simulate_cluster
from conveyor.cluster._throughputs import OnlineThroughputs, ThroughputTable, default_gavel_path
from conveyor.cluster._trace import TraceJob, read_trace, write_trace

__all__ = [
    "SCHEDULING_POLICIES",
    "Allocation",
    "Backend",
    "ClusterDevice",
    "DeviceTypes",
    "Devices",
    "JobRecord",
    "Launched",
    "LocalBackend",
    "OnlineThroughputs",
    "Problem",
    "RayBackend",
    "RealRun",
    "Rounds",
    "Simulation",
    "ThroughputTable",
    "TraceJob",
    "allocate",
    "default_gavel_path",
    "generate_jobs",
    "parse_device_types",
    "planned_throughputs",
    "read_trace",
    "run_real",
    "simulate_cluster",
    "write_trace",
]
