"""Three layers as three folders, arrows pointing down only: the core library (hybridrec/core/) <- the services
(services/NAME/, each importing the core and itself) <- the app (hybridrec/app/: the CLI, the launcher, reports,
data tools, export). A module's layer is the folder it lives in; beside them, hybridrec/ holds only the public
names users import (`hybridrec.models`, `hybridrec.config`: re-exports of the core), which no code of ours imports.

The check reads the real import graph of every module, imports inside functions included, and refuses an
import by string (`importlib.import_module`, `__import__`) of our own code: the imports by string left are the
plugins, which import what the config names of the user's code: the model class (`hybridrec.core.model.models`)
and the training loss (`hybridrec.core.model.tasks`).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import hybridrec

PACKAGE = Path(hybridrec.__file__).resolve().parent
REPO = PACKAGE.parent
CORE, SERVICES, APP = 0, 1, 2
LAYER_NAMES = ("core", "services", "app")
LAYER_FOLDERS = {CORE: ("hybridrec", "core"), SERVICES: ("services",), APP: ("hybridrec", "app")}
"""Each layer's folder, as the parts of its path from the repository's root."""
PUBLIC_NAMES = ("hybridrec", "hybridrec.models", "hybridrec.config", "hybridrec.__main__")
"""The modules of hybridrec/ outside the layers' folders: the package, the names users import, `python -m`."""
PLUGINS = ("hybridrec.core.model.models", "hybridrec.core.model.tasks")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int | None:
    """The layer of a module of ours: the folder its name lies in (its dotted name is its path). None for a
    module that is not ours (numpy, torch, ...) or one of `PUBLIC_NAMES`; `python -m hybridrec` is the app's."""
    if module == "hybridrec.__main__":
        return APP
    parts = tuple(module.split("."))
    for layer, folder in LAYER_FOLDERS.items():
        if parts[:len(folder)] == folder:
            return layer
    return None


def _service(module: str) -> str | None:
    """services.NAME for a module of a service, else None."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "services" and len(parts) > 1 else None


def _imported_modules(tree: ast.AST, importer: str = "", is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) for every import statement in `tree`, relative ones resolved against `importer`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = importer.split(".")[: len(importer.split(".")) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.append((node.lineno, module))
            # `from hybridrec import app` / `from services import nn_worker` name a package, not an attribute
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names
                      if module in ("hybridrec", "services") and _layer(f"{module}.{alias.name}") is not None]
    return found


def _string_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source of the argument) for every importlib.import_module(...) and __import__(...) call."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and node.args:
                found.append((node.lineno, ast.unparse(node.args[0])))
    return found


def _our_modules() -> list[tuple[Path, str]]:
    paths = sorted(PACKAGE.rglob("*.py")) + sorted((REPO / "services").rglob("*.py"))
    return [(path, _module_name(path)) for path in paths if "proto" not in path.relative_to(REPO).parts]


def _arrows_up() -> list[str]:
    offending = []
    for path, module in _our_modules():
        if _layer(module) is None:
            continue  # a public name: test_every_module_lives_in_its_layers_folder
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported_modules(tree, module, path.name == "__init__.py"):
            target = _layer(name)
            if target is None:
                continue
            where = f"{path.relative_to(REPO)}:{line}: {module} ({LAYER_NAMES[_layer(module)]}) imports {name}"
            if target > _layer(module):
                offending.append(f"{where} ({LAYER_NAMES[target]})")
            elif target == SERVICES and _layer(module) == SERVICES and _service(name) not in (None, _service(module)):
                offending.append(f"{where} (another service)")
        for line, argument in _string_imports(tree):
            if module not in PLUGINS:
                offending.append(f"{path.relative_to(REPO)}:{line}: imports by string: {argument}")
    return offending


def test_three_layers_and_no_arrow_up():
    modules = _our_modules()
    layers = {layer: [m for _, m in modules if _layer(m) == layer] for layer in (CORE, SERVICES, APP)}
    assert len(layers[CORE]) > 20 and len(layers[SERVICES]) > 30 and len(layers[APP]) > 8, layers
    assert {"hybridrec.app.cli", "hybridrec.app.run.launcher", "hybridrec.app.model.export",
            "hybridrec.app.plan.memory"} <= set(layers[APP])
    offending = _arrows_up()
    assert not offending, "imports against the layers (core <- services <- app):\n" + "\n".join(offending)


def test_every_module_lives_in_its_layers_folder():
    """The folders are the layers: every module of ours is in hybridrec/core/, services/ or hybridrec/app/, but
    for `PUBLIC_NAMES`; those import the core only, and no module of ours imports them (the project's code names
    the core's modules, so a public name can be kept for users whatever the core's folders become)."""
    outside, wrong = [], []
    for path, module in _our_modules():
        if _layer(module) is None and module not in PUBLIC_NAMES:
            outside.append(module)
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in _imported_modules(tree, module, path.name == "__init__.py"):
            if name in PUBLIC_NAMES[1:3]:
                wrong.append(f"{path.relative_to(REPO)}:{line}: imports the public name {name}")
            elif module in PUBLIC_NAMES[1:3] and _layer(name) not in (None, CORE):
                wrong.append(f"{path.relative_to(REPO)}:{line}: a public name imports {name}")
    assert outside == [], f"modules outside the layers' folders: {outside}"
    assert wrong == [], "\n".join(wrong)
    public = [m for _, m in _our_modules() if m in PUBLIC_NAMES]
    assert sorted(public) == sorted(PUBLIC_NAMES), public


def test_the_app_imports_services_with_import_statements():
    """The CLI (the package hybridrec/app/cli/, a module per command group) runs the services' code through real
    imports (what the graph above sees), not by name."""
    imported = set()
    for path in sorted((PACKAGE / "app" / "cli").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        imported |= {name for _, name in _imported_modules(tree, _module_name(path), path.name == "__init__.py")}
    assert {"services.dataloader", "services.embedding_ps", "services.inference", "services.nn_worker",
            "services.embedding_worker"} <= {_service(name) for name in imported}


def test_the_check_sees_what_it_must():
    """Imports inside functions, relative imports, and imports by string of our own code."""
    tree = ast.parse("def f():\n    from services.embedding_ps import plan\n    import services.dataloader\n"
                     "    from .app import cli\n    from . import app\n")
    names = [name for _, name in _imported_modules(tree, "hybridrec.core_module")]
    assert names == ["services.embedding_ps", "services.dataloader", "hybridrec.app", "hybridrec", "hybridrec.app"]
    assert [_layer(name) for name in names] == [SERVICES, SERVICES, APP, None, APP]
    assert [_layer(name) for name in ("hybridrec.core.wire.codec", "hybridrec.core", "hybridrec.models")] \
        == [CORE, CORE, None]
    old_cli = 'def service_module(service, module):\n    return importlib.import_module(f"services.{service}.{module}")\n'
    assert _string_imports(ast.parse(old_cli)) == [(2, "f'services.{service}.{module}'")]


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
    """hybridrec/core/layouts/checkpoints.py owns the job checkpoint's layout: no service spells its file names (a
    bundle's
    own `dense.pt` and `config.yaml` are hybridrec/core/layouts/bundle.py's; the run directory's `config.yaml` the
    launcher's), so the NN worker, the PS and export cannot drift apart."""
    dense, config = [], []
    for path in sorted((REPO / "hybridrec").rglob("*.py")) + sorted((REPO / "services").rglob("*.py")):
        rel, text = path.relative_to(REPO).as_posix(), path.read_text()
        if '"dense.pt"' in text:
            dense.append(rel)
        if '"config.yaml"' in text and rel.startswith("services/"):
            config.append(rel)
    assert dense == ["hybridrec/core/layouts/bundle.py", "hybridrec/core/layouts/checkpoints.py"], dense
    assert config == [], config


