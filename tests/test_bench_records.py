"""``benchmarks/analyze_perf_boost.py``: exclusions (``--invalid``) and the raw files it archives."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import analyze_perf_boost as apb

RAW = ROOT / "docs" / "results" / "raw" / "h200-perf-boost-part1.json.gz"


def _raw() -> dict:
    with gzip.open(RAW, "rt") as f:
        return json.load(f)


def _main(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["analyze_perf_boost.py", *args])
    apb.main()


@pytest.mark.parametrize("spec", [
    "nosuch:0=r",            # unknown tag: the exclusion would match nothing
    "part1:7=r",             # unknown server position
    "part1:0:lo=r",          # unknown item (typo of low)
    "part1:0:wake61=r",      # no such wake probe on that server
    "part1:0:=r",            # empty item list: nothing would be dropped
    "part1:0:low:extra=r",   # a fourth field
    "part1:x=r",             # position not an integer
    "part1=r",               # no position
    "part1:0",               # no reason
    "part1:0=",              # empty reason
])
def test_malformed_or_unmatched_exclusions_are_refused(spec) -> None:
    with pytest.raises(ValueError, match="--invalid"):
        apb.parse_invalid([spec], [_raw()])


def test_exclusions_parse_and_a_server_named_twice_is_refused() -> None:
    raws = [_raw()]
    assert apb.parse_invalid(["part1:0=all: port shared", "part1:1:low,wake10=a=b"], raws) == {
        ("part1", 0): (None, "all: port shared"), ("part1", 1): ({"low", "wake10"}, "a=b")}
    with pytest.raises(ValueError, match="named twice"):
        apb.parse_invalid(["part1:1:low=x", "part1:1:wake10=y"], raws)  # the second would replace the first


def test_raw_inputs_stay_as_measured_and_another_run_never_replaces_an_archived_one(monkeypatch, tmp_path, capsys) -> None:
    src = tmp_path / "in" / RAW.name
    src.parent.mkdir()
    shutil.copy(RAW, src)
    before = src.read_bytes()
    out = tmp_path / "out"
    _main(monkeypatch, str(src), "--out", str(out), "--invalid", "part1:1:low,wake10=test")
    assert src.read_bytes() == before
    archived = out / "raw" / "h200-perf-boost-part1.json.gz"
    with gzip.open(archived, "rt") as f:
        assert json.load(f) == _raw()  # exclusions apply to the report only
    assert json.loads((out / "h200-perf-boost.json").read_text())["excluded"][0]["dropped_windows"] == 1
    # Same input again (what records.sh does with --out docs/results): fine, archive unchanged.
    _main(monkeypatch, str(archived), "--out", str(out))
    # A different run under the same tag must not be reported while the archive keeps the old one.
    other = _raw()
    other["servers"][0]["windows"][0]["output_throughput"] = 1.0
    src2 = tmp_path / "in" / "other.json"
    src2.write_text(json.dumps(other))
    arch = archived.read_bytes()
    with pytest.raises(SystemExit):
        _main(monkeypatch, str(src2), "--out", str(out))
    assert "already holds another run" in capsys.readouterr().err
    assert archived.read_bytes() == arch
    with pytest.raises(SystemExit):  # two inputs with one tag
        _main(monkeypatch, str(src), str(src2), "--out", str(tmp_path / "out2"))
