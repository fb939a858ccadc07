"""Baton's packages import cleanly, in layers, and their modules form no import cycle.

* Every module of ``trainer``, ``elastic``, ``sketch_ops`` and ``data_state`` imports in a
  fresh interpreter (so no module depends on another having been imported first, and no
  optional extra is needed at import time).
* The command modules import without the S3 stack (botocore, s3fs), an install for local
  runs only.
* The import graph among those modules, built with ``ast``, is acyclic and goes down the
  layers (``LAYERS``; inside ``elastic``, ``ELASTIC_LAYERS``): a module imports its own room
  or a room of a lower layer, never a room above it nor another room of its own layer.
  Imports inside functions and under ``if TYPE_CHECKING:`` count too: a deferred import hides
  a cycle or a climb from the interpreter, not from the reader (``sketch_ops/layer.py`` <->
  ``policy.py`` and the demo <-> the fit command were such circles, ``sketch_ops/dispatch.py``
  <-> ``seeds.py`` one under TYPE_CHECKING). Importing ``pkg.mod`` runs the package's
  ``__init__`` first; that implicit edge is not counted.
* Faces are the doors: a module outside a room imports the room (``from elastic.store import
  SnapshotStore``), never one of its modules; the room's ``__init__`` holds what other rooms
  use, and every name it lists resolves. Tests may reach inside the room they test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "elastic", "sketch_ops", "data_state")

# The layers, top first; each a tuple of rooms, each room a tuple of module patterns
# ("pkg.room.*": the module and every module below it; otherwise that module alone). A module
# belongs to the room of its longest matching pattern.
Layers = tuple[tuple[tuple[str, ...], ...], ...]
LAYERS: Layers = (
    (("trainer.cli.*",),),  # every `baton` command
    (("trainer",),),  # the public face: fit, load_recipe, Session, ElasticTorchTrainer
    (("trainer.on_ray.*",), ("trainer.on_jax.*",)),  # Ray; JAX (neither imports the other)
    (("trainer.run.*",),),  # the driver
    (("trainer.train.*",),),  # the worker
    (("trainer.config.*",),),  # the recipe
    (("elastic.*",), ("data_state.*",), ("sketch_ops.*",)),
    (("elastic.storage.*",),),  # the leaf
)
# Inside elastic (edges between two of its modules), in the order a snapshot passes.
ELASTIC_LAYERS: Layers = (
    (("elastic", "elastic.snapshotter", "elastic.settings", "elastic.preemption",
      "elastic.catalog", "elastic.set_aside", "elastic.replicas", "elastic.snapshot_ref",
      "elastic.testing"),),  # the face
    (("elastic.write.*",), ("elastic.read.*",), ("elastic.portable.*",),
     ("elastic.recovery.*",)),
    (("elastic.coord.*",),),
    (("elastic.lease.*",),),
    (("elastic.store.*",), ("elastic.state.*",)),
    (("elastic.format.*",),),
    (("elastic.errors",), ("elastic.faults",), ("elastic.collectives",), ("elastic.version",),
     ("elastic.rendezvous",)),
    (("elastic.storage.*",),),
)


def _modules() -> dict[str, Path]:
    """Module name -> file, for every module of the packages (``pkg`` for ``__init__``)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue  # runs the program: `python -m pkg` only
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Baton modules that ``module`` imports anywhere (in functions, under TYPE_CHECKING
    too) -> first line."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str, line: int) -> None:
        while name and name not in modules:  # `from pkg.mod import func` -> pkg.mod
            name = name.rpartition(".")[0]
        if name and name != module:
            found.setdefault(name, line)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                if base in modules and alias.name in _face_names(modules[base]):
                    add(base, node.lineno)  # a name the package's face binds (a function
                    continue  # may share its module's name: sketch_ops.norm_linear)
                add(f"{base}.{alias.name}", node.lineno)  # a submodule, or a name in base
    return found


def _face_names(path: Path) -> set[str]:
    """The names an ``__init__`` binds by importing them, at top level or under
    TYPE_CHECKING (a lazy face's names); empty for a plain module."""
    if path.name != "__init__.py":
        return set()
    names: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in tree.body:
        body = node.body if isinstance(node, ast.If) else [node]
        for statement in body:
            if isinstance(statement, ast.ImportFrom):
                names.update(alias.asname or alias.name for alias in statement.names)
    return names


