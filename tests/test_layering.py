"""The package's import layering: no import cycle between modules and no upward import.

Every module of longctx is parsed with `ast` (every import, also those inside functions: a lazy import
is still a dependency), relative imports are resolved, and each import between two longctx modules is
checked against RANKS: a module may import from its own package and from packages of a lower rank,
never from a higher one. Two packages of the same rank may import each other's modules as long as no
cycle forms. Run it as a script to print the table:

    python tests/test_layering.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "longctx"

# The rank of each top-level part of longctx: low ranks are imported by high ones, never the other way.
RANKS = {
    "errors": 0,        # UserError and its subclasses: everything may raise them
    "ops": 1,           # kernels and their torch twins, on tensors only
    "config": 2,        # typed settings; torch-free
    "data": 2,          # corpora and tokenizers; config reads a tokenizer's vocabulary size and the task's
                        # question kinds, data reads no config (SAME_RANK_ONE_WAY)
    "layers": 3,        # nn.Modules over ops, built from a ModelConfig
    "model": 4,
    "kernels": 4,       # which op implementation each layer runs
    "hf_interop": 4,
    "checkpoint": 4,
    "generate": 4,
    "devices": 4,       # the device and dtype a run's settings name
    "memory": 5,        # memory plans applied around the model, and the byte model that picks them
    "distributed": 5,   # parallelism applied around the model
    "measure": 6,       # meters and peak timelines over models, plans and steps
    "train": 7,
    "cli": 8,
    "__init__": 9,
    "__main__": 9,
}


def module_name(path: Path, root: Path | None = None) -> str:
    parts = list(path.relative_to(root or ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported longctx module, line) for every import in the file, relative ones resolved. `from a
    import b` names the module a.b when there is one, else a."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in dict.fromkeys(targets):
            while t and t not in known and "." in t:  # `import longctx.ops.x.y` with y a name, not a module
                t = t.rsplit(".", 1)[0]
            if t in known and t != name:
                out.append((t, node.lineno))
    return out


def part(name: str) -> str:
    """The top-level part of longctx a module belongs to: longctx.ops.kda.naive -> ops."""
    bits = name.split(".")
    return bits[1] if len(bits) > 1 else "__init__"


def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def file_of(m: str) -> str:
    """longctx.memory.plan -> longctx/memory/plan.py (or .../__init__.py for a package)."""
    p = ROOT / Path(*m.split("."))
    return str((p / "__init__.py" if p.is_dir() else p.with_suffix(".py")).relative_to(ROOT))


def where(g, a: str, b: str) -> str:
    line = next(ln for t, ln in g[a] if t == b)
    return f"{file_of(a)}:{line}"


def upward_imports(g) -> list[str]:
    bad = []
    for m, deps in g.items():
        pm = part(m)
        if pm not in RANKS:
            bad.append(f"{file_of(m)}: {PACKAGE}.{pm} has no rank; add it to RANKS in tests/test_layering.py")
            continue
        for t, line in deps:
            pt = part(t)
            if pt != pm and pt in RANKS and RANKS[pt] > RANKS[pm]:
                bad.append(f"{file_of(m)}:{line}: {m} imports {t}, an upward import "
                           f"({pm} has rank {RANKS[pm]}, {pt} rank {RANKS[pt]}); move the code it needs down to "
                           f"{pm}'s level or below")
    return bad


def cycles(g) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a list of modules."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w, _ in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return out


def describe_cycle(g, comp: list[str]) -> str:
    """One loop through the component, each step as `file:line`."""
    inside = set(comp)
    path, seen, v = [comp[0]], {comp[0]}, comp[0]
    while True:
        nxt = next(t for t, _ in g[v] if t in inside)
        nxt = next((t for t, _ in g[v] if t in inside and t not in seen), nxt)
        path.append(nxt)
        if nxt in seen:
            break
        seen.add(nxt)
        v = nxt
    start = path.index(path[-1])
    loop = path[start:]
    steps = [f"{a} -> {b} ({where(g, a, b)})" for a, b in zip(loop, loop[1:])]
    return "import cycle: " + "; ".join(steps) + "; move the shared code into the lower module"


def test_no_import_cycles():
    g = graph()
    found = [describe_cycle(g, c) for c in cycles(g)]
    assert not found, "\n".join(found)


def test_no_upward_imports():
    bad = upward_imports(graph())
    assert not bad, "\n".join(bad)


# Parts of one rank where only one may import the other: (importer, imported).
SAME_RANK_ONE_WAY = [("config", "data")]


def test_same_rank_parts_import_one_way():
    g = graph()
    bad = [f"{m}:{line} imports {t}" for a, b in SAME_RANK_ONE_WAY for m, deps in g.items() if part(m) == b
           for t, line in deps if part(t) == a]
    assert not bad, "\n".join(bad)


def test_every_part_of_the_package_has_a_rank():
    parts = {part(m) for m in modules()}
    assert parts <= set(RANKS), f"give these a rank in RANKS: {sorted(parts - set(RANKS))}"


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    """A function-level `from ..train import x` inside longctx/memory is found and resolved."""
    pkg = tmp_path / PACKAGE
    (pkg / "memory").mkdir(parents=True)
    (pkg / "train").mkdir()
    for f in ("__init__.py", "memory/__init__.py", "train/__init__.py", "train/trainer.py"):
        (pkg / f).write_text("")
    (pkg / "memory" / "plan.py").write_text("def f():\n    from ..train.trainer import resolve\n    from . import other\n")
    (pkg / "memory" / "other.py").write_text("")
    known = {module_name(p, tmp_path): p for p in pkg.rglob("*.py")}
    got = imports("longctx.memory.plan", pkg / "memory" / "plan.py", known)
    assert got == [("longctx.train.trainer", 2), ("longctx.memory.other", 3)], got


def main() -> int:
    g = graph()
    by_rank: dict[int, list[str]] = {}
    for p, r in RANKS.items():
        by_rank.setdefault(r, []).append(p)
    print("rank  may import ranks <= itself")
    for r in sorted(by_rank):
        print(f"{r:>4}  {', '.join(by_rank[r])}")
    n_edges = sum(len(v) for v in g.values())
    print(f"{len(g)} modules, {n_edges} imports between them")
    problems = upward_imports(g) + [describe_cycle(g, c) for c in cycles(g)]
    for p in problems:
        print(p)
    if problems:
        return 1
    print("no cycles, no upward imports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
