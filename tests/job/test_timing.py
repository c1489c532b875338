"""One worker's start-up timing over the job's own feed (:func:`conveyor.job._timing.fed_batch_s`)."""

import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.job._loader import epochs_when_read
from conveyor.job._timing import fed_batch_s
from conveyor.runtime.parts import Alone

CPU = torch.device("cpu")


def test_what_an_epoch_costs_beyond_its_batches_counts_in_a_batchs_time() -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    alone = Alone.of_copy(model, loss_fn=F.cross_entropy, optimizer=partial(torch.optim.SGD, lr=0.1), device=CPU)
    epochs = epochs_when_read(torch.randn(40, 4), torch.randint(0, 2, (40,)), batch_size=8, seed=0, device=CPU)

    def slow_epochs() -> Iterator[tuple[Any, Any]]:
        time.sleep(0.05)  # an epoch's own cost, spread over its 5 batches: 10 ms each, far above a batch's own
        return epochs()

    # Load on the machine can only lengthen the batches; timed one by one, they would miss the sleep.
    assert fed_batch_s(alone, slow_epochs, CPU) >= 0.01
    assert not torch.equal(alone.module[0].weight, model[0].weight)  # it trained (a copy of the model)
