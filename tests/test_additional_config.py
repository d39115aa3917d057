"""A malformed ``--additional-config`` stops ``vllm serve`` with one line naming the option and the
value, before anything starts (vLLM alone: an argparse error for ``{...}`` that is not JSON, and a
64-line pydantic traceback for any other string, which it keeps as a string)."""

import subprocess

import pytest

pytest.importorskip("vllm")

from vllm_powersave import vllm_compat  # noqa: E402

BAD = ["{bad", "{bad}", "[1, 2]", '"powersave"', "powersave", "{'powersave': {}}"]


def _parser():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert vllm_compat.guard_additional_config(parser)
    assert not vllm_compat.guard_additional_config(parser)  # once per parser
    return parser


@pytest.mark.parametrize("value", BAD)
def test_malformed_additional_config_is_one_line_and_exit_2(value, capsys):
    parser = _parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--additional-config", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --additional-config ") and repr(value) in err[0], err


@pytest.mark.parametrize(
    "value, want", [('{"powersave": {"clocks": {"backend": "dry-run"}}}', {"powersave": {"clocks": {"backend": "dry-run"}}}), ("{}", {})]
)
def test_valid_additional_config_passes_through_unchanged(value, want):
    assert _parser().parse_args(["--additional-config", value]).additional_config == want


def test_malformed_additional_config_through_vllm_serve_is_one_line(tmp_path):
    """The real CLI (the plugin registered through vLLM's entry point): no traceback, exit 2, the
    one error line last; nothing started (the model directory is not even read)."""
    from vllm_powersave.serving import vllm_command

    p = subprocess.run(
        [*vllm_command(), "serve", str(tmp_path / "no-model"), "--additional-config", "{bad"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout
    errors = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]
    assert errors == [
        "error: --additional-config '{bad': not valid JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)); expected a JSON object such as '{\"powersave\": {...}}'"
    ], p.stderr[-3000:]
    assert p.stderr.splitlines()[-1] == errors[0]
