"""Every path on a CUDA GPU: pipelines (one worker over NCCL, several sharing the GPU over gloo) against their
update equations, checkpoints that load without a GPU, stragglers, elastic training, the job's evaluation and
energy. Marked ``gpu``: skipped, with the reason, where there is none (``pytest -m gpu`` runs only these)."""

import copy
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import reference
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import batches, mlp, small_gpt2

import conveyor.runtime._checkpoint as checkpoint
from conveyor.config import TrainConfig
from conveyor.gaia import DiLoCo, Gaia
from conveyor.job import train, train_elastic
from conveyor.runtime import Pipeline, default_device, launch, profile
from conveyor.runtime._stage import as_blocks, build_stage, stage_ranges
from conveyor.stragglers import FlexiblePipeline

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SGD = partial(torch.optim.SGD, lr=0.05, momentum=0.9)
SIZES = (12, 11, 7, 3)  # uneven batches, the last shorter than the microbatches
BALANCE = {1: [5], 2: [3, 2]}


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[:n], y[:n]) for (x, y), n in zip(batches(n=len(SIZES), size=12), SIZES, strict=True)]


def _on_cpu(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.named_parameters()}


def _pipelines(replicas: tuple[int, ...], schedules: tuple[str, ...], folder: str) -> dict[str, Any]:
    """Each schedule on ``replicas``, on this worker's GPU: its parameters (on the CPU), where they lived, its
    losses; the last pipeline saves a checkpoint."""
    out: dict[str, Any] = {}
    for schedule in schedules:
        pipe = Pipeline(
            mlp(),
            BALANCE[len(replicas)],
            microbatches=4,
            loss_fn=F.cross_entropy,
            optimizer=SGD,
            schedule=schedule,
            replicas=replicas,
            debug=True,
        )
        losses = pipe.train([(x.to(pipe.device), y.to(pipe.device)) for x, y in _data()])
        out[schedule] = {"params": _on_cpu(pipe.module), "device": pipe.device.type, "losses": losses}
        logits = pipe.evaluate(_data()[0][0])
        if pipe.is_output:
            out[schedule]["eval_device"] = logits.device.type
    pipe.save(Path(folder) / "model.pt")
    return out


def _reference(replicas: tuple[int, ...], schedule: str) -> dict[str, torch.Tensor]:
    model = mlp()
    stages = [build_stage(model, r) for r in stage_ranges(BALANCE[len(replicas)], len(as_blocks(model)))]
    reference.train(stages, _data(), 4, schedule, replicas, SGD, F.cross_entropy, correct=True)
    return {k: v for st in stages for k, v in st.named_parameters()}


@pytest.mark.parametrize(
    ("replicas", "backend", "schedules"),
    [
        ((1,), "nccl", ("flush", "pipedream")),
        ((1, 1), "gloo", ("gpipe", "flush", "pipedream", "pipedream-vs", "2bw")),
        ((2, 1), "gloo", ("flush", "pipedream", "2bw")),
    ],
    ids=["one-worker-nccl", "two-stages-sharing-the-gpu", "replicated-stage-sharing-the-gpu"],
)
def test_pipelines_on_the_gpu_follow_their_update_equations(
    replicas: tuple[int, ...], backend: str, schedules: tuple[str, ...], tmp_path: Path
) -> None:
    """Activations and gradients cross through pinned host memory, replicas all-reduce CUDA tensors, the
    sample count goes through a host group: the weights still equal the equations' (TF32 off: to 1e-4)."""
    per_rank = launch(
        _pipelines,
        replicas,
        schedules,
        str(tmp_path),
        nprocs=sum(replicas),
        device="cuda",
        backend=backend,
        timeout_s=240,
    )
    for schedule in schedules:
        expected = _reference(replicas, schedule)
        for rank, result in per_rank.items():
            assert result[schedule]["device"] == "cuda"
            for name, p in result[schedule]["params"].items():
                torch.testing.assert_close(p, expected[name], rtol=1e-4, atol=1e-5, msg=f"{schedule} {rank} {name}")
        output = per_rank[sum(replicas) - replicas[-1]][schedule]
        assert output["eval_device"] == "cuda" and len(output["losses"]) == len(SIZES)
    saved = checkpoint.load(tmp_path / "model.pt")  # loadable without a GPU: every tensor on the CPU
    tensors = [*saved["model"].values(), *(t for s in saved["optimizer"]["state"].values() for t in s.values())]
    assert tensors and all(t.device.type == "cpu" for t in tensors if isinstance(t, torch.Tensor))
    mlp().load_state_dict(saved["model"])


def _stragglers() -> dict[str, torch.Tensor]:
    pipe = FlexiblePipeline(mlp(), loss_fn=F.cross_entropy, optimizer=SGD, chunks=2, slack=1)
    pipe.train([(x.to(pipe.device), y.to(pipe.device)) for x, y in _data()])
    assert pipe.device.type == "cuda" and dist.get_world_size() == 2
    return _on_cpu(pipe.module)


def test_straggler_trainer_replicas_on_one_gpu_hold_the_same_weights() -> None:
    per_rank = launch(_stragglers, nprocs=2, device="cuda", backend="gloo", timeout_s=240)
    for name, p in per_rank[0].items():
        torch.testing.assert_close(p, per_rank[1][name])
    assert any(not torch.equal(p, q) for p, q in zip(per_rank[0].values(), _on_cpu(mlp()).values(), strict=True))


