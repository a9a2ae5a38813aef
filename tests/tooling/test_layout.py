"""The layout follows the process boundary (../shared/DESIGN.md, "Layout"): code that runs in the
actors never imports the driver's, and no two packages import each other. Read from the source
with `ast`, function-local imports included, so no test run can miss one."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "raypipe"
ACTOR_SIDE = ("raypipe.actors", "raypipe.transport")
DRIVER_SIDE = ("raypipe.driver", "raypipe.observe", "raypipe.trainer", "raypipe.job", "raypipe.cli", "raypipe.tune")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it (`from a import b` counts a.b as well as a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "raypipe"}


MODULES = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def reached(start: str) -> dict[str, str | None]:
    """Every raypipe module `start` imports, directly or through others (top-level modules
    included), each with the module that imports it: the path back to `start`."""
    seen: dict[str, str | None] = {start: None}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for name in MODULES.get(module, ()):
            target = name if name in MODULES else name.rpartition(".")[0]  # `from a import b`: a.b or a
            if target in MODULES and target != "raypipe" and target not in seen:
                seen[target] = module
                queue.append(target)
    return seen


@pytest.mark.parametrize("module", sorted(m for m in MODULES if within(m, ACTOR_SIDE)))
def test_actor_side_code_never_imports_the_driver(module):
    """Not directly, and not through a module in between: a top-level or shared module that
    imported the driver would carry it into every actor that imports that module."""
    seen = reached(module)
    paths = []
    for name in [n for n in seen if within(n, DRIVER_SIDE)]:
        path = [name]
        while seen[path[-1]] is not None:
            path.append(seen[path[-1]])
        paths.append(" <- ".join(path))
    assert not paths, paths


def test_the_transitive_check_sees_an_import_through_a_module_in_between(monkeypatch):
    """The stage reaches `layers` only through other modules; were `layers` to import the driver,
    the stage would carry it too."""
    assert (
        "raypipe.core.layers" in reached("raypipe.actors.stage")
        and "raypipe.core.layers" not in MODULES["raypipe.actors.stage"]
    )
    assert "raypipe.driver.results" not in reached("raypipe.actors.stage")
    monkeypatch.setitem(MODULES, "raypipe.core.layers", MODULES["raypipe.core.layers"] | {"raypipe.driver.results"})
    assert "raypipe.driver.results" in reached("raypipe.actors.stage")


def package_of(module: str) -> str | None:
    """The subpackage a module belongs to (`raypipe.driver.engines.p2p` -> `raypipe.driver`), None
    for the top-level modules (the user's entry points: trainer, job, cli, tune)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


def test_no_two_packages_import_each_other():
    edges: dict[str, set[str]] = {}
    for module, names in MODULES.items():
        source = package_of(module)
        for name in names:
            target = package_of(name)
            if source and target and target != source:
                edges.setdefault(source, set()).add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges.get(start, ()))

    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if a < b and reaches(b, a, {b}))
    assert not cycles, "package cycles: " + ", ".join(cycles)


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The checks read what they claim to: a function-local import of the driver is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from raypipe.driver.run import controller\n")
    assert within("raypipe.driver.run.controller", DRIVER_SIDE) and "raypipe.driver.run.controller" in imports(bad)
    assert package_of("raypipe.driver.engines.p2p") == "raypipe.driver" and package_of("raypipe.trainer") is None


def test_every_raypipe_import_names_a_module_and_a_name_that_exist():
    """A function-local import of a moved module fails only when its line runs (a job's SIGTERM
    path did, once): every `from raypipe... import x` in the package, the tests, the benchmarks and
    the examples must name an existing module and an existing name or submodule in it."""
    import importlib

    root = PACKAGE.parent
    stale = []
    for path in [
        *PACKAGE.rglob("*.py"),
        *(p for d in ("tests", "benchmarks", "support") for p in (root / d).rglob("*.py")),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("raypipe")):
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                stale.append(f"{path.relative_to(root)}:{node.lineno}: {node.module}")
                continue
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        stale.append(f"{path.relative_to(root)}:{node.lineno}: {node.module}.{alias.name}")
    assert not stale, stale