def _import_graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {m: _imports(m, path, modules) for m, path in modules.items()}


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph[node]):
            if state.get(succ) == 1:
                return path[path.index(succ):] + [succ]
            if succ not in state and (cycle := dfs(succ)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)) is not None:
            return cycle
    return None


def _room(module: str, layers: Layers) -> tuple[int, str] | None:
    """(layer index, room name) of `module`: its longest matching pattern's; None: no room."""
    best: tuple[int, int, str] | None = None  # (pattern length, layer, room)
    for index, rooms in enumerate(layers):
        for room in rooms:
            for pattern in room:
                prefix = pattern.removesuffix(".*")
                if module == prefix or (pattern.endswith(".*")
                                        and module.startswith(prefix + ".")):
                    if best is None or len(prefix) > best[0]:
                        best = (len(prefix), index, room[0].removesuffix(".*"))
    return None if best is None else (best[1], best[2])


def layer_violations(graph: dict[str, dict[str, int]], files: dict[str, Path], root: Path,
                     layers: Layers, within: str = "") -> list[str]:
    """One line per import against `layers` (only edges between modules under `within`): the
    file and line, the two modules, their layers. A module of no room is reported too."""
    problems: list[str] = []
    for module in sorted(graph):
        if not module.startswith(within):
            continue
        mine = _room(module, layers)
        if mine is None:
            problems.append(f"{module}: in no room of the layer order; add it to a room")
            continue
        for target, line in sorted(graph[module].items()):
            theirs = _room(target, layers) if target.startswith(within) else None
            if theirs is None or theirs[1] == mine[1] or theirs[0] > mine[0]:
                continue  # outside the order checked here, the same room, or below
            where = "above it" if theirs[0] < mine[0] else "beside it, in the same layer"
            problems.append(
                f"{files[module].relative_to(root)}:{line}: {module} (layer {mine[1]}) "
                f"imports {target} (layer {theirs[1]}), {where}")
    return problems


def _door(module: str, layers: Layers) -> tuple[str, str] | None:
    """(room, door) of `module` under `layers`: its longest matching pattern, and the module
    an import from outside that room must name (``pkg.room`` for ``pkg.room.*``; a single
    module is its own door). None: no room."""
    best: tuple[str, str] | None = None
    for rooms in layers:
        for room in rooms:
            for pattern in room:
                prefix = pattern.removesuffix(".*")
                if module == prefix or (pattern.endswith(".*")
                                        and module.startswith(prefix + ".")):
                    if best is None or len(prefix) > len(best[1]):
                        best = (room[0].removesuffix(".*"), prefix)
    return best


def face_violations(graph: dict[str, dict[str, int]], files: dict[str, Path], root: Path,
                    layers: Layers) -> list[str]:
    """One line per import that reaches past a room's face: a module imports a module inside
    another room (`pkg.room.mod`) instead of the room itself (`from pkg.room import name`).
    Inside its own room a module imports its neighbours directly."""
    problems: list[str] = []
    for module in sorted(graph):
        mine = _door(module, layers)
        for target, line in sorted(graph[module].items()):
            theirs = _door(target, layers)
            if theirs is None or target == theirs[1] or (mine is not None
                                                        and mine[0] == theirs[0]):
                continue  # outside every room, the room's door, or the module's own room
            problems.append(f"{files[module].relative_to(root)}:{line}: {module} imports "
                            f"{target}, inside {theirs[1]}: import it from {theirs[1]}")
    return problems


