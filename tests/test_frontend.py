"""The API-server pool: ``api_server_count: auto`` sizes ``vllm serve``'s front end where the user
did not, leaves it alone where vLLM refuses several API servers, and says so in the start line."""

import logging

import pytest

from vllm_powersave import frontend
from vllm_powersave.frontend import FrontendChoice, ServeFacts, choose, usable_cores
from vllm_powersave.settings import SettingsError, load_settings


def test_auto_on_a_16_core_gpu_host_runs_four_api_servers_per_engine():
    c = choose("auto", ServeFacts(api_server_count=None), cores=16, on_gpu=True)
    assert (c.count, c.changed) == (4, True) and "16 usable cores" in c.reason and "h200-under-load" in c.reason


@pytest.mark.parametrize(
    ("facts", "cores", "want"),
    [
        (ServeFacts(None, data_parallel_size=2), 16, 8),  # 4 per engine
        (ServeFacts(None, data_parallel_size=4), 16, 12),  # 16 cores - 4 engine processes
        (ServeFacts(None, data_parallel_size=2, data_parallel_size_local=1), 16, 4),  # this node's ranks only
        (ServeFacts(None, workers_per_engine=3), 16, 4),  # TP=2: EngineCore + 2 workers
        (ServeFacts(None), 3, 2),  # 3 cores: one for the engine, two API servers
        (ServeFacts(None, workers_per_engine=9), 10, None),  # TP=8 on 10 cores: no core to spare
        (ServeFacts(None), 2, None),  # 2 cores: one engine, one API server, as vLLM does
    ],
)
def test_auto_never_takes_the_cores_the_engines_need_nor_goes_below_vllm(facts, cores, want):
    c = choose("auto", facts, cores=cores, on_gpu=True)
    assert c.count == want and c.changed is (want is not None)
    if want is None:
        assert "usable cores" in c.reason


@pytest.mark.parametrize(
    ("setting", "facts", "on_gpu", "why"),
    [
        ("auto", ServeFacts(api_server_count=1), True, "--api-server-count 1 given"),
        (8, ServeFacts(api_server_count=2), True, "--api-server-count 2 given"),
        ("vllm", ServeFacts(None), True, "api_server_count: vllm"),
        ("auto", ServeFacts(None), False, "no GPU"),
        ("auto", ServeFacts(None, refusal="--headless runs no API server"), True, "--headless"),
        (6, ServeFacts(None, refusal="elastic EP supports one API server"), True, "elastic EP"),
    ],
)
def test_vllms_choice_stays_where_the_user_or_vllm_decided(setting, facts, on_gpu, why):
    c = choose(setting, facts, cores=64, on_gpu=on_gpu)
    assert c == FrontendChoice(None, False, c.reason) and why in c.reason
    assert c.describe().startswith("front end vLLM's choice (")


def test_an_explicit_count_setting_applies_even_without_a_gpu():
    assert choose(3, ServeFacts(None), cores=2, on_gpu=False) == FrontendChoice(3, True, "api_server_count setting")


