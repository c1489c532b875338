"""The documentation site (docs/, mkdocs.yml) stays true to the code: the architecture page's module map lists
exactly the modules that exist, the command-line reference renders every command of the real parser, and the
code of the "From Python" guide runs as written."""

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "conveyor"


def _module_map() -> tuple[set[str], set[str]]:
    """The map's entries under src/conveyor (paths relative to it, packages ending in /) and the other entries
    (paths relative to the repository root)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## Module map\n.*?```text\n(.*?)```", page, re.S)
    assert block, "docs/architecture.md has no ```text block under '## Module map'"
    inside: set[str] = set()
    outside: set[str] = set()
    parents: list[str] = []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        if depth == 0:
            if name != "src/conveyor/":
                outside.add(name)
            parents = []
            continue
        parents = parents[: depth - 1]
        assert len(parents) == depth - 1, f"{line!r} is indented below no package"
        path = "".join(parents) + name
        inside.add(path)
        if name.endswith("/"):
            parents.append(name)
    return inside, outside


def _modules() -> set[str]:
    """Every package (as ``name/``) and module under src/conveyor, relative to it; a subpackage's ``__init__.py``
    is its package's entry."""
    found = {"__init__.py"}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if "__pycache__" in relative.parts:
            continue
        if path.name == "__init__.py":
            if relative.parent != Path("."):
                found.add(f"{relative.parent.as_posix()}/")
        else:
            found.add(relative.as_posix())
    return found


def test_the_module_map_lists_every_module() -> None:
    listed, _ = _module_map()
    missing = sorted(_modules() - listed)
    assert not missing, f"docs/architecture.md's module map lacks {missing}: add a line for each"


def test_every_entry_of_the_module_map_exists() -> None:
    listed, outside = _module_map()
    gone = sorted(path for path in listed if not (PACKAGE / path).exists())
    gone += sorted(path for path in outside if not (ROOT / path).exists())
    assert not gone, f"docs/architecture.md's module map lists {gone}, which do not exist: remove or rename them"


def test_the_cli_reference_renders_every_command() -> None:
    """The mkdocs hook behind reference/cli.md, run on the real parser: every command and subcommand gets a
    section, and every option of ``conveyor train`` a row with its help."""
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py")
    assert spec and spec.loader
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    from conveyor.cli import _parser

    parser = _parser()
    page = hook.render(parser)
    names = re.findall(r"^#+ `(conveyor[^`]*)`$", page, re.M)
    assert names[0] == "conveyor" and len(names) == len(set(names))
    expected = ["conveyor train", "conveyor plan", "conveyor emulate check", "conveyor cluster simulate"]
    expected += ["conveyor models list", "conveyor bench overhead", "conveyor bench warmstart"]
    assert set(expected) <= set(names)
    train = page.split("## `conveyor train`")[1].split("\n### ")[0]
    for option in ("--model MODEL", "--schedule", "--no-stale-correction", "--batch-size", "--faults FAULTS"):
        assert f"`{option}" in train, option
    assert "| `--lr LR` | `0.05` | learning rate, above 0 |" in train
    assert "<!-- cli-reference -->" in (ROOT / "docs" / "reference" / "cli.md").read_text()


