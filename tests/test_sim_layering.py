"""Layering (docs/design.md, "Layering"): the simulator sits below clocks/, the runtime below the tuner."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "vllm_powersave"


def _imports(sub: str) -> dict[str, set[str]]:
    """Absolute module names each file under ``vllm_powersave/<sub>`` imports (relative ones resolved)."""
    out: dict[str, set[str]] = {}
    for f in sorted((PKG / sub).rglob("*.py")):
        pkg = ["vllm_powersave", *f.relative_to(PKG).parent.parts]
        names: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = pkg[: len(pkg) - node.level + 1] if node.level else []
                mod = ".".join([*base, node.module] if node.module else base)
                names |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        out[str(f.relative_to(PKG))] = names
    return out


def _reaching(sub: str, prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    bad = {f: sorted(n for n in names if n.startswith(prefixes)) for f, names in _imports(sub).items()}
    return {f: n for f, n in bad.items() if n}


def test_the_simulator_imports_nothing_from_clocks():
    assert _reaching("sim", ("vllm_powersave.clocks",)) == {}


def test_the_runtime_and_the_energy_account_import_neither_the_tuner_nor_the_model_generator():
    for sub in ("runtime", "energy"):
        assert _reaching(sub, ("vllm_powersave.tune", "vllm_powersave.modelgen")) == {}, sub


def test_the_check_sees_relative_imports():
    assert "vllm_powersave.sim.gpu" in _imports("energy")["energy/request_cost.py"]
