"""The reference docs follow the code: settings.md is generated from the pydantic model, metrics.md
names every series of the collector's family table with its type, labels and unit, and the README
stays a short page whose links resolve."""

import re
from pathlib import Path

from pydantic import BaseModel, Field

from vllm_powersave.metrics import FAMILIES, FamilySpec
from vllm_powersave.settings_doc import COMMAND, field_paths, render

ROOT = Path(__file__).resolve().parents[1]


def test_settings_doc_is_regenerated_from_the_settings_model():
    committed = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    assert committed == render(), f"docs/settings.md is out of date with vllm_powersave/settings.py: run `{COMMAND}`"


def test_settings_doc_names_every_field_with_its_dotted_path():
    text = render()
    missing = [p for p in field_paths() if f"- **`{p}`**" not in text]
    assert not missing
    assert "clocks.presets.<phase>.groups.<group>.duration_ms" in field_paths()
    assert "chunking.table[].min_rows" in field_paths()


def test_settings_doc_states_type_default_bounds_unit_and_description():
    line = next(ln for ln in render().splitlines() if ln.startswith("- **`clocks.min_dwell_ms`**"))
    assert line == "- **`clocks.min_dwell_ms`**: float; default `500`; bounds ≥ 0, ≤ 600000, finite; unit ms.  "
    text = render()
    assert "Minimum time a clock stays applied before another change (hysteresis), in ms." in text
    assert '- **`clocks.backend`**: `"auto"` | `"dry-run"` | `"nvml"` | `"zeusd"` | `"simulated"`' in text


class _Inner(BaseModel):
    """Inner object."""

    #: Rows of the thing.
    size_rows: int = Field(default=3, ge=1)


class _NewSettings(BaseModel):
    """Settings with a field added later."""

    #: How long to wait before giving up,
    #: in milliseconds.
    patience_ms: float = Field(default=250.0, gt=0.0, le=1000.0, allow_inf_nan=False)
    inner: _Inner = Field(default_factory=_Inner)
    flag: bool = False  # a trailing comment describes it
    items: tuple[_Inner, ...] = ()


def test_settings_doc_picks_up_a_new_field_its_comment_bounds_and_nested_model():
    text = render(_NewSettings)
    assert (
        "- **`patience_ms`**: float; default `250`; bounds > 0, ≤ 1000, finite; unit ms.  \n"
        "  How long to wait before giving up, in milliseconds." in text
    )
    assert "- **`flag`**: bool; default `false`.  \n  a trailing comment describes it" in text
    assert "## `inner`" in text and "- **`inner.size_rows`**: int; default `3`; bounds ≥ 1; unit rows." in text
    assert "## `items[]`" in text and "- **`items[].size_rows`**" in text
    assert field_paths(_NewSettings) == ["patience_ms", "inner", "inner.size_rows", "flag", "items", "items[].size_rows"]


def _doc_series_rows() -> dict[str, tuple[str, tuple[str, ...], str]]:
    """docs/metrics.md's series table: exposed name -> (type, labels, unit)."""
    doc = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    rows = {}
    for line in doc.splitlines():
        m = re.match(r"\| `(powersave_[a-z_]+)` \| (\w+) \| ([^|]*) \| ([^|]*) \|", line)
        if m:
            rows[m[1]] = (m[2], tuple(re.findall(r"`([a-z_]+)`", m[3])), m[4].strip())
    return rows


def _exposed_name(spec: FamilySpec) -> str:
    return spec.name + ("_total" if spec.type == "counter" else "")


def test_metrics_doc_describes_every_exported_series():
    rows = _doc_series_rows()
    assert len(FAMILIES) >= 25  # the collector's family table
    missing = sorted(_exposed_name(f) for f in FAMILIES if _exposed_name(f) not in rows)
    assert not missing, f"series exported by vllm_powersave/metrics.py but not described in docs/metrics.md: {missing}"
    extra = sorted(set(rows) - {_exposed_name(f) for f in FAMILIES})
    assert not extra, f"docs/metrics.md describes series the collector does not export: {extra}"


def test_metrics_doc_states_each_series_type_labels_and_unit_as_the_family_table():
    rows = _doc_series_rows()
    wrong = {
        _exposed_name(f): (rows[_exposed_name(f)], (f.type, f.labels, f.unit))
        for f in FAMILIES
        if _exposed_name(f) in rows and rows[_exposed_name(f)] != (f.type, f.labels, f.unit)
    }
    assert not wrong, f"docs/metrics.md (type, labels, unit) differ from vllm_powersave/metrics.py FAMILIES: {wrong}"


def test_metrics_family_table_names_each_family_once_with_its_prefix():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"powersave_[a-z_]+", n) and f.type in ("counter", "gauge") for n, f in zip(names, FAMILIES))


def test_readme_is_at_most_150_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; reference material belongs in docs/"


def test_relative_links_in_readme_and_docs_point_at_files():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "#", "mailto:")):
                continue
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken
