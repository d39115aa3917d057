"""No remote control by accident: with the plugin fully enabled, no HTTP request can change clocks.

The plugin exposes no write route at all (and has no setting that would add one): everything it adds
to vLLM's API server is read-only (``/metrics`` series, per-request energy on GET). The probe builds
vLLM's real FastAPI app the way ``vllm serve`` does, stock and with every plugin feature on, and
compares them route by route and request by request.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

PROBE = r"""
import importlib, json, sys, types, warnings
warnings.simplefilter("ignore")
import vllm_powersave
from vllm_powersave import vllm_compat
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from starlette.testclient import TestClient

# The API server's module is imported before vLLM builds its config (as under `vllm serve`).
mods = [importlib.import_module(m) for m in getattr(vllm_compat, "APP_BUILDERS", ())[:1] if importlib.util.find_spec(m.rsplit(".", 1)[0])]
mod = mods[0] if mods and hasattr(mods[0], "build_app") else importlib.import_module("vllm.entrypoints.launchers.app")
args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "x"])

def routes(app):
    return sorted({(getattr(r, "path", ""), ",".join(sorted(getattr(r, "methods", None) or ["*"]))) for r in app.routes})

WRITES = ["POST", "PUT", "PATCH", "DELETE"]
PATHS = ["/powersave", "/powersave/clocks", "/powersave/clocks/reset", "/powersave/presets", "/powersave/settings",
         "/powersave/requests/x", "/clocks", "/presets", "/v1/powersave/clocks", "/metrics"]

def probe(app):
    c = TestClient(app, raise_server_exceptions=False)
    body = {"sm_clock_mhz": 345, "presets": {"decode": {"sm_clock_mhz": 345}}}
    return {f"{m} {p}": c.request(m, p, json=body, headers={"Authorization": "Bearer x"}).status_code for p in PATHS for m in WRITES}

stock = mod.build_app(args)
stock_routes, stock_status = routes(stock), probe(stock)

vllm_powersave.register()
settings = {"clocks": {"backend": "dry-run", "presets": {"decode": {"sm_clock_mhz": 1200}, "idle": {"sm_clock_mhz": 345}}},
            "per_request_energy": True, "trace_steps": True}
vllm_powersave._on_engine_args(types.SimpleNamespace(additional_config={"powersave": settings}, model="x"))
assert vllm_powersave._STATE["active"]
mine = mod.build_app(args)
print(json.dumps({"module": mod.__name__, "stock_routes": stock_routes, "routes": routes(mine),
                  "stock_status": stock_status, "status": probe(mine)}))
"""


def test_no_write_route_exists_with_every_feature_enabled(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POWERSAVE_", "VLLM_PLUGINS"))}
    env["TMPDIR"] = str(tmp_path)
    p = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    added = set(map(tuple, r["routes"])) - set(map(tuple, r["stock_routes"]))
    # Anything the plugin adds as a route is read-only.
    assert all(set(methods.split(",")) <= {"GET", "HEAD"} for _, methods in added), added
    # No write request reaches a handler: same answer as stock vLLM, and never a success.
    assert r["status"] == r["stock_status"]
    # (stock vLLM's /metrics mount answers every method with the read-only exposition)
    assert all(code in (404, 405) for req, code in r["status"].items() if not req.endswith(" /metrics")), r["status"]


def test_plugin_declares_no_endpoint_plugin_and_no_listener():
    """Static half: the package registers no vLLM endpoint plugin, and opens no listening socket."""
    import importlib.metadata as md

    eps = list(md.distribution("vllm-powersave").entry_points)
    assert {ep.group for ep in eps} <= {"vllm.general_plugins", "console_scripts"}, eps
    src = Path(__file__).parents[1] / "vllm_powersave"
    hits = []
    for f in src.rglob("*.py"):
        text = f.read_text()
        for needle in (
            ".listen(",
            "add_api_route(",
            "APIRouter(",
            "web.Application(",
            "HTTPServer(",
            "start_server(",
            "@app.post",
            "@router.post",
        ):
            if needle in text:
                hits.append((f.name, needle))
    assert hits == []
