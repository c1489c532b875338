"""The package: every module imports with the declared dependencies, and scheduling and planning need no torch."""

import importlib
import pkgutil
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


BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


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
