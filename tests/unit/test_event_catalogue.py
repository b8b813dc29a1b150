"""The event catalogue (`hvd_resilient/event_names.py`) holds the emitters to it.

Why a source walk and not a run: most events come from failure paths (a hang, a fenced
publish, a dead loader worker) that no unit test reaches, and a misspelt name there is exactly
the event that no reader ever sees. So every `emit` call in the package is read with `ast`: its
name argument must be a catalogue constant (or, in a function that only passes a name on, that
function's parameter), never a string literal; and every name in the catalogue must be emitted
somewhere, so the catalogue does not keep names nothing writes.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from hvd_resilient import event_names

PACKAGE = Path(event_names.__file__).parent
CATALOGUE = "hvd_resilient.event_names"
EMITTERS = {"emit", "_emit", "on_event"}
"""The callables that write an event: `EventLog.emit` and the methods that wrap it (the Horovod
driver's `ctx.emit`, the progress watchdog's and the straggler observer's `self.emit`, the
shard reader's `_emit`), and the checkpoint code's `on_event` callbacks."""
CHECKPOINT_HELPER = "hvd_resilient.checkpoint.events"
"""Its `emit(on_event, name, fields)` takes the name second."""


def _catalogue() -> dict[str, str]:
    return {k: v for k, v in vars(event_names).items() if k.isupper() and isinstance(v, str)}


@dataclass
class _Module:
    path: Path
    modules: set[str] = field(default_factory=set)  # local names of the catalogue module
    names: dict[str, str] = field(default_factory=dict)  # local name -> catalogue constant
    helper_emit: bool = False  # `emit` is the checkpoint helper


def _imports(path: Path, tree: ast.Module) -> _Module:
    m = _Module(path)
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module == "hvd_resilient":
            m.modules.update(a.asname or a.name for a in n.names if a.name == "event_names")
        elif isinstance(n, ast.ImportFrom) and n.module == CATALOGUE:
            m.names.update({a.asname or a.name: a.name for a in n.names})
        elif isinstance(n, ast.ImportFrom) and n.module == CHECKPOINT_HELPER:
            m.helper_emit |= any(a.name == "emit" and a.asname is None for a in n.names)
        elif isinstance(n, ast.Import):
            m.modules.update(a.asname for a in n.names if a.name == CATALOGUE and a.asname)
    return m


def _emit_calls(tree: ast.Module):
    """(call, the parameters of the function it is in) for every call of an emitter."""
    def visit(node: ast.AST, params: frozenset[str]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            params = frozenset(x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs])
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) \
                else None
            if name in EMITTERS:
                yield node, params
        for child in ast.iter_child_nodes(node):
            yield from visit(child, params)
    yield from visit(tree, frozenset())


def _resolve(m: _Module, arg: ast.expr) -> str | None:
    """The catalogue constant `arg` names, or None."""
    if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) \
            and arg.value.id in m.modules:
        return arg.attr
    if isinstance(arg, ast.Name) and arg.id in m.names:
        return m.names[arg.id]
    return None


def _scan() -> tuple[set[str], list[str]]:
    """(the constants emitted, the problems found)."""
    catalogue = _catalogue()
    emitted: set[str] = set()
    problems: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        m = _imports(path, tree)
        for call, params in _emit_calls(tree):
            helper = (m.helper_emit and isinstance(call.func, ast.Name) and call.func.id == "emit"
                      and len(call.args) == 3)
            index = 1 if helper else 0
            where = f"{path.relative_to(PACKAGE.parent)}:{call.lineno}"
            if len(call.args) <= index:
                problems.append(f"{where}: {ast.unparse(call)[:80]} names no event")
                continue
            arg = call.args[index]
            const = _resolve(m, arg)
            if const is not None:
                if const not in catalogue:
                    problems.append(f"{where}: {ast.unparse(arg)} is not in the catalogue")
                emitted.add(const)
            elif isinstance(arg, ast.Name) and arg.id in params:
                pass  # a wrapper passing its caller's name on; its callers are checked
            else:
                problems.append(f"{where}: event name {ast.unparse(arg)[:60]} is not a constant "
                                "of hvd_resilient/event_names.py")
    return emitted, problems


def _is_event_of(node: ast.expr) -> bool:
    """`x["event"]` or `x.get("event")`."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "event"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event")


def test_every_emitted_name_is_a_catalogue_constant() -> None:
    _, problems = _scan()
    assert not problems, "\n".join(problems)


def test_every_catalogued_name_is_emitted_somewhere() -> None:
    emitted, _ = _scan()
    dead = sorted(set(_catalogue()) - emitted)
    assert not dead, f"catalogued but emitted nowhere: {dead}"


def test_names_are_unique_and_all_lists_them() -> None:
    catalogue = _catalogue()
    by_value: dict[str, list[str]] = {}
    for k, v in catalogue.items():
        by_value.setdefault(v, []).append(k)
    assert not {v: ks for v, ks in by_value.items() if len(ks) > 1}
    assert event_names.ALL == frozenset(catalogue.values())
    assert all(k == v.upper() for k, v in catalogue.items())  # the constant spells the value


def test_readers_compare_an_event_against_constants_not_literals() -> None:
    """`e["event"] == "start"` is the reader's half of the same drift."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for n in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(n, ast.Compare) and _is_event_of(n.left):
                for c in n.comparators:
                    elts = c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]
                    if any(isinstance(x, ast.Constant) and isinstance(x.value, str)
                           for x in elts):
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{n.lineno}")
    assert not found, found


def test_the_check_catches_a_literal(tmp_path: Path) -> None:
    """The walk itself works: a literal name and an unknown constant are both reported."""
    tree = ast.parse("from hvd_resilient import event_names as ev\n"
                     "def f(log):\n    log.emit('start')\n    log.emit(ev.NOPE)\n"
                     "    log.emit(ev.START)\n")
    m = _imports(tmp_path / "x.py", tree)
    args = [c.args[0] for c, _ in _emit_calls(tree)]
    assert [_resolve(m, a) for a in args] == [None, "NOPE", "START"]
    assert "NOPE" not in _catalogue()