def test_the_job_trains_evaluates_and_meters_on_the_gpu(tmp_path: Path) -> None:
    """The README's job on one GPU (it crashed at its first evaluation, comparing CUDA logits with CPU labels);
    NVML meters each epoch's energy."""
    summary = train(TrainConfig.from_options(workers=1, epochs=3, device="cuda", run_dir=str(tmp_path)))
    assert summary.accuracy[-1] > 0.8 and summary.layout["replicas"] == [1]
    assert summary.energy_j is not None and "NVML" in summary.energy_meter


def test_elastic_training_computes_on_the_gpu(tmp_path: Path) -> None:
    cfg = TrainConfig.from_options(reliable=1, workers=2, epochs=2, device="cuda", run_dir=str(tmp_path))
    summary = train_elastic(cfg)
    assert summary.epochs == 2 and summary.accuracy[-1] > 0.5


def test_profiling_a_model_on_the_gpu() -> None:
    prof = profile(mlp(), torch.randn(16, 8), device="cuda", repeats=3, warmup=1, autocast=torch.bfloat16)
    assert all(layer.forward_s > 0 for layer in prof.layers) and prof.layers[0].param_bytes == 8 * 16 * 4 + 16 * 4


def _device_of_default() -> str:
    return str(default_device())


def test_shared_gpu_mode_puts_every_worker_on_the_gpu() -> None:
    gpus = torch.cuda.device_count()
    assert launch(_device_of_default, nprocs=3, device="cuda", backend="gloo", timeout_s=120) == {
        r: f"cuda:{r % gpus}" for r in range(3)
    }


def test_a_split_model_traced_on_the_cpu_runs_on_the_gpu() -> None:
    """GPT-2's graphs name the CPU they were traced on (arange's device, export's metadata checks): moved to the
    GPU, its blocks run copies that name the GPU, and compute what the model computes there."""
    from conveyor.runtime import split_model

    model = small_gpt2()
    reference = copy.deepcopy(model).cuda()
    x = torch.randint(0, 50, (4, 16))
    out = split_model(model, x).cuda()(x.cuda()).logits
    assert out.device.type == "cuda"
    torch.testing.assert_close(out, reference(x.cuda()).logits)


def test_a_hugging_face_model_trains_in_two_stages_sharing_the_gpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = TrainConfig.from_options(
        model="transformers:GPT2LMHeadModel",
        model_args="n_layer=2,n_embd=32,n_head=2,vocab_size=101,bos_token_id=0,eos_token_id=0",
        dataset="text",
        stages=2,
        backend="gloo",
        device="cuda",
        epochs=1,
        run_dir=str(tmp_path),
    )
    summary = train(cfg)
    assert summary.epochs == 1 and summary.loss[0] < 4.0


def test_a_model_built_on_meta_is_made_real_on_the_gpu_and_computes_as_loaded(tmp_path: Path) -> None:
    """GPT-2 built on the meta device, traced there (its graphs name the meta device), its blocks made real on
    the GPU from the unsplit model's state dict: they compute what the model computes; initialised there instead,
    every tensor is on the GPU."""
    from conveyor.runtime import initialise_from, load_from, split_model
    from conveyor.runtime._materialize import placed

    model, x = small_gpt2(), torch.randint(0, 50, (4, 16))
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")
    with torch.device("meta"):
        empty = small_gpt2()
    blocks = placed(split_model(empty, x), torch.device("cuda"), load_from(tmp_path / "gpt2.pt"))
    torch.testing.assert_close(blocks(x.cuda()).logits, copy.deepcopy(model).cuda()(x.cuda()).logits)
    with torch.device("meta"):
        fresh = small_gpt2()
    again = split_model(fresh, x)
    initialise_from(fresh, seed=0)(again, torch.device("cuda"))
    assert all(t.device.type == "cuda" for t in [*again.parameters(), *again.buffers()])


def _across_data_centres(make: Any) -> dict[str, torch.Tensor]:
    pipe = Pipeline(
        mlp(),
        1,
        microbatches=4,
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=0.05),
        replicas=[4],
        outer=make(),
    )
    assert pipe.device.type == "cuda"
    pipe.train([(x.to(pipe.device), y.to(pipe.device)) for x, y in batches(n=3, size=24)])
    return _on_cpu(pipe.module)


@pytest.mark.parametrize(
    "make",
    [
        partial(Gaia, 2, threshold=0.0, staleness=1, wire_dtype=torch.float32),
        partial(DiLoCo, 2, local_steps=1, outer_lr=1.0, outer_momentum=0.0),
    ],
    ids=["gaia", "diloco"],
)
def test_data_centres_sharing_the_gpu_take_the_synchronous_step(make: Any) -> None:
    # 2 data centres of 2 workers on one GPU: gaia at threshold 0 (float32 on the wire) and diloco at one local step
    # with an outer SGD of rate 1 are synchronous data parallelism (plain SGD), the WAN exchange going through host
    # memory.
    per_rank = launch(_across_data_centres, make, nprocs=4, device="cuda", backend="gloo", timeout_s=240)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(n=3, size=24):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for rank, params in per_rank.items():
        for name, p in model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"worker {rank} {name}")
