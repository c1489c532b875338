"""Profiles: PipeDream's graph.txt, Conveyor's JSON, cut sizes of graphs that are not chains."""

from dataclasses import replace
from pathlib import Path

import pytest

from conveyor.plan._profiles import Layer, Profile, ProfileError, read_graph_txt

GRAPH = """\
node1 -- Input0 -- forward_compute_time=0.0, backward_compute_time=0.0, activation_size=100.0, parameter_size=0.0
node2 -- Conv2d(3, 8) -- forward_compute_time=2.0, backward_compute_time=4.0, activation_size=800.0, parameter_size=96.0
node4 -- Add -- forward_compute_time=0.5, backward_compute_time=0.5, activation_size=800.0, parameter_size=0.0
node3 -- ReLU -- forward_compute_time=1.0, backward_compute_time=1.0, activation_size=[800.0; 8.0], parameter_size=0.0
\tnode1 -- node2
\tnode2 -- node3
\tnode2 -- node4
\tnode3 -- node4
"""


def test_graph_txt_is_read_in_topological_order_with_units_and_without_inputs(tmp_path: Path) -> None:
    (tmp_path / "graph.txt").write_text(GRAPH)
    p = Profile.load(tmp_path)
    assert [layer.name for layer in p.layers] == ["node2", "node3", "node4"]  # the input node is dropped
    assert p.layers[0] == Layer("node2", "Conv2d(3, 8)", 0.002, 0.004, 800, 96)
    assert p.layers[1].output_bytes == 808  # a layer with two outputs
    assert p.edges == ((0, 1), (0, 2), (1, 2))
    assert p.model == tmp_path.name


def test_a_residual_cut_sends_every_tensor_that_crosses_it(tmp_path: Path) -> None:
    (tmp_path / "graph.txt").write_text(GRAPH)
    p = Profile.load(tmp_path)
    # After the ReLU both the ReLU's output and the conv's (skipping to the Add) cross.
    assert p.cut_bytes(1) == 808 + 800
    assert p.cut_bytes(0) == 800  # the conv's output, counted once though two layers consume it


def test_json_round_trip(tmp_path: Path) -> None:
    (tmp_path / "graph.txt").write_text(GRAPH)
    p = Profile.load(tmp_path)
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p


def test_published_profiles_all_load(pipedream_profiles: Path) -> None:
    for folder in sorted(d for d in pipedream_profiles.iterdir() if d.is_dir()):
        p = read_graph_txt(folder / "graph.txt")
        assert len(p) > 10 and p.compute_s(0, len(p)) > 0, folder.name
    vgg = Profile.load(pipedream_profiles / "vgg16")
    assert len(vgg) == 40  # 41 nodes less the input
    assert vgg.layers[0].description.startswith("Conv2d")  # the first convolution, not the input node
    assert vgg.param_bytes(0, len(vgg)) == pytest.approx(138.36e6 * 4, rel=1e-3)  # VGG-16's 138.4M weights


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node1 -- X -- forward_compute_time=1.0\n", "node line lacks 'backward_compute_time'"),
        ("this is not a profile\n", "neither a node nor an edge"),
        (
            GRAPH.replace("activation_size=800.0, parameter_size=96", "activation_size=big, parameter_size=96"),
            "not a number",
        ),
        (GRAPH + "\tnode4 -- node9\n", "not defined"),
        (GRAPH + "\tnode4 -- node2\n", "has a cycle"),
    ],
)
def test_bad_graph_txt_says_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "graph.txt").write_text(text)
    with pytest.raises(ProfileError, match=message):
        Profile.load(tmp_path / "graph.txt")


def test_missing_profile_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no profile at"):
        Profile.load(tmp_path / "nothing.json")


def test_bad_json_is_reported(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text('{"model": "m"}')
    with pytest.raises(ProfileError, match="is not a Conveyor profile"):
        Profile.load(tmp_path / "p.json")


def test_inconsistent_profiles_are_rejected() -> None:
    layer = Layer("a", "", 1.0, 1.0, 1, 1)
    with pytest.raises(ProfileError, match="topological order"):
        Profile("m", (layer, layer), ((1, 0),))
    with pytest.raises(ProfileError, match="negative"):
        Profile("m", (Layer("a", "", -1.0, 1.0, 1, 1),), ())
    with pytest.raises(ProfileError, match="no layers"):
        Profile("m", (), ())


def test_variants_at_other_batch_sizes_round_trip(tmp_path: Path) -> None:
    def at(b: int) -> Profile:
        return Profile.chain(
            "m",
            forward_s=[b * 1e-3, b * 2e-3],
            backward_s=[b * 2e-3, b * 4e-3],
            output_bytes=[b * 10, b * 20],
            param_bytes=[5, 5],
            batch_size=b,
        )

    p = replace(at(8), variants=(at(2), at(4)))
    p.save(tmp_path / "p.json")
    q = Profile.load(tmp_path / "p.json")
    assert q == p and q.batch_sizes == [8, 2, 4]
    assert q.at(4) == at(4) and q.at(8) == at(8)
    with pytest.raises(ProfileError, match="no measurements at batch size 3"):
        q.at(3)


def test_a_variant_must_match_the_layers() -> None:
    p = Profile.chain(
        "m", forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], output_bytes=[1, 1], param_bytes=[1, 1], batch_size=2
    )
    other = Profile.chain("m", forward_s=[1.0], backward_s=[1.0], output_bytes=[1], param_bytes=[1], batch_size=1)
    with pytest.raises(ProfileError, match="same 2 layers and edges"):
        replace(p, variants=(other,))
    with pytest.raises(ProfileError, match="lists a batch size twice"):
        replace(p, variants=(p,))