def _code_files() -> list[Path]:
    return [p for top in ("hybridrec", "services", "benchmarks") for p in sorted((REPO / top).rglob("*.py"))
            if "proto" not in p.relative_to(REPO).parts]


def test_services_json_has_one_owner():
    """services.json is spelled, written and read by hybridrec/core/layouts/summary.py only (`ServiceInfo`,
    `write_services`,
    `read_services`); its one writer is the launcher's cluster runner, which the testbed runs its hosts
    through; the report reads the rows through it."""
    spelled = [p.relative_to(REPO).as_posix() for p in _code_files() if '"services.json"' in p.read_text()]
    assert spelled == ["hybridrec/core/layouts/summary.py"], spelled
    writers = [p.relative_to(REPO).as_posix() for p in _code_files() if "write_services(" in p.read_text()]
    assert sorted(writers) == ["hybridrec/app/run/launcher.py", "hybridrec/core/layouts/summary.py"], writers
    assert "LocalCluster(" in (REPO / "benchmarks" / "testbed" / "bed.py").read_text()


def test_no_metric_text_is_parsed_outside_metrics_code():
    """Prometheus text is for Prometheus: no module of ours reads metric values back from it."""
    parsers = [p.relative_to(REPO).as_posix() for p in _code_files()
               if "text_string_to_metric_families" in p.read_text() or "parser.text_fd_to" in p.read_text()]
    assert parsers == [], parsers


def _import_graph() -> dict[str, set[str]]:
    """Our module -> our modules it imports (imports inside functions and under TYPE_CHECKING included)."""
    modules = dict((module, path) for path, module in _our_modules())
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        names = {name for _, name in _imported_modules(tree, module, path.name == "__init__.py")}
        graph[module] = {name for name in names if name in modules and name != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, groups, counter = {}, {}, set(), [], [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_modules_import_each_other_in_a_circle():
    """Each module imports in one direction: a circle (the CLI and the fork server's parent, the report and its
    page, the trainer and the checkpointer once) means neither can be read, tested or replaced alone. A
    package's __init__ is left out (it may gather its modules)."""
    graph = {m: {d for d in deps if not _is_package(d)} for m, deps in _import_graph().items() if not _is_package(m)}
    assert _cycles(graph) == []


def _is_package(module: str) -> bool:
    return (REPO / Path(*module.split(".")) / "__init__.py").exists()
