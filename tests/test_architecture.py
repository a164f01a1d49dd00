"""The layout's rules: which packages may import which (every import, those inside functions
too), no circles, imports inside functions only for a heavy optional dependency, and how
long a function may be."""

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
LOADS_A_MODEL = {"policies/learned.py": {"stable_baselines3"}}
"""A trained model's file is read by stable-baselines3, imported by the loading function alone."""


@pytest.mark.parametrize("path", files("envs/**/*.py", "policies/**/*.py", "eval/**/*.py",
                                       exclude=MAY_IMPORT_HEAVY),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_pure_modules_import_no_gymnasium_torch_or_sb3(path):
    rel = str(path.relative_to(ROOT))
    heavy = imported_roots(path) & HEAVY
    assert heavy <= LOADS_A_MODEL.get(rel, set()), f"{rel} imports {heavy}"
    assert not {n.split(".")[0] for n in module_level_imports(path)} & HEAVY, rel


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


RUNTIME = {"policies.table", "policies.table.correction", "policies.step_record", "policies.vllm_metrics",
           "policies.vllm_startup", "policies.vllm_scheduler",
           "envs.pricing", "envs.state", "envs.slack", "envs.errors", "envs.deployment",
           "envs.profiles", "envs.files", "envs.cost"}
"""What a serving engine imports: the table runtime, its speed correction and step record, the vLLM
adapter, and the standard-library modules of envs they rest on (the pass price, the state
vocabulary, the slack count, the input checks, the deployment's features, and the profiles and
roofline a table that carries is re-priced with)."""


def test_serving_runtime_imports_only_stdlib_and_vllm():
    for rel in ("policies/table/__init__.py", "policies/vllm_scheduler.py", "policies/vllm_metrics.py",
                "policies/vllm_startup.py", "policies/step_record.py", "envs/pricing.py", "envs/state.py",
                "envs/slack.py", "envs/errors.py", "envs/deployment.py", "envs/profiles.py",
                "envs/files.py", "envs/cost.py"):
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


@pytest.mark.parametrize("path", files("envs/**/*.py", "policies/**/*.py", "eval/**/*.py", "agents/*.py",
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


# --- package order -----------------------------------------------------------------------

ORDER = {"envs": 0, "policies": 1, "eval": 2, "agents": 3, "train": 4}
"""Each package imports only those ranked below it (and itself): the simulator, then the
policies, then evaluation, then training (which evaluates), then the training program."""
PRODUCT = ("envs/**/*.py", "policies/**/*.py", "eval/**/*.py", "agents/**/*.py", "train.py")
HEAVY_OPTIONAL = {"torch", "stable_baselines3", "gymnasium", "ray", "matplotlib", "vllm",
                  "prometheus_client", "envs.chunk_budget_env", "envs.calibrate.torch_passes",
                  "agents.training", "agents.callbacks"}
"""What a function may import where it runs instead of at the top of its module: heavy
libraries a code path may never need (seconds to import, or absent where the simulator or
the table runtime runs), and modules that import them at their top."""


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path):
    """(imported module, line, inside a function, the source lines around it) of every
    absolute import in a file, those under ``if TYPE_CHECKING:`` left out (they never run)."""
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            skip |= {id(n) for n in ast.walk(node)}
    inner = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner |= {id(n) for n in ast.walk(fn)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        context = " ".join(lines[max(node.lineno - 2, 0):node.end_lineno])
        for name in names:
            yield name, node.lineno, id(node) in inner, context


def project_imports():
    """(importing module, imported project module, where) over the product's files."""
    for path in files(*PRODUCT):
        here = module_name(path)
        for name, line, _, _ in imports_of(path):
            if name.split(".")[0] in ORDER:
                yield here, name, f"{path.relative_to(ROOT)}:{line}"


def test_packages_import_downward_only():
    wrong = [f"{where}: {here} imports {name}" for here, name, where in project_imports()
             if ORDER[name.split(".")[0]] > ORDER[here.split(".")[0]]]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_in_a_circle():
    known = {module_name(p) for p in files(*PRODUCT)}

    def target(name: str) -> str | None:  # "eval.capacity", or the package of "envs"
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for here, name, _ in project_imports():
        there = target(name)
        if there and there != here:
            graph.setdefault(here, set()).add(there)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            circle = visit(m)
            assert circle is None, " -> ".join(circle)


def test_imports_inside_functions_are_for_heavy_optional_dependencies_with_a_reason():
    """An import is at the top of its module unless it is of a heavy optional dependency,
    and then a comment on its line (or the one above) says which and why."""
    wrong = []
    for path in files(*PRODUCT):
        for name, line, inner, context in imports_of(path):
            if not inner:
                continue
            heavy = any(name == h or name.startswith(h + ".") for h in HEAVY_OPTIONAL)
            if not heavy or "#" not in context:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name} inside a function"
                             + ("" if heavy else " (not a heavy optional dependency)")
                             + ("" if "#" in context else " without a comment saying why"))
    assert not wrong, "\n".join(wrong)
