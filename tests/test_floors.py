"""The house in floors: a lower floor never imports a higher one, and no import circles.

Reads every project module's imports with ``ast`` (module-level and inside functions) and
fails naming the offending file and the imported name. The floors, bottom up, are in the
docs/reference.md ("Where things live").
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("audit", "attacks", "adaptive", "defenses", "priors", "generators", "bench")

# floor -> the floors its modules may import (besides the standard library and third parties)
ALLOWED = {
    "audit.core": {"audit.core"},
    "audit.report": {"audit.core", "audit.report"},
    "audit.client": {"audit.core", "audit.client"},
    "defenses": {"audit.core", "defenses"},
    "generators": {"audit.core", "generators"},
    "priors": {"audit.core", "generators", "priors"},
    "attacks": {"audit.core", "audit.client", "generators", "priors", "attacks"},
    "adaptive": {"audit.core", "audit.client", "generators", "priors", "attacks", "adaptive"},
    "audit.engine": {"audit.core", "audit.client", "audit.report", "defenses", "generators", "priors",
                     "attacks", "adaptive", "audit.engine", "audit"},
    "audit": {"audit", "audit.core", "audit.engine"},  # the package door: the version, `audit.run` (lazily)
    # FL frameworks driving the engine from inside a federation (optional extras; only cli.py imports them)
    "audit.integrations": {"audit.core", "audit.report", "defenses", "attacks", "adaptive", "audit.engine",
                           "audit.integrations"},
    "cli": {"audit.core", "audit.client", "audit.report", "defenses", "generators", "priors", "attacks",
            "adaptive", "audit.engine", "audit", "audit.integrations"},
    # the benchmarks, run on purpose: above every floor (checked for circles like the rest)
    "bench": {"audit.core", "audit.client", "audit.report", "defenses", "generators", "priors", "attacks",
              "adaptive", "audit.engine", "audit", "audit.integrations", "cli", "bench"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules():
    files = [ROOT / "cli.py"] + [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return {module_name(p): p for p in files}


def floor_of(module: str) -> str:
    for floor in sorted(ALLOWED, key=len, reverse=True):
        if module == floor or module.startswith(floor + "."):
            return floor
    raise AssertionError(f"{module} is on no floor; add it to ALLOWED in tests/test_floors.py")


def imports_of(module: str, path: Path, known):
    """(imported project module, line) for every import statement in the file."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import submodule` imports the submodule; `from mod import name`, the module
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.append((name, node.lineno))
    return out


def test_no_floor_imports_a_higher_floor():
    modules = project_modules()
    bad = []
    for module, path in modules.items():
        floor = floor_of(module)
        for target, line in imports_of(module, path, modules):
            if floor_of(target) not in ALLOWED[floor]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} "
                           f"(floor {floor} may import {sorted(ALLOWED[floor])})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_no_import_circles():
    modules = project_modules()
    graph = {m: sorted({t for t, _ in imports_of(m, p, modules)}) for m, p in modules.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    described = [" <-> ".join(c) + " (" + "; ".join(
        f"{modules[a].relative_to(ROOT)} imports {b}" for a in c for b in graph[a] if b in c) + ")"
        for c in circles]
    assert not circles, "import circles:\n" + "\n".join(described)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The rules are not vacuous: a core module importing the engine is reported."""
    fake = tmp_path / "audit" / "core" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from audit.engine.audit import run\n")
    known = {"audit.core.x": fake, "audit.engine.audit": fake}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert imports_of("audit.core.x", fake, known) == [("audit.engine.audit", 1)]
        assert floor_of("audit.engine.audit") not in ALLOWED[floor_of("audit.core.x")]
    finally:
        ROOT = saved
