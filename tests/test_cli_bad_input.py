"""`vllm-powersave tune` and `reset-clocks` with bad input: one line on stderr naming the option
(or file and field) and the value, exit status 2, and nothing created or reset on the way."""

from __future__ import annotations

import json
import sys

import pytest

from vllm_powersave.cli import main
from vllm_powersave.modelgen import SHAPES


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def config(tmp_path, text: str):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--slowdown", "nan"], ["--slowdown", "nan"]),
        (["--slowdown", "-5"], ["--slowdown", "-5"]),
        (["--slowdown", "101"], ["--slowdown", "101"]),
        (["--slowdown", "abc"], ["--slowdown", "'abc'"]),
        (["--only", "both"], ["--only", "'both'"]),
        (["--only", ""], ["--only", "''"]),
        (["--phases", "decode,warmup"], ["--phases", "warmup"]),
        (["--phases", ","], ["--phases"]),
        (["--tp", "0"], ["--tp", "0"]),
        (["--tp", "3"], ["tp = 3", "num_attention_heads"]),
        (["--sim-noise", "inf"], ["--sim-noise", "inf"]),
        (["--window", "0"], ["--window", "0"]),
        (["--sweep-window", "nan"], ["--sweep-window", "nan"]),
        (["--thermal-warmup", "-1"], ["--thermal-warmup", "-1"]),
        (["--warmup", "nan"], ["--warmup", "nan"]),
        (["--rows", "abc"], ["--rows", "'abc'"]),
        (["--rows", "64:prefill"], ["--rows", "prefill"]),
        (["--chunks", "0,2"], ["--chunks", "'0,2'"]),
        (["--repeats", "0"], ["--repeats", "0"]),
        (["--sweep-points", "1"], ["--sweep-points", "1"]),
        (["--device", "tpu"], ["--device", "'tpu'"]),
    ],
)
def test_tune_bad_options(tiny_config, tmp_path, capsys, args, needles):
    out_dir = tmp_path / "out"
    rc, _, err = run(["tune", str(tiny_config), "--out", str(out_dir), "--no-progress", *args], capsys)
    line = one_line(err)
    assert rc == 2 and all(n in line for n in needles), line
    assert not out_dir.exists()  # nothing written, nothing half-created


@pytest.mark.parametrize(
    "make,needles",
    [
        (lambda t: t / "does-not-exist", ["no config.json"]),
        (lambda t: config(t, "[]"), ["config.json", "JSON object"]),
        (lambda t: config(t, "null"), ["config.json", "JSON object"]),
        (lambda t: config(t, '{"text_config": 5}'), ["text_config", "JSON object"]),
        (lambda t: config(t, "{not json"), ["cannot read config.json"]),
        (lambda t: config(t, '{"hidden_size": true, "num_attention_heads": 4}'), ["hidden_size", "True"]),
        (
            lambda t: config(
                t, json.dumps({**{k: v for k, v in SHAPES["qwen2-tiny"].items() if not k.startswith("_")}, "num_key_value_heads": "two"})
            ),
            ["num_key_value_heads", "'two'"],
        ),
    ],
)
def test_tune_bad_model_dirs(tmp_path, capsys, make, needles):
    out_dir = tmp_path / "out"
    rc, _, err = run(["tune", str(make(tmp_path)), "--out", str(out_dir), "--no-progress"], capsys)
    line = one_line(err)
    assert rc == 2 and all(n in line for n in needles), line
    assert not out_dir.exists()


def test_tune_out_that_is_a_file_or_under_one(tiny_config, tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("keep me")
    for out in (f, f / "sub"):
        rc, _, err = run(["tune", str(tiny_config), "--out", str(out), "--no-progress"], capsys)
        line = one_line(err)
        assert rc == 2 and "--out" in line and str(out) in line, line
    assert f.read_text() == "keep me"


def test_reset_clocks_bad_lease_dir_and_garbage_leases(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from fakes import FakeNvml

    f = tmp_path / "a-file"
    f.write_text("")
    rc, _, err = run(["reset-clocks", "--lease-dir", str(f)], capsys)
    assert rc == 2 and "--lease-dir" in one_line(err) and str(f) in err

    rc, out, _ = run(["reset-clocks", "--lease-dir", str(tmp_path / "typo")], capsys)
    assert rc == 0 and "no lease directory" in out and "typo" in out

    d = tmp_path / "leases"
    d.mkdir()
    (d / "GPU-z1.json").write_text(json.dumps({"gpu": "GPU-z1", "pid": 0, "backend": "zeusd", "gpu_index": 0}))
    (d / "GPU-z2.json").write_text(json.dumps({"gpu": "GPU-z2", "pid": 0, "backend": "zeusd", "socket": "/s", "gpu_index": "x"}))
    (d / "GPU-z3.json").write_text(json.dumps({"gpu": "GPU-z3", "pid": 0, "backend": "zeusd", "socket": "/s", "gpu_index": True}))
    rc, out, err = run(["reset-clocks", "--lease-dir", str(d)], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 3 and out == ""
    assert "GPU-z1.json" in lines[0] and "'socket' = None" in lines[0]
    assert "GPU-z2.json" in lines[1] and "'gpu_index' = 'x'" in lines[1]
    assert "GPU-z3.json" in lines[2] and "'gpu_index' = True" in lines[2]
    assert sorted(p.name for p in d.glob("*.json")) == ["GPU-z1.json", "GPU-z2.json", "GPU-z3.json"]  # kept

    # Unreadable leases of the nvml kind still get a reset (the GPU may be locked) and are removed.
    for p in d.glob("*.json"):
        p.unlink()
    gpu = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", gpu)
    (d / "GPU-c1.json").write_text("{garbage")
    (d / "GPU-c2.json").write_text(json.dumps({"gpu": "GPU-c2", "pid": "not a pid"}))
    rc, out, err = run(["reset-clocks", "--lease-dir", str(d)], capsys)
    assert rc == 0 and err == "" and "reset clocks of GPU-c1" in out and "reset clocks of GPU-c2" in out
    assert list(d.glob("*.json")) == []
