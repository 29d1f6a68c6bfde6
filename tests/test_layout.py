"""The package's shape, read from the source (AST): which module may import which.

Pattern packages import torch, the standard library and isotrain's shared helpers only; the
trainer imports the five public packages (never their insides); nothing imports the trainer;
and no import circle exists anywhere, function-level imports included.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from tests.guides import blocks

SRC = Path(__file__).resolve().parents[1] / "src"
PATTERNS = ("autograd", "checkpointing", "guard", "compile", "contexts")
SHARED = ("isotrain._shared", "isotrain._torch_private")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, at any depth (a function-level import counts too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            out.append(base)
            # `from isotrain.train.data import batches` imports isotrain.train.data.batches
            out += [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
    return out


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


GRAPH = {
    _module_name(p): [i for i in _imports(p) if i.split(".")[0] == "isotrain"]
    for p in sorted((SRC / "isotrain").rglob("*.py"))
}
THIRD_PARTY = {
    _module_name(p): {i.split(".")[0] for i in _imports(p)} - {"isotrain", "__future__"}
    for p in sorted((SRC / "isotrain").rglob("*.py"))
}


def _pattern_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PATTERNS else None


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_imports_torch_stdlib_and_shared_helpers_only(pattern: str) -> None:
    for module, targets in GRAPH.items():
        if _pattern_of(module) != pattern:
            continue
        for target in targets:
            own = _pattern_of(target) == pattern
            assert own or target in SHARED, f"{module} imports {target}"
        outside = THIRD_PARTY[module] - set(sys.stdlib_module_names) - {"torch", "numpy"}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_the_doctor_imports_torch_stdlib_shared_helpers_and_public_patterns_only() -> None:
    allowed = {*SHARED, *(f"isotrain.{p}" for p in PATTERNS)}
    for module, targets in GRAPH.items():
        if not module.startswith("isotrain.doctor"):
            continue
        for target in targets:
            own = target.startswith("isotrain.doctor")
            assert own or target in allowed, f"{module} imports {target}"
        outside = THIRD_PARTY[module] - set(sys.stdlib_module_names) - {"torch"}
        assert not outside, f"{module} imports {sorted(outside)}"


def test_the_trainer_imports_only_public_packages() -> None:
    allowed = {"isotrain", "isotrain.doctor", *(f"isotrain.{p}" for p in PATTERNS)}
    for module, targets in GRAPH.items():
        if not module.startswith("isotrain.train"):
            continue
        for target in targets:
            assert target in allowed or target.startswith("isotrain.train"), (
                f"{module} imports {target}: the trainer uses the public packages only"
            )


FRAMEWORKS = {"transformers", "lightning", "pytorch_lightning"}


def test_integrations_import_public_packages_and_their_frameworks_only() -> None:
    allowed = {"isotrain", "isotrain.doctor", *(f"isotrain.{p}" for p in PATTERNS), *SHARED}
    for module, targets in GRAPH.items():
        if module.startswith("isotrain.integrations"):
            for target in targets:
                assert target in allowed or target.startswith("isotrain.integrations"), (
                    f"{module} imports {target}: integrations use the public packages only"
                )
            outside = THIRD_PARTY[module] - set(sys.stdlib_module_names) - {"torch"} - FRAMEWORKS
            assert not outside, f"{module} imports {sorted(outside)}"
        else:
            assert not [t for t in targets if t.startswith("isotrain.integrations")], module


# The trainer's rooms (sub-packages) and top-level modules, from the top of the import graph
# down: each may import only what stands below it. Read docs/layout.md with it.
TRAINER_ORDER = (
    "cli", "loop", "watch", "inputs", "weights", "report", "step", "update", "rundir", "state",
    "precision", "parallel", "rules", "config", "model", "data", "environment", "files", "fields",
)  # fmt: skip


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["isotrain", "train"] and len(parts) > 2 else None


def test_every_trainer_module_belongs_to_a_room_in_the_order() -> None:
    rooms = {_room(m) for m in GRAPH} - {None}
    assert rooms == set(TRAINER_ORDER), f"unplaced: {sorted(rooms ^ set(TRAINER_ORDER))}"


def test_trainer_rooms_import_one_way() -> None:
    for module, targets in GRAPH.items():
        room = _room(module)
        if room is None:
            continue
        for target in targets:
            other = _room(target)
            if other is None or other == room:
                continue
            assert TRAINER_ORDER.index(other) > TRAINER_ORDER.index(room), (
                f"{module} imports {target}: the room {room} stands below {other}"
            )


def test_each_trainer_room_says_what_it_owns() -> None:
    for room in TRAINER_ORDER:
        init = SRC / "isotrain" / "train" / room / "__init__.py"
        if init.is_file():
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc and len(doc.split()) > 20, f"{init}: no docstring saying what it owns"


def test_the_layout_page_names_only_paths_that_exist() -> None:
    """The layout for contributors (docs/layout.md, its one unlabelled block) names only paths
    that exist, and every module and room of the trainer."""
    (block,) = [b.code for b in blocks(SRC.parent / "docs" / "layout.md") if b.lang == ""]
    base, named = None, []
    for line in block.splitlines():
        head = line.split("  ")[0].strip() if not line.startswith(" ") else ""
        if head:
            base = head if head.endswith("/") else None
            named.append(head)
        elif base is not None:
            words = line.strip().split("  ")[0].split()
            named += [base + w for w in words if w.endswith((".py", "/"))]
    assert len(named) > 20
    missing = [n for n in named if not (SRC.parent / n).exists()]
    assert not missing, f"docs/layout.md names paths that do not exist: {missing}"
    trainer = {p.name for p in (SRC / "isotrain" / "train").iterdir() if p.suffix == ".py"}
    rooms = {p.name + "/" for p in (SRC / "isotrain" / "train").iterdir() if p.is_dir()}
    listed = {n.rsplit("/", 2)[-1] or n.rsplit("/", 2)[-2] + "/" for n in named}
    unlisted = (trainer - {"__init__.py"} | rooms - {"__pycache__/"}) - listed
    assert not unlisted, f"docs/layout.md leaves out {sorted(unlisted)}"
    doctor = {f"src/isotrain/doctor/{room}/" for room in DOCTOR_ROOMS}
    assert doctor <= set(named), f"docs/layout.md leaves out {sorted(doctor - set(named))}"


# The doctor's rooms: each may import only the rooms named here (and itself); the families of
# checks stand side by side on the ground, so reading one family needs no other. Above them
# all, `_examine` runs the families and the package's `__init__` is the public API.
DOCTOR_FAMILIES = ("state", "update", "losses", "model", "numerics", "data", "performance")
DOCTOR_ROOMS: dict[str, tuple[str, ...]] = {
    "monitor": ("ranks", "ground"),
    "ranks": ("ground",),
    **{family: ("ground",) for family in DOCTOR_FAMILIES},
    "ground": (),
}


def _doctor_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["isotrain", "doctor"] and len(parts) > 2 else None


def doctor_upward_imports(graph: dict[str, list[str]]) -> list[str]:
    """Each import between the doctor's rooms that its room may not make."""
    bad = []
    for module, targets in graph.items():
        room = _doctor_room(module)
        if room is None or room == "_examine":
            continue
        for target in targets:
            other = _doctor_room(target)
            if other is not None and other != room and other not in DOCTOR_ROOMS[room]:
                bad.append(
                    f"{module} imports {target}: {room} may import only {DOCTOR_ROOMS[room]}"
                )
    return bad


