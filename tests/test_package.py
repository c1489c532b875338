"""The package: every module imports with the declared dependencies, and scheduling and planning need no torch."""

import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import conveyor


def test_every_module_imports() -> None:
    names = [m.name for m in pkgutil.walk_packages(conveyor.__path__, "conveyor.")]
    assert {"conveyor.schedule._generate", "conveyor.plan._optimizer", "conveyor.runtime._executor"} <= set(names)
    for name in names:
        importlib.import_module(name)


def test_the_public_api_resolves() -> None:
    for name in conveyor.__all__:
        assert getattr(conveyor, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        conveyor.nothing  # noqa: B018


# What a machine without torch looks like: importing it raises ModuleNotFoundError and it is absent from
# sys.modules (a None entry there instead breaks libraries that probe sys.modules, such as SciPy's array API layer).
BLOCK_TORCH = (
    "import sys, importlib.abc\n"
    "class NoTorch(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, NoTorch())\n"
)


@pytest.mark.parametrize(
    "code",
    [
        "import conveyor.schedule as s; s.validate(s.make_schedule('2bw', 3, 4, 5, [2, 1, 1]))",
        "import conveyor.plan as p; p.optimize(p.Profile.chain('m', [1.0] * 3, [2.0] * 3, [8] * 3, [4] * 3), "
        "p.Topology.parse('4:1e9'))",
        "from conveyor import Schedule, Profile, make_schedule, optimize",
        "from conveyor.cli import main; raise SystemExit(main(['plan', 'PROFILE', '--topology', '2:1e9']))",
    ],
)
@pytest.mark.slow
def test_scheduling_and_planning_work_without_torch(code: str, tmp_path: object) -> None:
    from conveyor.plan import Profile

    profile = f"{tmp_path}/p.json"
    Profile.chain("five", forward_s=[1.0] * 5, backward_s=[1.0] * 5, output_bytes=[1] * 5, param_bytes=[1] * 5).save(
        profile
    )
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + code.replace("PROFILE", profile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_readme_quotes_the_test_command() -> None:
    """CI runs scripts/test.sh; the README's "Run the tests" shows its command line word for word."""
    root = Path(__file__).resolve().parents[1]
    command = (root / "scripts" / "test.sh").read_text().strip().splitlines()[-1]
    assert command.startswith("pip install torch==2.13.0 && ") and "pytest" in command
    assert f"```bash\n{command}\n```" in (root / "README.md").read_text()
    assert "scripts/test.sh" in (root / ".ci" / "run").read_text()


def _imports(path: Path) -> set[str]:
    """The ``conveyor.*`` modules a source file imports, wherever in the file (function-local ones too)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("conveyor."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("conveyor.")}
    return found


SRC = Path(conveyor.__file__).parent


def test_no_private_module_is_imported_from_another_package() -> None:
    """What a sibling needs from a package is exported by the package's ``__init__``."""
    crossings = []
    for path in SRC.rglob("*.py"):
        home = path.relative_to(SRC).parts[0]
        for module in _imports(path):
            parts = module.split(".")
            if any(p.startswith("_") for p in parts[1:]) and parts[1] != home:
                crossings.append(f"{path.relative_to(SRC)} imports {module}")
    assert not crossings


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A path that comes back to where it started, if the graph has one (depth first)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == 1:
                return [*path, dep]
            if dep not in state and (found := visit(dep, [*path, dep])) is not None:
                return found
        state[module] = 2
        return None

    return next((c for m in sorted(graph) if m not in state and (c := visit(m, [m])) is not None), None)


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"_a": {"_b"}, "_b": {"_c"}, "_c": {"_a"}}) == ["_a", "_b", "_c", "_a"]
    assert _cycle({"_a": {"_b", "_c"}, "_b": {"_c"}, "_c": set()}) is None


def test_no_package_has_an_import_cycle_among_its_modules() -> None:
    """Type-only and function-local imports count: a cycle broken by them is still one."""
    for package in [p for p in SRC.iterdir() if (p / "__init__.py").exists()]:
        prefix = f"conveyor.{package.name}."
        graph = {
            f.stem: {m.removeprefix(prefix) for m in _imports(f) if m.startswith(prefix)} for f in package.glob("_*.py")
        }
        graph.pop("__init__", None)
        assert _cycle(graph) is None, f"{package.name}: {' -> '.join(_cycle(graph) or [])}"


def _layers() -> dict[str, int]:
    """Each subpackage's place in docs/architecture.md's dependency order (siblings share one)."""
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    line = re.search(r"```text\n(schedule ←[^\n]*)\n```", page)
    assert line, "architecture.md lost its dependency order"
    return {name.strip(): i for i, group in enumerate(line[1].split("←")) for name in group.split(",")}


def test_every_import_follows_the_dependency_order_of_architecture_md() -> None:
    """A package imports only those to its left in the order (function-local and type-only imports count)."""
    layers = _layers()
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert set(layers) == packages, "architecture.md's dependency order names every subpackage, and only those"
    against = []
    for path in SRC.rglob("*.py"):
        home = path.relative_to(SRC).parts[0]
        for module in _imports(path):
            used = module.split(".")[1] if module.count(".") else ""
            if home in layers and used in layers and used != home and layers[used] >= layers[home]:
                against.append(f"{path.relative_to(SRC)} imports {module}")
    assert not against
