"""Device-job plumbing: the dry-run guard, logging, records and JSON written to disk, the model bundle.

Every script that runs on a lent GPU calls :func:`require_dry_run` first: clocks and power limits
are never changed on a shared GPU, and the plugin runs its clock controller in dry-run there.
This module stays importable without the plugin (``h200_defaults.py`` imports it before
``--plugin-site`` is on ``sys.path``), hence the variable's name is spelled here too.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

ENV_FORCE_DRY_RUN = "POWERSAVE_FORCE_DRY_RUN"  # vllm_powersave.envs.ENV_FORCE_DRY_RUN
T0 = time.monotonic()


def require_dry_run(env: dict[str, str] | None = None) -> None:
    """Refuse to start (one line on stderr, exit status 2) unless ``POWERSAVE_FORCE_DRY_RUN=1``."""
    if (os.environ if env is None else env).get(ENV_FORCE_DRY_RUN) == "1":
        return
    print(f"error: refusing to run: {ENV_FORCE_DRY_RUN}=1 must be set on a shared GPU", file=sys.stderr)
    raise SystemExit(2)


def log(*a: object, tag: str = "run") -> None:
    print(f"[{tag} +{time.monotonic() - T0:6.1f}s]", *a, flush=True)


def write_json_atomic(path: Path, obj: object, indent: int | None = None) -> None:
    """Write through a temporary file: a job killed mid-write (the call's time limit) leaves the previous, complete file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    tmp.replace(path)


def write_record(out: Path, name: str, rec: dict, md: str, keep_from: str | None = None) -> None:
    """``out/NAME.json`` and its Markdown twin ``out/NAME.md``; with ``keep_from`` (a heading), the
    twin's hand-written part from that heading on survives a rerun."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
    twin = out / f"{name}.md"
    kept = twin.read_text().partition(keep_from)[1:] if keep_from and twin.exists() else ()
    twin.write_text(md + "".join(kept))


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def make_model(shape: str, shapes_dir: Path, tok_dir: Path, root: Path = Path("/tmp/models")) -> Path:
    """A model directory for ``--load-format dummy``: the shape's config.json and the tokenizer files."""
    d = root / shape
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(shapes_dir / f"{shape}.json", d / "config.json")
    for f in (f for f in tok_dir.iterdir() if f.is_file() and f.name != "config.json"):
        shutil.copy(f, d / f.name)
    return d
