"""The rooms of the tree and what each may import (docs/design.md, "Rooms"), read from the source:
every import, also those inside functions, so a lazy import cannot hide a loop between rooms."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"contract", "export", "serving", "client", "bench", "tests"}

# room -> the first-party rooms its modules may import (a room may always import itself)
ALLOWED = {
    "contract": set(),
    "client": {"contract"},
    "serving.engine": {"contract"},
    "serving.triton": {"contract", "serving.engine"},
    "serving.host": {"contract", "client", "serving.triton"},
    "serving.gateway": {"contract", "client"},
    "export": {"contract", "serving.engine"},
}
# what runs inside Triton's Python backend never needs the export's or the gateway's packages
FORBIDDEN_THIRD_PARTY = {
    # safetensors is allowed: a session snapshot is a safetensors file (serving/engine/snapshots.py)
    "serving.engine": {"torch", "onnxscript", "onnx_ir", "triton_python_backend_utils", "tritonclient"},
    "serving.triton": {"torch", "onnxscript", "onnx_ir"},  # the Triton image carries none of them
    "serving.gateway": {"torch", "onnxruntime", "onnx", "triton_python_backend_utils"},
    "serving.host": {"torch", "onnxruntime", "triton_python_backend_utils"},
    "client": {"torch", "onnxruntime", "onnx", "fastapi"},
}
# rooms a room may reach through another yet never load: the host writes and reads Triton's configs
# (serving.triton) but the engine runs inside Triton, not beside the launcher
NEVER_LOADS = {"serving.host": {"serving.engine"}}
# rooms that may load no third-party package but these (and the standard library)
ONLY_THIRD_PARTY = {"contract": {"numpy"}}
# modules that compiled extensions register under names of their own (numpy's Cython runtime)
EXTENSION_RUNTIME = ("cython_runtime", "_cython_")
# `python -m export inspect --text` reads the artifact's tokenizer the one way the product reads one
# (client/text.py), inside the function that needs it; the build probes a checkpoint's tokenizer as the
# gateway will at its load (client/text.py `tokenizer_probe_failure`), inside the function that does.
EXCEPTIONS = {
    "export/inspect_form.py": {"client"},
    "export/importers.py": {"client"},
}


def room_of(module: str) -> str | None:
    """The room a dotted module name lies in (the longest room name that prefixes it)."""
    rooms = [room for room in ALLOWED if module == room or module.startswith(room + ".")]
    return max(rooms, key=len) if rooms else None


def imports(relative: str, source: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, wherever it stands."""
    package = ".".join(Path(relative).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(source, relative)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            # `from serving.engine import ort` names a module: count it as the deeper name
            found += [(node.lineno, f"{base}.{alias.name}" if base in ALLOWED else base) for alias in node.names]
    return found


def room_files() -> list[tuple[str, Path]]:
    files = []
    for room in ALLOWED:
        folder = ROOT / room.replace(".", "/")
        files += [(room, path) for path in sorted(folder.rglob("*.py"))]
    return files


def violations(room: str, relative: str, source: str) -> list[str]:
    allowed = ALLOWED[room] | {room} | EXCEPTIONS.get(relative, set())
    found = []
    for line, module in imports(relative, source):
        top = module.split(".")[0]
        if top in FIRST_PARTY:
            target = room_of(module) or ("serving" if top == "serving" else top)
            if target not in allowed:
                found.append(f"{relative}:{line} imports {module} (room {target})")
        elif top in FORBIDDEN_THIRD_PARTY.get(room, ()):
            found.append(f"{relative}:{line} imports {module}")
    return found


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_room_imports_only_what_its_rules_allow(room):
    found = [
        v
        for r, path in room_files()
        if r == room
        for v in violations(r, path.relative_to(ROOT).as_posix(), path.read_text())
    ]
    assert not found, "\n".join(found)


def test_nothing_that_serves_imports_the_build():
    """The server builds only by running `python -m export build` (serving/triton/cli.py `export_build`): no
    module under serving/ (its commands too, which lie in no room), client/ or contract/ imports export/."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for top in ("serving", "client", "contract")
        for path in sorted((ROOT / top).rglob("*.py"))
        for line, module in imports(path.relative_to(ROOT).as_posix(), path.read_text())
        if module.split(".")[0] == "export"
    ]
    assert not found, "\n".join(found)


def test_the_rules_see_forbidden_imports():
    """The checker itself: lazy imports of the gateway and of torch inside the engine, and a relative
    import out of the gateway into the host, are caught."""
    lazy = "def f():\n    from serving.gateway import app\n    import torch\n"
    found = violations("serving.engine", "serving/engine/probe.py", lazy)
    assert any("serving.gateway.app" in v for v in found) and any("imports torch" in v for v in found), found
    found = violations("serving.gateway", "serving/gateway/probe.py", "from ..host import launcher\n")
    assert found == ["serving/gateway/probe.py:1 imports serving.host.launcher (room serving.host)"]


# A fresh interpreter imports the modules named in argv and prints what it loaded beyond its start.
# Triton's `triton_python_backend_utils` exists only inside Triton's stub: where a room may load it
# (the models), an empty stand-in takes its place so that the models import here too.
LOADER = textwrap.dedent(
    """
    import importlib, json, sys, types
    started = set(sys.modules)
    if sys.argv[1] == "stand-in":
        sys.modules["triton_python_backend_utils"] = backend = types.ModuleType("triton_python_backend_utils")
        backend.__getattr__ = lambda name: None
        started.add(backend.__name__)
    for module in sys.argv[2:]:
        importlib.import_module(module)
    print(json.dumps(sorted(set(sys.modules) - started)))
    """
)


def loadable(room: str) -> set[str]:
    """The rooms `room` may load: itself, those it may import, and what those may load (never those
    of NEVER_LOADS)."""
    rooms, todo = {room}, [room]
    while todo:
        for other in ALLOWED[todo.pop()] - rooms - NEVER_LOADS.get(room, set()):
            rooms.add(other)
            todo.append(other)
    return rooms


def room_modules(room: str) -> list[str]:
    """The dotted names of every module of `room` (packages by their own name)."""
    folder = ROOT / room.replace(".", "/")
    paths = (path.relative_to(ROOT).with_suffix("") for path in sorted(folder.rglob("*.py")))
    return [".".join(path.parts[:-1] if path.name == "__init__" else path.parts) for path in paths]


def load_violations(room: str, loaded: list[str]) -> list[str]:
    """What loading `room` brought in that its rules forbid, first-party through any import path."""
    may_load = loadable(room)
    found = []
    for module in loaded:
        top = module.split(".")[0]
        if top in FIRST_PARTY:
            target = room_of(module)
            parent = target is None and any(other.startswith(module + ".") for other in ALLOWED)  # `serving`
            if not parent and (target or top) not in may_load:
                found.append(f"{module} (room {target or top})")
        elif top in FORBIDDEN_THIRD_PARTY.get(room, ()):
            found.append(module)
        elif room in ONLY_THIRD_PARTY and not _standard_or(module, ONLY_THIRD_PARTY[room]):
            found.append(f"{module} (not the standard library or {', '.join(sorted(ONLY_THIRD_PARTY[room]))})")
    return found


def _standard_or(module: str, packages: set[str]) -> bool:
    top = module.split(".", 1)[0]
    return top in packages or top in sys.stdlib_module_names or module.startswith(EXTENSION_RUNTIME)


def loaded_by(room: str) -> list[str]:
    stand_in = room == "serving.triton"  # its models; every other room is checked without one
    done = subprocess.run(
        [sys.executable, "-c", LOADER, "stand-in" if stand_in else "none", *room_modules(room)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"importing {room} failed:\n{done.stderr}"
    return json.loads(done.stdout)


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_each_room_loads_only_what_its_rules_allow(room):
    """Every module of the room imported in a fresh interpreter: what got loaded, through any import
    path, lies in the rooms it may load (the host and the gateway load no engine, the engine no torch)."""
    found = load_violations(room, loaded_by(room))
    assert not found, f"importing {room} loads, against docs/design.md's rooms:\n" + "\n".join(sorted(found))


def test_the_load_rules_see_what_a_room_loads_on_the_way():
    """The checker itself: the engine loaded by the gateway (through the client or any other path) and
    by the host (though the Triton room it may load may load it), torch in the engine, a package that
    is not numpy in the contract; the `serving` package and the rooms of an allowed room pass."""
    assert loadable("serving.host") == {"serving.host", "contract", "client", "serving.triton"}
    assert loadable("serving.gateway") == {"serving.gateway", "contract", "client"}
    loaded = ["serving", "serving.gateway.app", "client.sync", "contract.names", "serving.engine.settings"]
    assert load_violations("serving.gateway", loaded) == ["serving.engine.settings (room serving.engine)"]
    found = load_violations("serving.host", ["serving.host.launcher", "serving.triton.config", "serving.engine.ort"])
    assert found == ["serving.engine.ort (room serving.engine)"]
    assert load_violations("serving.triton", ["serving.triton.config", "serving.engine.ort", "contract"]) == []
    assert load_violations("serving.engine", ["serving.engine.ort", "torch.nn"]) == ["torch.nn"]
    found = load_violations("contract", ["contract.names", "numpy.linalg", "json", "yaml"])
    assert found == ["yaml (not the standard library or numpy)"]


def product_modules() -> list[Path]:
    return [
        path for room in ("contract", "client", "serving", "export") for path in sorted((ROOT / room).rglob("*.py"))
    ]


def top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (assignments, functions, classes)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elements = target.elts if isinstance(target, ast.Tuple) else [target]
                names |= {t.id for t in elements if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


# Facts that must have one definition: a second copy drifts (the house review found each written 2-4 times).
DEFINED_ONCE = (
    "PROJECT_ROOT",
    "DEFAULT_REPOSITORY",
    "CPU",
    "CUDA",
    "CPU_PROVIDER",
    "CUDA_PROVIDER",
    "TRT_PROVIDER",
    "session_float_dtype",
    "session_options",
    "check_request_tokens",
    "config_from",
)


def test_each_shared_fact_is_defined_once():
    where: dict[str, list[str]] = {name: [] for name in DEFINED_ONCE}
    for path in product_modules():
        for name in top_level_names(path) & set(DEFINED_ONCE):
            where[name].append(path.relative_to(ROOT).as_posix())
    twice = {name: places for name, places in where.items() if len(places) != 1}
    assert not twice, twice


def test_no_module_uses_a_command_line_module_as_a_library():
    """A CLI (`__main__`) only parses arguments; what it runs lives in a library module others import."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in product_modules()
        for line, module in imports(path.relative_to(ROOT).as_posix(), path.read_text())
        if module.split(".")[0] in FIRST_PARTY and module.endswith("__main__")
    ]
    assert not found, "\n".join(found)


def test_triton_configs_are_read_by_one_parser():
    """config.pbtxt is parsed only by serving/triton/config.py's `parse` (as Triton reads it)."""
    parsers = [
        path.relative_to(ROOT).as_posix()
        for path in product_modules()
        if "text_format.Parse(" in path.read_text() or "text_format.Merge(" in path.read_text()
    ]
    assert parsers == ["serving/triton/config.py"], parsers
