"""Resolving model names and user factories."""

import sys
from pathlib import Path

import pytest
import torch

from conveyor.job._zoo import load_factory, resolve


def test_builtin_and_user_factories() -> None:
    model, example = resolve("mlp", 5)
    assert example.shape == (5, 64) and len(model) == 5
    model, example = resolve("models:factory", 2)
    assert example.shape == (2, 3)


def test_a_factorys_own_module_is_split_into_blocks() -> None:
    from models import residual

    torch.manual_seed(0)
    blocks, example = resolve("models:residual", 4)
    torch.manual_seed(0)
    model, _ = residual(4)
    assert example.shape == (4, 64)
    assert [name for name, _ in blocks.named_children()] == ["inp", "hidden_0", "hidden_1", "hidden_2", "head"]
    x = torch.randn(4, 64)
    torch.testing.assert_close(blocks(x), model(x))


@pytest.mark.slow  # traces GPT-2 (seconds)
def test_a_model_returning_a_mapping_is_trained_on_its_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[models]')"
    )
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8, bos_token_id=0, eos_token_id=0, use_cache=False
    )
    monkeypatch.setattr(
        "models.factory",
        lambda batch_size: (transformers.GPT2LMHeadModel(config), torch.randint(0, 40, (batch_size, 8))),
    )
    blocks, example = resolve("models:factory", 2)
    assert list(blocks.named_children())[-1][0] == "logits"
    assert blocks(example).shape == (2, 8, 40)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("resnet9000", "unknown model .resnet9000.: use one of gpt, gpt2, mlp, resnet, resnet18, vgg, vgg16"),
        ("no_such_module:f", "cannot load the model factory"),
        ("models:missing", "cannot load the model factory"),
        ("models:not_a_model", r"must return \(model, example_batch\)"),
    ],
)
def test_bad_specs_say_what_to_do(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(spec, 2)


def test_every_zoo_model_trains_on_its_dataset() -> None:
    from conveyor.job._data import load
    from conveyor.job._zoo import MODELS, build

    for name, (_, dataset) in MODELS.items():
        data = load(dataset)
        model = build(name, data, width=8, depth=1)
        out = model(data.train_x[:4])
        assert out.shape[-1] == data.classes and out.shape[0] == 4, name
        assert len(model) >= 3, name  # enough blocks to cut into stages


def test_models_refuse_the_wrong_kind_of_data() -> None:
    from conveyor.job._data import load
    from conveyor.job._zoo import build

    with pytest.raises(ValueError, match="gpt is a language model"):
        build("gpt", load("digits"))
    with pytest.raises(ValueError, match="needs images"):
        build("resnet", load("digits"))
    with pytest.raises(ValueError, match="use gpt for it"):
        build("vgg", load("text"))


def _batchnorm_run() -> dict[str, torch.Tensor] | None:
    from conveyor.job._data import load
    from conveyor.job._zoo import build
    from conveyor.runtime._pipeline import Pipeline

    data = load("digit-images")
    torch.manual_seed(0)
    pipe = Pipeline(
        build("resnet", data, width=4, depth=1), [4, 4], microbatches=4, loss_fn=torch.nn.functional.cross_entropy
    )
    pipe.train([(data.train_x[:16], data.train_y[:16])])
    return {k: v.clone() for k, v in pipe.module.state_dict().items() if "running" in k}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_batchnorm_statistics_in_a_pipeline_are_those_of_the_microbatches() -> None:
    """Each stage's BatchNorm sees the same 4 microbatches, in order, as an unsplit model would."""
    from conveyor.job._data import load
    from conveyor.job._zoo import build
    from conveyor.runtime._launch import launch

    data = load("digit-images")
    torch.manual_seed(0)
    model = build("resnet", data, width=4, depth=1)
    for part in data.train_x[:16].chunk(4):
        model(part)
    expected = {f"{i}.{k}": v for i, block in enumerate(model) for k, v in block.state_dict().items() if "running" in k}
    got: dict[str, torch.Tensor] = {}
    for result in launch(_batchnorm_run, nprocs=2, timeout_s=100).values():
        got |= result
    assert got.keys() == expected.keys() and got
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, msg=k)


def test_vgg16_is_shaped_like_vgg16() -> None:
    from conveyor.job._data import load
    from conveyor.job._zoo import build

    model = build("vgg16", load("digit-images"))
    convs = [m for m in model if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert len(convs) == 13 and len(linears) == 3  # VGG-16: 13 convolutions, 3 fully connected layers
    weights = sum(p.numel() for p in model.parameters())
    assert 0.88 < sum(p.numel() for m in linears for p in m.parameters()) / weights < 0.92
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)  # digits, scaled up to 32x32 inside


