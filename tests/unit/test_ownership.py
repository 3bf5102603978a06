"""One owner per concern, read from the code itself.

* No module reads or writes another class's private fields (`other._name`): an underscore name follows only
  `self`/`cls`, a module imported by name (`os._exit`), or anything inside a class that defines that name.
* The NN worker's place in each data loader's stream has one owner, `services/nn_worker/ledger.py`: no other
  module of the NN worker assigns its fields, and the servicer reads the trainer only for its progress.
"""
from __future__ import annotations

import ast
from pathlib import Path

import hybridrec

REPO = Path(hybridrec.__file__).resolve().parent.parent
NN_WORKER = REPO / "services" / "nn_worker"

LEDGER_FIELDS = {"next_seq", "received", "ended", "marks", "trained_through", "unacked", "consumed", "uncounted",
                 "ends_taken", "opened", "last_received", "loader_steps"}
"""The per-loader order's fields (and the names they had before they had one owner)."""

TRAINER_PROGRESS = {"stats", "refresh_train_auc", "in_flight", "publisher"}
"""What the servicer may read of the trainer: its progress, for Status and Stats."""


def _our_sources() -> list[Path]:
    paths = sorted((REPO / "hybridrec").rglob("*.py")) + sorted((REPO / "services").rglob("*.py"))
    return [path for path in paths if "proto" not in path.relative_to(REPO).parts]


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _own_private_names(cls: ast.ClassDef) -> set[str]:
    """The underscore names a class defines: its methods and class fields, and what its methods assign on self."""
    names = {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {target.id for node in cls.body if isinstance(node, (ast.Assign, ast.AnnAssign))
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Name)}
    names |= {node.attr for node in ast.walk(cls) if isinstance(node, ast.Attribute)
              and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    return {name for name in names if name.startswith("_")}


def _private_reads(path: Path, root: Path = REPO) -> list[str]:
    """`x._name` in `path` where x is not self/cls or a module imported by name, and no class around it
    defines `_name` (a class may reach its own fields on another instance of itself: `store._locks` in a
    classmethod of the store)."""
    tree = ast.parse(path.read_text(), str(path))
    modules = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names}
    found: list[str] = []

    def visit(node: ast.AST, own: frozenset[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own = own | _own_private_names(node)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = _root(node.value)
            if not (isinstance(base, ast.Name) and base.id in {"self", "cls"} | modules) and node.attr not in own:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(tree, frozenset())
    return found


def test_no_module_reads_another_objects_private_fields():
    found = [line for path in _our_sources() for line in _private_reads(path)]
    assert not found, "private fields read across an object's boundary:\n" + "\n".join(found)


def test_the_check_finds_a_private_read(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("import os\nclass A:\n    _x = 1\n    def _y(self, other: 'A'):\n"
                      "        os._exit; A._x; self._y; other._y\n        return other._z\n"
                      "def g(a):\n    return a._y\n")
    assert [line.split(": ", 1)[1] for line in _private_reads(source, tmp_path)] == ["other._z", "a._y"]


def _assigned_attributes(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) for every `x.attr = ...`, `x.attr += ...` and `x.attr[...] = ...` in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets += target.elts
                continue
            while isinstance(target, ast.Subscript):
                target = target.value
            if isinstance(target, ast.Attribute):
                found.append((node.lineno, target.attr))
    return found


def test_the_check_finds_an_assigned_field(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("a.next_seq = 1\nb.marks[0] += 2\nc.x, d.consumed = 1, 2\ne = f.opened\n")
    assert sorted(_assigned_attributes(source)) == [(1, "next_seq"), (2, "marks"), (3, "consumed"), (3, "x")]


def test_the_per_loader_order_is_assigned_only_by_the_ledger():
    found = [f"{path.name}:{line}: .{attr}" for path in sorted(NN_WORKER.rglob("*.py")) if path.name != "ledger.py"
             for line, attr in _assigned_attributes(path) if attr in LEDGER_FIELDS]
    assert not found, "the ledger's fields assigned outside services/nn_worker/ledger.py:\n" + "\n".join(found)


def test_the_servicer_reads_only_the_trainers_progress():
    tree = ast.parse((NN_WORKER / "server.py").read_text())
    servicer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "NNWorkerServicer")
    read = {node.attr for node in ast.walk(servicer) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "trainer"}
    assert read and read <= TRAINER_PROGRESS, f"the servicer reads {sorted(read - TRAINER_PROGRESS)} of the trainer"
