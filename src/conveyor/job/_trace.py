"""Where a worker's time goes: one epoch under ``torch.profiler`` (``conveyor train --torch-profile DIR``).

The profiled span's operators, sorted by their own time on the device that does the work (the GPU's where
there is one, else the CPU's), go to ``DIR/NAME.txt``, and the whole timeline to ``DIR/NAME.json``
(``chrome://tracing`` or Perfetto opens it). The profiler slows what it watches: read it for where the time
goes, not for how much there is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

__all__ = ["torch_profiled"]


@contextlib.contextmanager
def torch_profiled(folder: str | Path | None, name: str, device: torch.device) -> Iterator[None]:
    """Profile the ``with`` block on ``device`` and write ``folder/name.txt`` and ``.json`` (nothing without a
    folder)."""
    if folder is None:
        yield
        return
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch.profiler.profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize(device)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    (out / f"{name}.txt").write_text(prof.key_averages().table(sort_by=by, row_limit=40))
    prof.export_chrome_trace(str(out / f"{name}.json"))