def test_no_plugin_is_chosen_by_its_name_outside_its_registry():
    """The fourth design step: an objective, engine, schedule or logger is asked what it can do,
    never compared by name (an engine's or an objective's name tested against a string), so a new one is one
    module plus its registry line. Any comparison with a registered name outside the kind's own
    package or registry module is found here, read from the source with `ast`."""
    from raypipe.config.engines import ENGINES
    from raypipe.objectives import OBJECTIVES
    from raypipe.observe.loggers import Loggers
    from raypipe.schedules import SCHEDULES

    homes = {
        "objective": (set(OBJECTIVES), ("raypipe.objectives",)),
        "engine": (set(ENGINES), ("raypipe.config.engines", "raypipe.driver.engines")),
        "schedule": (set(SCHEDULES), ("raypipe.schedules",)),
        "logger": (set(Loggers.KINDS), ("raypipe.observe.loggers", "raypipe.config.loggers")),
    }
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            names = {o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
            for o in operands:  # `x in ("p2p", "compiled")`
                if isinstance(o, (ast.Tuple, ast.List, ast.Set)):
                    names |= {e.value for e in o.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            for kind, (registered, home) in homes.items():
                if names & registered and not within(module, home):
                    found.append(f"{module}:{node.lineno} compares a {kind}'s name {sorted(names & registered)}")
    assert not found, found


def test_no_folder_holds_more_than_15_modules():
    """DESIGN.md's limit: past it a folder is split by concern into sub-packages (as actors/ is)."""
    crowded = {
        str(d.relative_to(PACKAGE.parent)): n
        for d in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")]
        if (n := len(list(d.glob("*.py")))) > 15
    }
    assert not crowded, crowded


def test_tests_and_benchmarks_never_import_each_other():
    """What both need (the toy model and its reference, saves that break, the namespace cluster, the
    benchmarks' paired rounds and the GPU check's report) lives in support/; a test that imported a
    benchmark, or a benchmark a test, would tie one's refactors to the other's."""
    root = PACKAGE.parent
    tests = {p.stem for p in (root / "tests").rglob("*.py")}
    benchmarks = {p.stem for p in (root / "benchmarks").glob("*.py")}
    assert not tests & benchmarks and not tests & {p.stem for p in (root / "support").glob("*.py")}
    crossing = []
    for where, others in (("tests", benchmarks), ("benchmarks", tests), ("support", tests | benchmarks)):
        for path in (root / where).rglob("*.py"):
            text = path.read_text()
            for node in ast.walk(ast.parse(text)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                crossing += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] in others]
            if where != "tests" and re.search(r"""/ ["']tests["']""", text):  # tests/ on a path: sys.path, PYTHONPATH
                crossing.append(f"{path.relative_to(root)}: reaches into tests/")
    assert not crossing, crossing


def test_nothing_a_peer_sends_is_unpickled():
    """torch.distributed's object collectives and pickle's loads run code from whoever sent the
    bytes; ranks exchange plain data instead (`raypipe.transport.plain`). Read from the source
    with `ast`: a call of any of them anywhere in the package is found here."""
    banned = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "recv_object_list"}
    banned |= {"send_object_list", "loads", "load", "Unpickler"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
            name = node.func.attr
            unpickles = name in ("loads", "load", "Unpickler") and owner in ("pickle", "cloudpickle", "dill")
            torch_load = (
                name == "load"
                and owner == "torch"
                and not any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords)
            )
            if (name in banned and name.endswith(("_object", "_object_list"))) or unpickles or torch_load:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {owner}.{name}")
    assert not found, found


def test_the_ground_imports_nothing_above_it():
    """`raypipe.core` (errors, env, devices, layers, protocol, notices) is what every package stands
    on: it imports nothing of raypipe outside itself, not even inside a function."""
    above = {
        module: sorted(n for n in names if not within(n, ("raypipe.core",)) and n != "raypipe")
        for module, names in MODULES.items()
        if within(module, ("raypipe.core",))
    }
    assert len(above) >= 6 and not any(above.values()), {m: n for m, n in above.items() if n}


