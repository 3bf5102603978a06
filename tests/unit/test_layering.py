"""The shared package never imports a service: dependencies point from services/ to hybridrec/.

The CLI reaches service code only by name at run time (hybridrec/cli.py: `service_module`).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import hybridrec

PACKAGE = Path(hybridrec.__file__).resolve().parent
REPO = PACKAGE.parent


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_shared_package_does_not_import_services():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 10
    offending = [f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
                 for path in modules
                 for line, name in _imported_modules(ast.parse(path.read_text(), filename=str(path)))
                 if name == "services" or name.startswith("services.")]
    assert not offending, "hybridrec/ imports services/ (use cli.service_module):\n" + "\n".join(offending)


def test_the_check_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from services.embedding_ps import plan\n    import services.dataloader\n")
    assert [name for _, name in _imported_modules(tree)] == ["services.embedding_ps", "services.dataloader"]


def test_no_reader_of_service_stats_parses_metric_names():
    """What a run's summary reads of other services comes typed (`ServiceStats.recovery`): a module that asks
    for a ServiceStats reply reads none of its metric-name `values` and matches no names with a regex, so a
    renamed counter cannot silently read 0."""
    readers = []
    for path in sorted((REPO / "hybridrec").rglob("*.py")) + sorted((REPO / "services").rglob("*.py")):
        text = path.read_text()
        if "ServiceStats.FromString" not in text:
            continue
        readers.append(path.relative_to(REPO).as_posix())
        assert not re.search(r"\.values\b(?!\()", text), f"{path}: reads ServiceStats.values"
        assert "re.compile" not in text and "import re\n" not in text, f"{path}: matches names with a regex"
    assert readers == ["services/nn_worker/results.py"], readers


def test_job_checkpoint_file_names_are_spelled_by_their_owner_only():
    """hybridrec/checkpoints.py owns the job checkpoint's layout: no service spells its file names (a bundle's
    own `dense.pt` and `config.yaml` are hybridrec/bundle.py's; the run directory's `config.yaml` the
    launcher's), so the NN worker, the PS and export cannot drift apart."""
    dense, config = [], []
    for path in sorted((REPO / "hybridrec").rglob("*.py")) + sorted((REPO / "services").rglob("*.py")):
        rel, text = path.relative_to(REPO).as_posix(), path.read_text()
        if '"dense.pt"' in text:
            dense.append(rel)
        if '"config.yaml"' in text and rel.startswith("services/"):
            config.append(rel)
    assert dense == ["hybridrec/bundle.py", "hybridrec/checkpoints.py"], dense
    assert config == [], config