def test_usable_cores_reads_affinity_and_a_cgroup_quota(tmp_path):
    assert usable_cores(set(range(16)), tmp_path) == 16  # no cpu.max: affinity alone
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert usable_cores(set(range(16)), tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(set(range(16)), tmp_path) == 16
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert usable_cores({0, 1, 2}, tmp_path) == 3


@pytest.mark.parametrize(("value", "want"), [(0, "= 0:"), (65, "= 65:"), ("many", "= 'many':"), (True, "= True:"), (2.5, "= 2.5:")])
def test_a_bad_api_server_count_is_one_line_naming_field_and_value(value, want):
    with pytest.raises(SettingsError) as err:
        load_settings({"api_server_count": value})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("powersave setting 'api_server_count' ") and want in msg


def test_savings_off_keeps_vllms_count_and_rejects_a_contradicting_one():
    assert load_settings({"savings": "off"}).api_server_count == "vllm"
    with pytest.raises(SettingsError, match="api_server_count 4 conflicts with savings 'off'"):
        load_settings({"savings": "off", "api_server_count": 4})


# ---- through vLLM's own `vllm serve` parser and dispatch (0.32, CPU build) -------------------
vllm = pytest.importorskip("vllm")


@pytest.fixture
def serve(monkeypatch):
    """``vllm serve ARGS`` parsed by vLLM's parser with the plugin registered, dispatched to
    recorders instead of servers; returns the API-server count vLLM would start."""
    import vllm_powersave
    from vllm_powersave import vllm_compat

    monkeypatch.setattr(vllm_compat, "_PATCHED", set())
    monkeypatch.setattr(vllm_compat, "_INSTALLED", set())
    monkeypatch.setattr(vllm_compat, "CLI_STATE", {"parser_built": False, "on_serve_args": None})
    monkeypatch.setattr(vllm_powersave, "_STATE", {"registered": False, "active": True, "frontend": None})
    monkeypatch.delenv("POWERSAVE_ENABLED", raising=False)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli import serve as serve_mod

    monkeypatch.setattr(EngineArgs, "add_cli_args", vars(EngineArgs)["add_cli_args"])
    monkeypatch.setattr(serve_mod.ServeSubcommand, "cmd", vars(serve_mod.ServeSubcommand)["cmd"])
    ran: list = []
    monkeypatch.setattr(serve_mod, "run_multi_api_server", lambda args: ran.append(args.api_server_count))
    monkeypatch.setattr(serve_mod, "run_server", lambda args: ran.append(1))
    monkeypatch.setattr(serve_mod.uvloop, "run", lambda coro: coro)
    vllm_powersave.register()

    def run(argv: list[str], gpu: bool = True) -> int:
        monkeypatch.setattr(vllm_powersave, "_server_facts", lambda a, s: {"gpu_name": "NVIDIA H200" if gpu else None})
        monkeypatch.setattr(frontend, "usable_cores", lambda: 16)
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        sub = FlexibleArgumentParser().add_subparsers(dest="subparser")
        cmd = serve_mod.ServeSubcommand()
        parser = cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd) or sub.choices["serve"]
        args = parser.parse_args(argv)
        args.dispatch_function(args)
        return ran.pop()

    return run


def test_vllm_serve_with_the_plugin_starts_four_api_servers_on_a_gpu_host(serve, caplog):
    assert serve(["/tmp/m", "--plugin", "powersave"]) == 4


@pytest.mark.parametrize(
    ("argv", "gpu"),
    [
        (["/tmp/m"], True),  # plugin not enabled: stock vLLM
        (["/tmp/m", "--plugin", "powersave", "--api-server-count", "1"], True),
        (["/tmp/m", "--plugin", "powersave", "--additional-config", '{"powersave": {"savings": "off"}}'], True),
        (["/tmp/m", "--plugin", "powersave", "--additional-config", '{"powersave": {"api_server_count": "vllm"}}'], True),
        (["/tmp/m", "--plugin", "powersave"], False),
    ],
)
def test_vllm_serve_keeps_one_api_server_where_it_should(serve, argv, gpu):
    assert serve(argv, gpu=gpu) == 1


def test_vllm_serve_headless_with_the_plugin_stays_headless(serve, monkeypatch):
    from vllm.entrypoints.cli import serve as serve_mod

    seen: list = []
    monkeypatch.setattr(serve_mod, "run_headless", lambda args: seen.append(args.api_server_count))
    with pytest.raises(IndexError):  # neither run_server nor run_multi_api_server ran
        serve(["/tmp/m", "--plugin", "powersave", "--headless"])
    assert seen == [0]


def test_a_bad_setting_stops_vllm_serve_before_dispatch_with_one_line(serve, capsys):
    with pytest.raises(SystemExit) as exc:
        serve(["/tmp/m", "--plugin", "powersave", "--additional-config", '{"powersave": {"api_server_count": 0}}'])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['error: powersave setting \'api_server_count\' = 0: must be "auto", "vllm" or a count from 1 to 64']


def test_a_fault_in_sizing_leaves_vllms_count_with_one_warning(serve, monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("no /proc")

    monkeypatch.setattr(frontend, "choose", boom)
    with caplog.at_level(logging.WARNING, logger="vllm.powersave"):
        assert serve(["/tmp/m", "--plugin", "powersave"]) == 1
    msgs = [r.getMessage() for r in caplog.records if r.name == "vllm.powersave" and r.levelno >= logging.WARNING]
    assert len(msgs) == 1 and "API-server pool sizing failed (no /proc)" in msgs[0]


def test_the_start_line_names_the_pool_and_its_basis():
    from vllm_powersave.savings import startup_line

    line = startup_line(load_settings({"clocks": {"backend": "dry-run"}}), False, {}, frontend=choose("auto", ServeFacts(None), 16, True))
    assert line.endswith("; front end 4 API servers (auto: 16 usable cores, 1 engine; " + frontend.BASIS + ")")
