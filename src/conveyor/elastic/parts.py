"""The elastic trainer's parts that the job builds on: the connection to a job's store (the reliable tier's)
and a stage's layout agreed among its workers. Not the public API (:mod:`conveyor.elastic` is)."""

from conveyor.elastic._membership import connect
from conveyor.elastic._pipeline import StageLayout, agreed_layouts

__all__ = ["StageLayout", "agreed_layouts", "connect"]