def test_every_doctor_module_belongs_to_a_room() -> None:
    rooms = {_doctor_room(m) for m in GRAPH} - {None, "_examine"}
    assert rooms == set(DOCTOR_ROOMS), f"unplaced: {sorted(rooms ^ set(DOCTOR_ROOMS))}"


def test_doctor_rooms_import_one_way() -> None:
    assert doctor_upward_imports(GRAPH) == []


def test_an_upward_or_sideways_doctor_import_is_caught() -> None:
    planted = {
        "isotrain.doctor.ground.trace": ["isotrain.doctor.state.leaks"],  # upward
        "isotrain.doctor.losses.fit": ["isotrain.doctor.update.params"],  # family to family
        "isotrain.doctor.ranks.link": ["isotrain.doctor.monitor.text"],  # upward
    }
    assert [b.split(":")[0] for b in doctor_upward_imports(planted)] == [
        "isotrain.doctor.ground.trace imports isotrain.doctor.state.leaks",
        "isotrain.doctor.losses.fit imports isotrain.doctor.update.params",
        "isotrain.doctor.ranks.link imports isotrain.doctor.monitor.text",
    ]


def test_each_doctor_room_says_what_it_owns_and_lists_its_kinds() -> None:
    from isotrain.doctor import KINDS, _examine, monitor

    owned = {f.__name__.rsplit(".", 1)[1]: {k for c in f.CHECKS for k in c.names}
             for f in _examine.FAMILIES}  # fmt: skip
    owned["ground"] = {"doctor_error"}
    owned["monitor"] = {k.name for k in monitor.KINDS} | {"replica_divergence"}
    for room in DOCTOR_ROOMS:
        doc = ast.get_docstring(
            ast.parse((SRC / "isotrain/doctor" / room / "__init__.py").read_text())
        )
        assert doc and len(doc.split()) > 15, f"doctor/{room}: no docstring saying what it owns"
        listed = set(re.findall(r"`(\w+)`", doc.split("Kinds:", 1)[1]))
        assert listed == owned[room], f"doctor/{room}'s docstring lists {sorted(listed)}"
    assert set().union(*owned.values()) == set(KINDS)


def test_nothing_but_the_entry_point_imports_the_trainer() -> None:
    for module, targets in GRAPH.items():
        if module.startswith("isotrain.train") or module == "isotrain.__main__":
            continue
        assert not [t for t in targets if t.startswith("isotrain.train")], module


def test_no_import_circle() -> None:
    def parents(name: str) -> list[str]:  # importing a.b.c runs a/__init__ and a/b/__init__
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(2, len(parts))]

    edges = {m: {t for t in ts if t in GRAPH and t != m} for m, ts in GRAPH.items()}
    for m in edges:
        edges[m] |= {p for t in list(edges[m]) for p in parents(t) if p != m and p in GRAPH}
        edges[m] -= {p for p in parents(m)}  # a package's own __init__ is not a circle

    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def test_the_graph_is_read_at_all() -> None:
    assert "isotrain._torch_private" in GRAPH["isotrain.guard._step"]
    assert "isotrain.train.step" in GRAPH["isotrain.train.loop"]
    assert "isotrain.train.data.batches" in GRAPH["isotrain.train.state"]
