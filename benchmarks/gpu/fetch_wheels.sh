#!/usr/bin/env bash
# Download, here (where a package registry is reachable), the wheels check.sh installs on the GPU machine, which
# reaches none: this checkout's Transformers with the Hub client and the packages they need that the GPU image lacks,
# for its Python 3.12 (about 15 MiB).
# They land in .whl/ (git-ignored through .git/info/exclude); name .whl in the device run's carry list.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
for name in transformers huggingface_hub kernels httpx2 httpcore2 truststore tomlkit; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$name==$(version "$name")"
done
ls -la .whl