def test_at_most_one_import_runs_back_up_the_layers():
    """Below the actors and the driver (the ground, the config, schedules, layers, models, data,
    objectives, checkpoints, the planner) nothing imports them, but the one import that the planner
    needs to time layers where they will run: an actor class it starts (`LayerProfiler`)."""
    below = ("raypipe.core", "raypipe.config", "raypipe.schedules", "raypipe.nn", "raypipe.models", "raypipe.data")
    below += ("raypipe.objectives", "raypipe.checkpoint", "raypipe.planning")
    above = ("raypipe.actors", *DRIVER_SIDE)
    back_up = sorted(
        {
            (module, name if name in MODULES else name.rpartition(".")[0])
            for module, names in MODULES.items()
            if within(module, below)
            for name in names
            if within(name, above)
        }
    )
    assert back_up == [("raypipe.planning.profiling", "raypipe.actors.profiler")]


def test_any_is_used_at_most_half_as_often_as_it_was():
    """`typing.Any` switches the type checker off for a value; the package held 989 of them before
    the fourth design step and holds at most half (495) since: a value whose type is known names it
    (a `Boundary`, an `ActorHandle`, a `Feed`), one only passed on or narrowed before use is an
    `object`. The public API's records and any Callable's parameters keep Any, which a user's own
    types must still match (docs/testing.md says how mypy is run against main's baseline)."""
    uses = {p: len(re.findall(r"\bAny\b", p.read_text())) for p in PACKAGE.rglob("*.py")}
    assert sum(uses.values()) <= 495, sorted(uses.items(), key=lambda kv: -kv[1])[:10]


def test_every_benchmark_finds_the_support_modules_it_imports():
    """A benchmark runs as a script (`python benchmarks/x.py`): only benchmarks/ is on its path
    until it puts support/ there, so each import of a support module (`rounds`, ...) must come
    after that, in the script or in a benchmark it imported first. Moving `rounds` to support/ had
    left eight benchmarks failing at their imports, unseen by any test."""
    root = PACKAGE.parent
    benchmarks = {p.stem for p in (root / "benchmarks").glob("*.py")}
    shared = {p.stem for p in (root / "support").glob("*.py")}
    failures: list[str] = []

    def imported(name: str, on_path: bool, chain: tuple[str, ...]) -> bool:
        """Whether support/ is on the path once `name` is imported with it `on_path` or not."""
        for node in ast.parse((root / "benchmarks" / f"{name}.py").read_text()).body:
            text = ast.unparse(node)
            on_path = on_path or ("sys.path.insert" in text and "support" in text.lower())
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                modules = [node.module]
            else:
                continue
            for module in (m.split(".")[0] for m in modules):
                if module in benchmarks and module not in chain:
                    on_path = imported(module, on_path, (*chain, module))
                elif module in shared and not on_path:
                    failures.append(
                        f"benchmarks/{name}.py:{node.lineno} imports {module} before support/ is on the path"
                    )
        return on_path

    for name in sorted(benchmarks):
        imported(name, False, (name,))
    assert len(benchmarks) > 30 and not failures, sorted(set(failures))


def test_a_benchmarks_standard_output_is_its_json_alone(tmp_path):
    """Every benchmark writes its JSON with `json_out.emit` and runs under `json_out.run`, which
    sends every other print (a trainer's start log, by default on standard output) to standard
    error, so `python benchmarks/x.py > x.json` writes a file `json.load` reads. A script run as a
    benchmark runs, printing as a trainer does, shows it."""
    root = PACKAGE.parent
    failures = []
    for path in sorted((root / "benchmarks").glob("*.py")):
        text = path.read_text()
        for call in re.finditer(r"print\(\s*json\.dumps\((?:[^()]|\([^()]*\))*\)([^)]*)\)", text):
            if "file=" not in call[1]:
                failures.append(f"{path.name}: {call[0][:60]}")
        if "json_out.emit(" in text and "json_out.run(main)" not in text:
            failures.append(f"{path.name}: emits JSON but its main does not run under json_out.run")
    assert not failures, failures
    script = tmp_path / "bench.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(root / 'support')!r})\nimport json_out\n\n"
        "def main():\n    print('raypipe: starting 2 actors ...')\n    json_out.emit({'step_s': 0.25}, indent=2)\n\n"
        "json_out.run(main)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(done.stdout) == {"step_s": 0.25} and done.stderr == "raypipe: starting 2 actors ...\n"