def _write(root: Path, files: dict[str, str]) -> dict[str, Path]:
    modules = {}
    for name, text in files.items():
        path = root / (name.replace(".", "/") + ("/__init__.py" if text is None else ".py"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text or "")
        modules[name] = path
    return modules


def test_cycle_finder_sees_deferred_relative_and_type_checking_imports(tmp_path) -> None:
    """The graph builder itself: a circle closed by an import inside a function (relative,
    as sketch_ops had it) is found, and one closed under TYPE_CHECKING."""
    modules = _write(tmp_path, {
        "pkg": None,
        "pkg.a": "from .b import g\n\ndef f():\n    from .c import h\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from pkg.a import f\ng = 1\n",
        "pkg.c": "def h():\n    from pkg import a\n",
    })
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert graph["pkg.a"] == {"pkg.b": 1, "pkg.c": 4}
    assert graph["pkg.b"] == {"pkg.a": 3}
    assert _find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    del graph["pkg.b"]["pkg.a"]
    assert _find_cycle(graph) == ["pkg.a", "pkg.c", "pkg.a"]
    del graph["pkg.c"]["pkg.a"]
    assert _find_cycle(graph) is None


def test_layer_checker_reports_deferred_and_type_checking_climbs(tmp_path) -> None:
    """The layer check itself, on a tiny package (top > mid, side > low): an import up the
    order inside a function and one under TYPE_CHECKING are reported with file, line and
    both layers; one between two rooms of a layer too; down the order and inside a room
    are not; a module outside every room is named."""
    modules = _write(tmp_path, {
        "pkg": None,
        "pkg.top": "from pkg.mid import x\n",
        "pkg.mid": None,
        "pkg.mid.x": "from pkg.low import y\nfrom pkg.mid import z\n",
        "pkg.mid.z": "def f():\n    from pkg import top\n",
        "pkg.side": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                    "    from pkg.mid.x import X\n",
        "pkg.low": None,
        "pkg.low.y": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from pkg.top import T\n",
        "pkg.stray": "",
    })
    layers: Layers = ((("pkg", "pkg.top"),), (("pkg.mid.*",), ("pkg.side",)),
                      (("pkg.low.*",),))
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert layer_violations(graph, modules, tmp_path, layers) == [
        "pkg/low/y.py:3: pkg.low.y (layer pkg.low) imports pkg.top (layer pkg), above it",
        "pkg/mid/z.py:2: pkg.mid.z (layer pkg.mid) imports pkg.top (layer pkg), above it",
        "pkg/side.py:4: pkg.side (layer pkg.side) imports pkg.mid.x (layer pkg.mid), beside "
        "it, in the same layer",
        "pkg.stray: in no room of the layer order; add it to a room",
    ]


def test_no_import_cycle_among_baton_modules() -> None:
    graph = _import_graph()
    assert {"trainer.train.loop", "elastic.snapshotter", "sketch_ops.layer",
            "data_state.loader"} <= set(graph)
    cycle = _find_cycle(graph)
    if cycle is not None:
        steps = [f"{a} -> {b} (line {graph[a][b]})"
                 for a, b in zip(cycle, cycle[1:], strict=False)]
        raise AssertionError("import cycle: " + "; ".join(steps) + ". Move the shared piece "
                             "into the module it belongs to (or a small leaf module).")


def test_imports_go_down_the_layers() -> None:
    """cli > trainer (the face) > on_ray, on_jax > run > train > config > elastic, data_state,
    sketch_ops > elastic.storage; inside elastic: the face > write, read, portable > coord >
    lease > store, state > format > errors, faults, collectives, version > storage."""
    graph, files = _import_graph(), _modules()
    problems = (layer_violations(graph, files, ROOT, LAYERS)
                + layer_violations(graph, files, ROOT, ELASTIC_LAYERS, within="elastic"))
    assert not problems, ("imports against the layer order (a module imports its own room "
                          "or a lower layer):\n" + "\n".join(problems))


def test_face_checker_reports_imports_past_a_face(tmp_path) -> None:
    """The face check itself, on a tiny package: an import of a module inside another room
    (at module level, inside a function, under TYPE_CHECKING) is reported with file and line;
    one through the room's face, one of a single-module room and one between two modules of
    the same room are not."""
    modules = _write(tmp_path, {
        "pkg": None,
        "pkg.top": "from pkg.low.y import Y\nfrom pkg.low import Z\nfrom pkg import one\n",
        "pkg.one": "def f():\n    import pkg.low.z\n",
        "pkg.mid": None,
        "pkg.mid.x": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from pkg.low.y import Y\nfrom pkg.mid.w import W\n",
        "pkg.mid.w": "from pkg.low import y\n",
        "pkg.low": "from pkg.low.y import Y\nfrom pkg.low.z import Z\n",
        "pkg.low.y": "from pkg.low.z import Z\nY = 1\n",
        "pkg.low.z": "Z = 1\n",
    })
    layers: Layers = ((("pkg", "pkg.top", "pkg.one"),), (("pkg.mid.*",),), (("pkg.low.*",),))
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert face_violations(graph, modules, tmp_path, layers) == [
        "pkg/mid/w.py:1: pkg.mid.w imports pkg.low.y, inside pkg.low: import it from pkg.low",
        "pkg/mid/x.py:3: pkg.mid.x imports pkg.low.y, inside pkg.low: import it from pkg.low",
        "pkg/one.py:2: pkg.one imports pkg.low.z, inside pkg.low: import it from pkg.low",
        "pkg/top.py:1: pkg.top imports pkg.low.y, inside pkg.low: import it from pkg.low",
    ]


def test_imports_from_outside_a_room_go_through_its_face() -> None:
    """A module outside a room imports the room (its ``__init__``, the names other rooms use),
    never one of its modules: `from elastic.format import Manifest`, not
    `from elastic.format.records import Manifest`. The rooms are those of ``LAYERS`` and
    ``ELASTIC_LAYERS``; a room of one module (``elastic.errors``) is its own face."""
    graph, files = _import_graph(), _modules()
    problems = face_violations(graph, files, ROOT, LAYERS + ELASTIC_LAYERS)
    assert not problems, (f"{len(problems)} imports past a room's face:\n"
                          + "\n".join(problems))


def _passes_in_a_fresh_interpreter(code: str, *args: str) -> None:
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = sorted(_modules())
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    importlib.import_module(name)\n")
    _passes_in_a_fresh_interpreter(code, *names)


def test_the_command_line_needs_no_s3_stack() -> None:
    """A local-only install (no botocore/s3fs/boto3, as on the GPU machine of the GPU check)
    still runs every command module: the S3 stack is imported only where S3 is used."""
    code = ("import sys\n"
            "for name in ('botocore', 's3fs', 'boto3', 'aiobotocore'):\n"
            "    sys.modules[name] = None  # importing it now raises ImportError\n"
            "import trainer.cli.main, trainer.cli.snapshots, trainer.cli.data\n"
            "import trainer.cli.fit, trainer.cli.report, trainer.cli.runs, trainer.run.report\n"
            "from elastic.storage import storage_errors\n"
            "assert storage_errors() == (OSError,), storage_errors()\n")
    _passes_in_a_fresh_interpreter(code)


def test_every_face_name_resolves() -> None:
    """Each room's face (``__all__``) names objects that exist, the lazily loaded ones too
    (an import through a face fails at the first use otherwise), and lists every name the
    face binds."""
    faces = sorted({pattern.removesuffix(".*") for rooms in LAYERS + ELASTIC_LAYERS
                    for room in rooms for pattern in room if pattern.endswith(".*")}
                   | {"elastic", "trainer"})
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    face = importlib.import_module(name)\n"
            "    missing = [n for n in face.__all__ if getattr(face, n, None) is None]\n"
            "    assert not missing, (name, missing)\n")
    _passes_in_a_fresh_interpreter(code, *faces)
    modules = _modules()
    for face in faces:
        tree = ast.parse(modules[face].read_text())
        bound = {alias.asname or alias.name for node in tree.body
                 if isinstance(node, ast.ImportFrom) and node.module not in ("__future__",
                                                                             "typing")
                 for alias in node.names}
        assigned = {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Name)}
        if "_LAZY" in assigned:
            bound |= set(ast.literal_eval(assigned["_LAZY"]))
        listed = set(ast.literal_eval(assigned["__all__"]))
        assert bound <= listed, (face, sorted(bound - listed))


def test_the_elastic_face_names_resolve_without_loading_torch() -> None:
    """`elastic.__all__` lists exactly the lazy names, each resolves to a real object, and
    `import elastic` alone loads neither torch nor Ray (``data_state`` relies on that)."""
    code = ("import sys, elastic\n"
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
            "assert sorted(elastic.__all__) == sorted(elastic._LAZY), elastic.__all__\n"
            "missing = [n for n in elastic.__all__ if getattr(elastic, n, None) is None]\n"
            "assert not missing, missing\n")
    _passes_in_a_fresh_interpreter(code)
