#!/usr/bin/env bash
# The quick tier of the suite against another torch release than the one CI uses (2.13.0): a
# venv of its own with that torch, readfence installed editable from this checkout, SGLang and
# triton as CI installs them, then `pytest -m "not slow"`.
#
#   bash scripts/torch_version_check.sh 2.15.0            # the venv in /tmp/readfence-torch-2.15.0
#   VENV=/somewhere bash scripts/torch_version_check.sh 2.15.0
#
# torch from PyPI is a CUDA build (several GB; it runs on a machine without a GPU). Where pip is
# capped by a constraint file (PIP_CONSTRAINT, a pip.conf), the run sets PIP_CONFIG_FILE=/dev/null
# so that the release asked for is the one installed. The tested releases are listed in
# docs/development.md.
set -euo pipefail
version=${1:?usage: scripts/torch_version_check.sh TORCH_VERSION}
cd "$(dirname "$0")/.."
venv=${VENV:-/tmp/readfence-torch-$version}
export PIP_CONFIG_FILE=/dev/null
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q "torch==$version"
"$venv/bin/python" -m pip install -q --no-deps -r tests/engine/sglang-requirements.txt
"$venv/bin/python" -m pip install -q -e '.[test]'
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
"$venv/bin/python" -m pytest -q -n 2 -m "not slow" -p no:cacheprovider
