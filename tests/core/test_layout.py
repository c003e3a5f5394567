"""The package's layout rules, checked on its source with ``ast``.

(a) No import cycle among posattn modules, counting imports deferred into functions (an import
    under ``if TYPE_CHECKING:`` never runs and is not counted). ``from pkg import name`` is an
    edge to the submodule ``pkg.name`` where that is a module, else to ``pkg``; the implicit
    import of a module's parent package is not an edge.
(b) No module outside ``posattn/mechanisms/`` branches on a registered mechanism's name: such a
    name as a string literal may name a mechanism to build (a config default, a spec list, a
    peer's matching spec), but is never an operand of a comparison (``==``, ``!=``, ``in``,
    ``not in``), an element of a literal collection so compared, a ``match`` case, or a key of a
    dict literal (a per-name table). Mechanisms expose what others need instead
    (``cost_class``, ``position_structures``, ``length_scaled``, ...).
"""
from __future__ import annotations

import ast
from pathlib import Path

from posattn.mechanisms import names

PACKAGE = Path(__file__).resolve().parents[2] / "posattn"

# (module, literal) pairs that compare a string equal to a mechanism name but mean something else.
ALLOWED_NAME_LITERALS = {
    ("posattn.analysis.hf", "absolute"),  # Hugging Face's position_embedding_type value "absolute"
    ("posattn.analysis.reports", "segment"),  # the structure kind "segment" (Structure.kind), not the mechanism
    # build_tisa_model keeps the input position mechanisms and finds tisa by name (TISA App. C):
    ("posattn.analysis.reports", "absolute"),
    ("posattn.analysis.reports", "sinusoidal"),
    ("posattn.analysis.reports", "tisa"),
}


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:``."""
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        out.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, (path, package) in mods.items():
        here = name.split(".") if package else name.split(".")[:-1]
        deps: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module or ""
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert graph["posattn.attention.fast"] >= {"posattn.attention.flex", "posattn.attention.fold"}
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " ↔ ".join(f"{m} (imports {', '.join(sorted(graph[m] & set(c)))})" for m in c) for c in found)


def test_the_cycle_finder_finds_a_deferred_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def branching_literals(tree: ast.AST, registered: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every registered name used for branching (module docstring, rule b)."""
    hits: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                hits.append(operand)
                if isinstance(operand, (ast.Tuple, ast.List, ast.Set)):
                    hits.extend(operand.elts)
        elif isinstance(node, ast.match_case):
            hits.extend(ast.walk(node.pattern))
        elif isinstance(node, ast.Dict):
            hits.extend(k for k in node.keys if k is not None)
    return sorted({(h.lineno, h.value) for h in hits
                   if isinstance(h, ast.Constant) and isinstance(h.value, str) and h.value in registered})


def test_no_module_outside_mechanisms_branches_on_a_mechanism_name() -> None:
    registered = set(names())
    found = []
    for name, (path, _) in sorted(modules().items()):
        if name.startswith("posattn.mechanisms"):
            continue
        for line, literal in branching_literals(ast.parse(path.read_text()), registered):
            if (name, literal) not in ALLOWED_NAME_LITERALS:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {literal!r}")
    assert not found, "mechanism names used for branching outside posattn/mechanisms/:\n" + "\n".join(found)


def test_the_name_rule_sees_each_branching_form() -> None:
    source = '''
if m.name == "tisa": pass
if name in ("rope", "other"): pass
TABLE = {"t5": 1.6}
match m.name:
    case "alibi": pass
DEFAULT = ["absolute"]
'''
    got = sorted(literal for _, literal in branching_literals(ast.parse(source), set(names())))
    assert got == ["alibi", "rope", "t5", "tisa"]
