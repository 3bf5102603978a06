"""The CLI is thin: hybridrec/app/cli/ is a package of command groups, and every command function checks its
options and calls the module that owns the work. A command's body (after its signature and
docstring) is at most 20 lines, so work that grows goes where it belongs, not into the command."""
from __future__ import annotations

import ast
from pathlib import Path

import hybridrec.app.cli

CLI = Path(hybridrec.app.cli.__file__).resolve().parent
MAX_BODY_LINES = 20


def _is_command(decorator: ast.expr) -> bool:
    """`@X.command()` / `@X.command("name")`: a function registered as a Typer command."""
    call = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(call, ast.Attribute) and call.attr == "command"


def _body_lines(function: ast.FunctionDef) -> int:
    """Lines from the one after the signature and docstring to the function's end."""
    body = function.body
    has_docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str)
    first = body[0].end_lineno + 1 if has_docstring else body[0].lineno
    return function.end_lineno - first + 1


def commands() -> dict[str, ast.FunctionDef]:
    """Every function of the CLI package registered as a Typer command, by `module.function`."""
    found = {}
    for path in sorted(CLI.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(_is_command(d) for d in node.decorator_list):
                found[f"{path.stem}.{node.name}"] = node
    return found


def test_every_command_is_at_most_twenty_lines():
    long = {name: _body_lines(f) for name, f in commands().items() if _body_lines(f) > MAX_BODY_LINES}
    assert long == {}, f"commands longer than {MAX_BODY_LINES} lines (move the work into its module): {long}"


def test_the_check_finds_every_command_of_the_app():
    """Every command `hybridrec --help` lists is found above, so none escapes the rule."""
    from typer.main import get_command

    from hybridrec.app.cli import app

    def leaves(group) -> set[str]:
        names = set()
        for command in group.commands.values():
            names |= leaves(command) if hasattr(command, "commands") else {command.callback.__name__}
        return names

    assert leaves(get_command(app)) == {name.split(".")[1] for name in commands()}
    assert len(commands()) >= 17


def test_the_count_starts_after_the_docstring():
    tree = ast.parse('@app.command()\ndef f(x: int = 1):\n    """Doc,\n    two lines."""\n    a = 1\n\n    return a\n')
    function = tree.body[0]
    assert [_is_command(d) for d in function.decorator_list] == [True]
    assert _body_lines(function) == 3
    plain = ast.parse("def g():\n    return 1\n").body[0]
    assert _body_lines(plain) == 1
