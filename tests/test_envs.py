"""envs.py: one table of environment variables, read only through its accessors."""

import re
from pathlib import Path

import pytest

from vllm_powersave import envs

ROOT = Path(__file__).resolve().parents[1]


def test_every_name_constant_has_one_documented_row():
    names = {v for k, v in vars(envs).items() if k.startswith("ENV_") and isinstance(v, str)}
    assert names == set(envs.ENV_VARS)
    assert all(v.doc and v.type for v in envs.ENV_VARS.values())


@pytest.mark.parametrize(("raw", "want"), [(None, False), ("", False), ("0", False), ("1", True), ("false", True), ("yes", True)])
def test_force_dry_run_is_off_only_when_unset_empty_or_zero(raw, want):
    assert envs.force_dry_run({} if raw is None else {envs.ENV_FORCE_DRY_RUN: raw}) is want


@pytest.mark.parametrize(
    ("raw", "want"), [(None, False), ("", False), ("0", False), ("false", False), ("False", False), ("1", True), ("on", True)]
)
def test_enabled_flag_accepts_the_same_off_spellings_as_before(raw, want):
    assert envs.enabled({} if raw is None else {envs.ENV_ENABLE: raw}) is want


def test_values_are_parsed_from_the_given_mapping():
    env = {
        envs.ENV_PERF_BOOST: "1",
        envs.ENV_ZEUSD_TOKEN: "",
        envs.ENV_ZEUSD_SOCK: "/run/zeusd.sock",
        envs.ENV_VLLM_PLUGINS: "a, powersave ,b",
        envs.ENV_RAY_EXTRA_VARS: "X, ,Y",
    }
    assert envs.perf_boost_disabled(env) and not envs.perf_boost_disabled({envs.ENV_PERF_BOOST: "0"})
    assert envs.zeusd_token(env) is None and envs.zeusd_socket(env) == "/run/zeusd.sock"
    assert envs.vllm_plugins(env) == ("a", "powersave", "b") and envs.vllm_plugins({}) == ()
    assert envs.ray_extra_list(envs.ENV_RAY_EXTRA_VARS, env) == ["X", "Y"]
    with pytest.raises(KeyError):
        envs.ray_extra_list("PATH", env)


def test_no_module_reads_the_environment_but_envs():
    """os.environ.get / os.getenv appear only in envs.py (writes for child processes are allowed)."""
    read = re.compile(r"os\.environ\.get\(|os\.getenv\(|environ\[\"")
    offenders = [
        str(p.relative_to(ROOT))
        for d in ("vllm_powersave", "loadtests")
        for p in (ROOT / d).rglob("*.py")
        if p.name != "envs.py" and read.search(p.read_text())
    ]
    assert offenders == []
