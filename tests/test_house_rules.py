"""House rules that keep the code a newcomer can change (docs/design.md): short functions, benchmarks
on public seams only, and layering. The runtime and the energy account are the product: they must
not depend on the offline tuner or the model generator; the simulator is a model of a GPU and must
not drive the clock controller (the arrow runs from clocks to sim, never back).

Each check lists every violation. ``PENDING_*`` hold the violations known when the check was added
and still being fixed; a new violation fails, and so does a fixed one left in ``PENDING_*`` (the
sets can only shrink)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_powersave"
#: Longest function (``def`` line to last line, docstring included), in lines.
MAX_FUNCTION_LINES = 80
LENGTH_CHECKED = ("vllm_powersave", "loadtests", "benchmarks")
#: (importing folder, forbidden module prefix): the layering of docs/design.md.
FORBIDDEN_IMPORTS = (
    ("vllm_powersave/runtime", "vllm_powersave.tune"),
    ("vllm_powersave/runtime", "vllm_powersave.modelgen"),
    ("vllm_powersave/energy", "vllm_powersave.tune"),
    ("vllm_powersave/energy", "vllm_powersave.modelgen"),
    ("vllm_powersave/sim", "vllm_powersave.clocks"),
    ("vllm_powersave/runtime", "vllm_powersave.serving_tune"),
    ("vllm_powersave/energy", "vllm_powersave.serving_tune"),
    ("vllm_powersave/clocks", "vllm_powersave.serving_tune"),
)

# Violations still being fixed, as "path:qualified function" and "path -> name" strings. Remove an
# entry once it is fixed (test_pending_violations_still_exist fails until then); never add one.
PENDING_LONG_FUNCTIONS: set[str] = set()  # none left: the energy account passes named records
PENDING_PRIVATE_REACHES: set[str] = set()  # none left: benchmarks/hook_overhead.py uses the runtime's public seams
PENDING_IMPORT_EDGES: set[str] = set()  # none left: runtime/ and energy/ read sim/, and trace replay is in tune/


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _functions(node: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function under ``node`` with its qualified name (``Class.method``, ``outer.inner``)."""
    found = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((prefix + child.name, child))
            found += _functions(child, prefix + child.name + ".")
        elif isinstance(child, ast.ClassDef):
            found += _functions(child, prefix + child.name + ".")
        else:
            found += _functions(child, prefix)
    return found


def long_functions() -> dict[str, int]:
    """``"path:qualified name" -> lines`` of every function over ``MAX_FUNCTION_LINES``."""
    out = {}
    for path in _python_files(*LENGTH_CHECKED):
        for name, fn in _functions(_tree(path)):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out[f"{_rel(path)}:{name}"] = lines
    return out


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """``(module, name)`` pairs an import statement binds, relative imports resolved; ``name`` is
    ``None`` for ``import a.b``, else the imported name (which may be a module)."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names]
    base = node.module or ""
    if node.level:
        package = _module_of(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return [(base, a.name) for a in node.names]


def import_edges(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of the file: ``from a import b`` gives ``a``
    and ``a.b`` (``b`` may be a module)."""
    edges = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for module, name in _imported(path, node):
                edges.add(module)
                if name is not None and name != "*":
                    edges.add(f"{module}.{name}")
    return edges


def forbidden_import_edges() -> set[str]:
    """``"path -> module"`` for every import of a forbidden layer (``FORBIDDEN_IMPORTS``)."""
    out = set()
    for folder, forbidden in FORBIDDEN_IMPORTS:
        for path in _python_files(folder):
            for module in import_edges(path):
                if module == forbidden or module.startswith(forbidden + "."):
                    out.add(f"{_rel(path)} -> {module}")
    # "from a import b" also records "a": keep only the most specific edge of each import.
    return {e for e in out if not any(o != e and o.startswith(e + ".") for o in out)}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(folder: str = "benchmarks") -> set[str]:
    """``"path -> name"`` for every private name a file in ``folder`` takes from the package: one
    it imports (``from vllm_powersave.x import _y``, ``import vllm_powersave._x``), one it reads or
    sets on a package module (``m._y`` after ``import vllm_powersave.x as m``), and one it reaches on
    an object (``rt._stop``), unless on ``self``/``cls``, on a module outside the package or named
    like a function or class of the file itself."""
    out = set()
    for path in _python_files(folder):
        tree, rel = _tree(path), _rel(path)
        bound: dict[str, str | None] = {}  # local name -> the package module it names (None: outside)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for alias, (module, name) in zip(node.names, _imported(path, node)):
                full = module if name is None else f"{module}.{name}"
                if name is None and alias.asname is None:  # "import a.b" binds "a"
                    local = target = full.split(".")[0]
                else:
                    local, target = alias.asname or str(name), full
                in_package = target == PACKAGE or target.startswith(PACKAGE + ".")
                bound[local] = target if in_package else None
                if in_package and any(_is_private(part) for part in full.split(".")):
                    out.add(f"{rel} -> {full}")
        own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)) or node.attr in own:
                continue
            owner = _dotted(node.value) or "<expression>"
            head, _, rest = owner.partition(".")
            if head in ("self", "cls") or (head in bound and bound[head] is None):
                continue
            if head in bound:
                owner = str(bound[head]) + (f".{rest}" if rest else "")
            out.add(f"{rel} -> {owner}.{node.attr}")
    return out


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def test_no_function_is_over_80_lines():
    new = {k: v for k, v in long_functions().items() if k not in PENDING_LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split them into named parts): {new}"


