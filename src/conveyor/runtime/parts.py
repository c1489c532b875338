"""The runtime's parts that the other systems' engines build on (the stragglers' flexible pipeline, the elastic
trainer, the job): one worker alone, a stage's place and its checkpoints, point-to-point messages, the flat
gradient buffer, the stop request. Not the public API (:mod:`conveyor.runtime` is): what they need from the
runtime, in one place.
"""

from conveyor.runtime._checkpoint import check_compatible as check_checkpoint
from conveyor.runtime._checkpoint import load_stage, save_stages
from conveyor.runtime._devices import synchronize
from conveyor.runtime._launch import stop_requested
from conveyor.runtime._outer import SiteLinks
from conveyor.runtime._solo import Alone
from conveyor.runtime._stage import StagePosition, even_balance
from conveyor.runtime._transport import P2P, PendingRecv
from conveyor.runtime._update import pack_grads, reduce_dtype, set_mean_grads

__all__ = [
    "P2P",
    "Alone",
    "PendingRecv",
    "SiteLinks",
    "StagePosition",
    "check_checkpoint",
    "even_balance",
    "load_stage",
    "pack_grads",
    "reduce_dtype",
    "save_stages",
    "set_mean_grads",
    "stop_requested",
    "synchronize",
]