def _python_blocks(page: Path) -> list[tuple[str | None, str]]:
    """The page's ```python blocks: (the file name its title gives, or None; the code)."""
    blocks = re.findall(r'^```python(?: title="([^"]+)")?\n(.*?)^```$', page.read_text(), re.S | re.M)
    return [(title or None, code) for title, code in blocks]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_python_guide_runs(tmp_path: Path) -> None:
    """Each ```python block of docs/guides/python.md runs as a script, as a reader would run it (a script that
    starts workers needs its ``__main__`` guard, which running it in this process would not test), in a folder
    of its own: the first trains through ``conveyor.train`` and writes its run folder there, the second trains
    a Pipeline on three workers and saves its checkpoint. The scripts run in turn in one interpreter, each as
    its ``__main__`` (``runpy``: its workers import it as the main script, as they would a script started
    alone), which imports torch, here and in its worker server, once for both (~11 s of CPU each time)."""
    blocks = _python_blocks(ROOT / "docs" / "guides" / "python.md")
    assert len(blocks) == 2, [title for title, _ in blocks]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    scripts = [title or f"block{i}.py" for i, (title, _) in enumerate(blocks)]
    for script, (_, code) in zip(scripts, blocks, strict=True):
        (tmp_path / script).write_text(code)
    each_as_main = (
        "import runpy, sys\nfor s in sys.argv[1:]:\n    sys.argv = [s]\n    runpy.run_path(s, run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", each_as_main, *scripts],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{scripts}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    summary = tmp_path / "runs" / "from-python" / "summary.json"
    assert summary.is_file() and (summary.parent / "checkpoint.pt").is_file()
    assert (tmp_path / "pipeline_example.pt").is_file()


def test_the_own_model_guides_code_splits_as_it_says(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/guides/models-and-data.md's blocks run in turn (in this process: they start no worker) and print what
    their comments show."""
    blocks = [code for _, code in _python_blocks(ROOT / "docs" / "guides" / "models-and-data.md")]
    namespace = {"__name__": "guide"}
    for code in blocks:
        exec(compile(code, "models-and-data.md", "exec"), namespace)
    shown = [m.group(1) for code in blocks for m in re.finditer(r"print\(.*\)\s+# (.*)$", code, re.M)]
    assert len(shown) == 2 and capsys.readouterr().out.strip().splitlines() == shown


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_readmes_example_runs(tmp_path: Path) -> None:
    """The README's first block, run as a reader would: two workers train the module and print the losses."""
    ((title, code),) = [b for b in _python_blocks(ROOT / "README.md") if b[0] == "readme_example.py"]
    (tmp_path / title).write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, title], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [v for v in ast.literal_eval(done.stdout.strip().splitlines()[-1]).values() if v is not None]
    assert len(losses) == 1 and len(losses[0]) == 8  # the last stage's worker, one loss per batch


def _quick_start() -> list[list[str]]:
    """The README's quick-start commands as argument lists (continuations joined, comments dropped, ``&&`` split)."""
    import shlex

    found = re.search(r"## Quick start\n\n```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert found, "the README lost its quick start"
    lines = found[1].replace("\\\n", " ").splitlines()
    return [shlex.split(part) for line in lines for part in line.split("  #")[0].split(" && ")]


@pytest.mark.slow
def test_the_quick_start_uses_only_what_the_repository_and_the_package_provide(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command parses; each train command's model and data exist and fit; a file a command reads was written
    by one before it (a run folder's config.toml, a profile)."""
    from conveyor.cli import _parser
    from conveyor.cli._train import _train_config
    from conveyor.job import default_dataset, model_and_data

    monkeypatch.chdir(tmp_path)  # a reader's folder: what the commands write lands here
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the clone's, beside them
    written: set[Path] = set()
    commands = _quick_start()
    assert len(commands) >= 10 and all(argv[0] == "conveyor" for argv in commands)
    for argv in commands:
        args = _parser().parse_args(argv[1:])
        if args.command == "train":
            assert args.config is None or Path(args.config) in written, f"{argv}: no command before writes it"
            cfg = _train_config(args)
            model_and_data(cfg)
            if cfg.run.run_dir:  # what this run would leave for a later command
                (tmp_path / cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
                (tmp_path / cfg.run.run_dir / "config.toml").write_text(cfg.to_toml())
                written.add(Path(cfg.run.run_dir) / "config.toml")
        elif args.command == "profile":
            default_dataset(args.model)  # a model the zoo has
            written.add(args.json)
        else:
            assert args.command == "plan" and Path(args.profile) in written, f"{argv}: no command before writes it"
