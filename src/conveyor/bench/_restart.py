"""The checkpoint-restart baseline of ``conveyor bench elastic``: the same job as a plain torchrun worker.

Run under ``torchrun --max-restarts N``: every rank trains synchronous data parallelism (the same global
batches, the same update as :mod:`conveyor.elastic._trainer`) over the default process group, rank 0 saves
a checkpoint (model, optimizer, step) every ``--checkpoint-every`` steps, and a (re)started job resumes from
the last one. A lost worker fails the group; torchrun's agent stops every worker and starts them all
again. Rank 0 logs each completed step (``steps.jsonl``) and each epoch's test accuracy (``metrics.jsonl``);
every rank writes its process id (``pid-RANK``) for the benchmark to revoke.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from conveyor.config import TrainConfig
from conveyor.job import loss_and_optimizer, model_and_data
from conveyor.runtime import load_checkpoint, save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="conveyor train's options as JSON (TrainConfig.options)")
    parser.add_argument("--folder", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, required=True)
    args = parser.parse_args()
    cfg = TrainConfig.from_options(**json.loads(args.config))
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # The agent's store, under a prefix per attempt: env:// reused the previous attempt's gloo addresses (torch
    # 2.13), and a restarted group failed to connect to workers that were gone.
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timedelta(seconds=120)
    )
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{restart}", agent), rank=rank, world_size=world)
    (args.folder / f"pid-{rank}").write_text(str(os.getpid()))
    model, data = model_and_data(cfg)
    loss_fn, make_optimizer = loss_and_optimizer(cfg.optimizer, data.sequence)
    optimizer = make_optimizer(model.parameters())
    path = args.folder / "checkpoint.pt"
    start = 0
    if path.exists():  # a restart: back to the last checkpoint, losing the steps since
        state = load_checkpoint(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    train_x, test_x = data.tensor_inputs("the restart baseline")
    per_epoch = -(-len(train_x) // cfg.optimizer.batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if rank == 0:
        (args.folder / "training-started").touch()
    for t in range(start, cfg.run.epochs * per_epoch):
        epoch, i = divmod(t, per_epoch)
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(cfg.run.seed + epoch))
        batch = order[i * cfg.optimizer.batch_size : (i + 1) * cfg.optimizer.batch_size]
        share = -(-len(batch) // world)
        mine = batch[rank * share : (rank + 1) * share]
        model.train()
        optimizer.zero_grad()
        n = float(len(mine))
        if len(mine):
            (loss_fn(model(train_x[mine]), data.train_y[mine]) * n).backward()
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        flat = torch.cat([*grads, *(b.reshape(-1) * n for b in buffers), torch.tensor([n])])
        dist.all_reduce(flat)
        total, offset = float(flat[-1]), 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p) / total
            offset += p.numel()
        with torch.no_grad():
            for b in buffers:
                b.copy_(flat[offset : offset + b.numel()].view_as(b) / total)
                offset += b.numel()
        optimizer.step()
        if rank != 0:
            continue
        with (args.folder / "steps.jsonl").open("a") as f:
            f.write(json.dumps({"step": t, "wall": time.time(), "restart": restart}) + "\n")
        if (t + 1) % args.checkpoint_every == 0:
            save_checkpoint(path, model.state_dict(), optimizer=optimizer.state_dict(), step=t)  # atomically
        if i == per_epoch - 1:
            model.eval()
            with torch.no_grad():
                accuracy = float((model(test_x).argmax(-1) == data.test_y).float().mean())
            with (args.folder / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"epoch": epoch + 1, "wall": time.time(), "accuracy": accuracy}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
