#!/usr/bin/env bash
# The one install command:  bash scripts/install.sh
#
# Creates .venv (unless one is active), installs torch (the CPU wheel
# torch==2.13.0 unless a torch is already importable: an unpinned torch pulls
# several GB of CUDA packages), then fedaccel with its test extra, installs
# the federation profiles of flower.toml into $FLWR_HOME/config.toml, and
# makes the venv export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 so the
# local SuperLink started by `flwr run` does not `uv sync` the dependencies
# (torch from scratch) for every run. Fashion-MNIST comes from Debian's
# dataset-fashion-mnist package and the browser tests' chromium when apt is usable (set FEDACCEL_SKIP_APT=1
# to skip); everything else the default experiment needs is generated.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -d .venv ] || "${PYTHON:-python3}" -m venv .venv
    # shellcheck disable=SC1091
    . .venv/bin/activate
fi
python -m pip install --quiet --upgrade pip
if python -c "import torch" 2>/dev/null; then
    echo "[install] using the installed torch $(python -c 'import torch; print(torch.__version__)')"
else
    echo "[install] installing torch==2.13.0"
    python -m pip install --quiet "torch==2.13.0"
fi
echo "[install] installing fedaccel and its dependencies"
python -m pip install --quiet -e ".[dev]"  # dev includes the dashboard and tracker extras
fedaccel-federations install

activate="$VIRTUAL_ENV/bin/activate"
if ! grep -q FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION "$activate"; then
    printf '\n# added by fedaccel scripts/install.sh\nexport FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1\n' >> "$activate"
fi

fmnist=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ ! -f "$fmnist" ] && [ -z "${FEDACCEL_SKIP_APT:-}" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[install] installing Debian's dataset-fashion-mnist"
    (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
        || echo "[install] warning: could not install dataset-fashion-mnist; Fashion-MNIST runs need data-dir"
fi
# the dashboard's browser tests drive Debian's chromium with its chromium-driver (no browser download)
if ! command -v chromedriver >/dev/null && [ -z "${FEDACCEL_SKIP_APT:-}" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[install] installing Debian's chromium and chromium-driver (dashboard browser tests)"
    (apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null) \
        || echo "[install] warning: could not install chromium; the dashboard's browser tests will be skipped"
fi
echo "[install] done. Activate with: source $VIRTUAL_ENV/bin/activate"
