"""`vllm-powersave compare`: runs spoiled by a busy machine are flagged in the report."""

from vllm_powersave.cli import _suspect_runs


def test_runs_below_half_the_median_throughput_are_flagged():
    runs = {"off (run 1)": {"output_throughput": 59.0}, "on (run 2)": {"output_throughput": 47.0},
            "on (run 3)": {"output_throughput": 52.0}, "off (run 4)": {"output_throughput": 13.7}}
    flagged = _suspect_runs(runs)
    assert list(flagged) == ["off (run 4)"] and abs(flagged["off (run 4)"] - 13.7 / 49.5) < 1e-9
    assert _suspect_runs({k: v for k, v in runs.items() if k != "off (run 4)"}) == {}
    assert _suspect_runs({"a": {"output_throughput": 1.0}, "b": {"output_throughput": 100.0}}) == {}  # two runs: no median to trust
