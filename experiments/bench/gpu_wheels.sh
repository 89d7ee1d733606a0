#!/usr/bin/env bash
# Downloads into .whl/ (at the repository root, git-ignored) the wheels that the GPU
# machine's image lacks, for Python 3.12 on manylinux x86-64, pinned to requirements.lock:
#
#   datasets      research/data.py tokenizes the training text with it (imported lazily,
#                 but the training command and tests/test_data*.py need it)
#   dill, multiprocess   datasets' own needs that the image does not have
#   fsspec        datasets caps it (<=2026.9.0) and the image's version is not known
#
# wandb is not needed: the suite trains with --wandb disabled and wandb is imported only
# for an enabled run. Everything else the repository imports is in the image (torch,
# triton, numpy, pyarrow, pandas, xxhash, huggingface-hub, tokenizers, transformers,
# einops, safetensors, matplotlib, pyyaml, pytest, pytest-timeout).
#
#   bash experiments/bench/gpu_wheels.sh          # here, once (needs pip and PyPI)
#
# then, through the device tool, carrying .whl (docs/benchmarks.md, "GPU suite"):
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
#   PYTHONUNBUFFERED=1 python3 -m experiments.bench.gpu_suite
set -euo pipefail

cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
PACKAGES=(datasets dill multiprocess fsspec)

pins=()
for name in "${PACKAGES[@]}"; do
    pin=$(grep -i "^${name}==" requirements.lock) || { echo "$name is not pinned in requirements.lock" >&2; exit 1; }
    pins+=("$pin")
done

rm -rf .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
ls -l .whl
du -sh .whl
