"""The layout's rules: which modules may import what, and how long a function may be."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEAVY = {"gymnasium", "torch", "stable_baselines3"}


def imported_roots(path: pathlib.Path) -> set[str]:
    """Top-level names of every absolute import in a file, at any depth (lazy ones too)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def files(*patterns: str, exclude: set[str] = frozenset()) -> list[pathlib.Path]:
    return sorted(p for pat in patterns for p in ROOT.glob(pat)
                  if str(p.relative_to(ROOT)) not in exclude)


# Only these may import gymnasium, torch or stable-baselines3: the environment adapter,
# the package's registration, agents/, train.py, and the calibration's torch timing CLI.
MAY_IMPORT_HEAVY = {"envs/__init__.py", "envs/chunk_budget_env.py", "envs/calibrate/__main__.py",
                    "train.py"}


@pytest.mark.parametrize("path", files("envs/**/*.py", "policies/*.py", "eval/*.py",
                                       exclude=MAY_IMPORT_HEAVY),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_modules_import_no_gymnasium_torch_or_sb3(path):
    rel = str(path.relative_to(ROOT))
    assert not imported_roots(path) & HEAVY, f"{rel} imports {imported_roots(path) & HEAVY}"


@pytest.mark.parametrize("path", files("envs/*.py", "envs/calibrate/fit.py", "envs/calibrate/steps.py",
                                       exclude=MAY_IMPORT_HEAVY),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_simulator_core_imports_only_stdlib_and_numpy(path):
    rel = str(path.relative_to(ROOT))
    for root in imported_roots(path):
        assert root in {"numpy", "envs"} or root in sys.stdlib_module_names, f"{rel} imports {root}"


def module_level_imports(path: pathlib.Path) -> set[str]:
    """Modules a file imports when it is imported (not inside functions: a CLI entry point
    may import more when it runs)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


RUNTIME = {"policies.table", "policies.vllm_metrics", "policies.vllm_startup", "policies.vllm_scheduler",
           "envs.pricing", "envs.state", "envs.slack"}
"""What a serving engine imports: the table runtime, the vLLM adapter, and the three
standard-library modules of envs they rest on (the pass price, the state vocabulary, the
slack count)."""


def test_serving_runtime_imports_only_stdlib_and_vllm():
    for rel in ("policies/table.py", "policies/vllm_scheduler.py", "policies/vllm_metrics.py",
                "policies/vllm_startup.py", "envs/pricing.py", "envs/state.py", "envs/slack.py"):
        for name in module_level_imports(ROOT / rel):
            root = name.split(".")[0]
            assert (root in sys.stdlib_module_names or root in {"vllm", "prometheus_client"}
                    or name in RUNTIME), f"{rel} imports {name}"


def test_simulator_runs_without_gymnasium_or_torch():
    code = (
        "import sys\n"
        "for name in ('gymnasium', 'torch', 'stable_baselines3'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "from envs.engine import Simulator\n"
        "import envs.probe, envs.simulate, envs.scenario, envs.observation, envs.reward\n"
        "import envs.episodes, envs.actions, envs.calibrate.fit, eval.harness, policies.specs\n"
        "from envs.workload import SyntheticSpec\n"
        "r = Simulator('h100-sxm', 'llama-3-8b', SyntheticSpec(num_requests=20).build(0)).run(lambda s: 2048)\n"
        "assert r.finished.all()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


MAX_FUNCTION_LINES = 80


@pytest.mark.parametrize("path", files("envs/**/*.py", "policies/*.py", "eval/*.py", "agents/*.py",
                                       "train.py"), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_is_longer_than_80_lines(path):
    long = [(node.name, node.end_lineno - node.lineno + 1)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: {long}"


def test_fork_copies_every_field_explicitly():
    """Simulator.fork names every field it shares, copies, clones or starts afresh; a field
    added to the simulator without a decision there fails here."""
    from envs.engine import Simulator
    from envs.workload import SyntheticSpec

    sim = Simulator("h100-sxm", "llama-3-8b", SyntheticSpec(num_requests=5).build(0))
    groups = (Simulator._FORK_SHARED, Simulator._FORK_COPIED, Simulator._FORK_CLONED,
              Simulator._FORK_FRESH)
    named = [n for g in groups for n in g]
    assert len(named) == len(set(named))
    assert set(named) == set(vars(sim))
    assert set(vars(sim.fork())) == set(vars(sim))