def test_benchmarks_reach_no_private_name_of_the_package():
    new = sorted(private_reaches() - PENDING_PRIVATE_REACHES)
    assert not new, f"benchmarks/ reaches private names of {PACKAGE} (add a public seam): {new}"


def test_runtime_and_energy_import_no_tuner_or_modelgen_and_sim_no_clocks():
    new = sorted(forbidden_import_edges() - PENDING_IMPORT_EDGES)
    assert not new, f"imports against the layering of docs/design.md: {new}"


def test_pending_violations_still_exist():
    fixed = sorted(
        (PENDING_LONG_FUNCTIONS - set(long_functions()))
        | (PENDING_PRIVATE_REACHES - private_reaches())
        | (PENDING_IMPORT_EDGES - forbidden_import_edges())
    )
    assert not fixed, f"fixed: remove from PENDING_* in tests/test_house_rules.py: {fixed}"


def test_the_checks_find_seeded_violations(tmp_path, monkeypatch):
    """The checks read a tree laid out like the repository: each kind of violation is found."""
    import sys

    def write(rel: str, text: str) -> None:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text, encoding="utf-8")

    def lines(n: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    # def line + body: one line over the limit in a method, exactly at it in a function.
    write("vllm_powersave/energy/cost.py", "class A:\n    def long(self):\n" + lines(MAX_FUNCTION_LINES, " " * 8))
    write("vllm_powersave/energy/ok.py", "def fits():\n" + lines(MAX_FUNCTION_LINES - 1, " " * 4))
    write("vllm_powersave/runtime/step.py", "def f():\n    from ..tune.profile import ceilings\n    from .. import modelgen\n")
    write("vllm_powersave/sim/replay.py", "from vllm_powersave.clocks import controller\nimport vllm_powersave.clocks.backends\n")
    write(
        "benchmarks/b.py",
        "import os\nimport vllm_powersave.vllm_compat as vc\nfrom vllm_powersave import runtime\n"
        "from vllm_powersave.runtime.build import _init_nvml\n\n\ndef _mine():\n    pass\n\n\n"
        "def run(rt, self):\n    vc._PATCHED.clear()\n    runtime._RUNTIME = rt\n    rt._stop.set()\n"
        "    os._exit(0)\n    self._x = _mine()\n    runtime.build._POLICY = None\n",
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions() == {"vllm_powersave/energy/cost.py:A.long": MAX_FUNCTION_LINES + 1}
    assert forbidden_import_edges() == {
        "vllm_powersave/runtime/step.py -> vllm_powersave.tune.profile.ceilings",
        "vllm_powersave/runtime/step.py -> vllm_powersave.modelgen",
        "vllm_powersave/sim/replay.py -> vllm_powersave.clocks.controller",
        "vllm_powersave/sim/replay.py -> vllm_powersave.clocks.backends",
    }
    assert private_reaches() == {
        "benchmarks/b.py -> vllm_powersave.runtime.build._init_nvml",
        "benchmarks/b.py -> vllm_powersave.vllm_compat._PATCHED",
        "benchmarks/b.py -> vllm_powersave.runtime._RUNTIME",
        "benchmarks/b.py -> vllm_powersave.runtime.build._POLICY",
        "benchmarks/b.py -> rt._stop",
    }


#: Private-attribute reads in tests/ (``x._name``, not on ``self``/``cls``, not dunder) may not grow
#: back: the redesign halved them (97 counted before it) by giving tests public seams.
MAX_TEST_PRIVATE_READS = 48


def _private_reads(tree: ast.AST) -> int:
    return sum(
        1
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and _is_private(n.attr)
        and n.attr != "_replace"  # NamedTuple's public API
        and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
    )


def test_tests_reach_at_most_half_the_private_names_they_did():
    reads = {_rel(p): k for p in _python_files("tests") if (k := _private_reads(_tree(p)))}
    assert sum(reads.values()) <= MAX_TEST_PRIVATE_READS, sorted(reads.items(), key=lambda kv: -kv[1])
