"""The record scripts end a raw input that is missing, cut short or of another shape with one line
naming why, not a traceback, and write nothing."""

from __future__ import annotations

import pytest

from benchmarks import h200_decode_pacing_record, h200_defaults_record, h200_tune_serving_record, h200_under_load_record


@pytest.fixture
def bad(tmp_path):
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "cut.json").write_text('{"servers": [')
    return tmp_path


@pytest.mark.parametrize(
    "script, argv, why",
    [
        (h200_under_load_record, ["{d}/empty.json"], "no field 'pairs'"),
        (h200_under_load_record, ["--rates", "L={d}/cut.json"], "not JSON, or cut short"),
        (h200_defaults_record, ["{d}/empty.json", "--lease", "X"], "no field 'servers'"),
        (h200_defaults_record, ["{d}/missing.json"], "FileNotFoundError"),
        (h200_tune_serving_record, ["--load", "rate4={d}"], "FileNotFoundError"),
        (h200_decode_pacing_record, ["{d}", "--device", "D", "--lease", "L"], "FileNotFoundError"),
    ],
)
def test_a_bad_raw_input_ends_with_one_line_and_writes_nothing(bad, capsys, script, argv, why):
    out = bad / "out"
    rc = script.main([a.format(d=bad) for a in argv] + ["--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and why in err[0] and err[0].startswith("error: ")
    assert not out.exists() or not any(out.iterdir())