def test_model_arguments_are_python_literals_or_words() -> None:
    from conveyor.config import model_arguments

    assert model_arguments("") == {}
    assert model_arguments("num_classes=10, depths=[1,1],act=gelu,p=0.5,bias=False") == {
        "num_classes": 10,
        "depths": [1, 1],
        "act": "gelu",
        "p": 0.5,
        "bias": False,
    }
    with pytest.raises(ValueError, match="give NAME=VALUE items"):
        model_arguments("10")
    strict = {
        "n_layer=2,,n_embd": r"item 2 is empty \(two commas in a row, or one at an end\)",
        "n_layer=2,": "item 2 is empty",
        "depths=[1,1": "a bracket is left open",
        "depths=1,1]": "the ']' at character 11 closes no bracket",
        "name='gpt": "a quote is left open",
        "n=1,n=2": "n is given twice",
        "n=": "item 'n=' is not NAME=VALUE",
        "act=gelu,relu": "item 'relu' is not NAME=VALUE",
        "f=g(1": "a bracket is left open",
        "f=g(1)": r"f=g\(1\) is no Python value",
    }
    for text, message in strict.items():
        with pytest.raises(ValueError, match=message):
            model_arguments(text)


def _text() -> object:
    from conveyor.job import load_dataset

    return load_dataset("text")


@pytest.mark.slow  # traces GPT-2 (seconds)
def test_a_library_class_is_built_from_its_arguments_and_fed_from_the_dataset() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[models]')")
    gpt2 = "transformers:GPT2LMHeadModel"
    small = "n_layer=1,n_embd=16,n_head=2,bos_token_id=0,eos_token_id=0"
    blocks, example = resolve(gpt2, 4, _text(), f"{small},vocab_size=101")  # type: ignore[arg-type]
    assert example.shape == (4, 32) and list(blocks.named_children())[-1][0] == "logits"
    assert blocks(example).shape == (4, 32, 101)
    with pytest.raises(ValueError, match=r"scores 50 classes but text has 101: .*vocab_size"):
        resolve(gpt2, 4, _text(), f"{small},vocab_size=50")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be called with --model-args"):
        resolve("models:residual", 4, None, "width=3")


def test_factories_constructors_and_their_own_errors() -> None:
    _, example = resolve("models:factory_n", 5)  # the batch size, whatever its parameter's name
    assert example.shape == (5, 3)
    with pytest.raises(TypeError, match="a bug inside the user's constructor"):  # not reported as a bad option
        resolve("models:broken", 2, None, "width=4")
    with pytest.raises(ValueError, match=r"cannot be called with --model-args \{'depth': 2\}: it takes \(width"):
        resolve("models:broken", 2, None, "depth=2")


def test_a_model_module_is_found_in_the_current_folder_without_hiding_installed_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As ``python -m`` finds it: the ``conveyor`` script's Python has its own folder first on the path, not the
    current one; a file in the current folder named as an installed module does not replace it."""
    (tmp_path / "newcomer_models.py").write_text("def net(batch_size):\n    return batch_size\n")
    (tmp_path / "textwrap.py").write_text("def dedent(text):\n    return 'the wrong one'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert load_factory("newcomer_models:net")(3) == 3
    assert load_factory("textwrap:dedent")("  a") == "a"
    with pytest.raises(ValueError, match="cannot load the model factory 'no_such_models:net': No module named"):
        load_factory("no_such_models:net")


@pytest.mark.parametrize(
    ("dataset", "model"),
    [(None, "mlp"), ("digit-images", "resnet"), ("synthetic:3x8x8:4:64", "resnet"), ("synthetic:5:3:64", "mlp")],
)
def test_the_default_model_follows_the_dataset(dataset: str | None, model: str) -> None:
    """``--model`` left out: a model that takes the dataset's inputs and scores its classes, named in the config
    (so config.toml and the run folder say which)."""
    from conveyor.config import TrainConfig
    from conveyor.job._model import model_and_data

    cfg = TrainConfig.from_options(dataset=dataset)
    assert cfg.model.name == model and cfg.options()["model"] == model
    built, data = model_and_data(cfg)
    assert built(data.train_x[:3]).shape == (3, data.classes)


def test_a_zoo_model_that_cannot_take_the_data_says_which_would() -> None:
    from conveyor.job._data import load

    with pytest.raises(ValueError, match=r"mlp takes feature vectors \(N, F\), and digit-images has inputs of shape"):
        resolve("mlp", 4, load("digit-images"))
    with pytest.raises(ValueError, match=r"has inputs of shape \(1437, 64\): use --model mlp for feature vectors"):
        resolve("resnet", 4, load("digits"))


@pytest.mark.slow
def test_a_model_must_not_see_the_tokens_it_predicts_and_may_score_a_padded_vocabulary() -> None:
    """On the text windows (101 characters, next-token targets): a model that mixes the whole window is refused
    in one line; a causal one trains, with more outputs than characters too (the extra ones never a target)."""
    from conveyor.job._data import load
    from conveyor.job.parts import scored_classes

    text = load("text")
    with pytest.raises(ValueError, match=r"--model models:TokenMixer sees later tokens .* give a causal model"):
        resolve("models:TokenMixer", 4, text, "vocab=101,causal=False")
    causal, _ = resolve("models:TokenMixer", 4, text, "vocab=101,causal=True")
    padded, _ = resolve("models:TokenMixer", 4, text, "vocab=101,causal=True,outputs=128")
    assert scored_classes(causal) == 101 and scored_classes(padded) == 128
    with pytest.raises(ValueError, match="scores 100 classes but text has 101: give the model 101 outputs or more"):
        resolve("models:TokenMixer", 4, text, "vocab=101,causal=True,outputs=100")
