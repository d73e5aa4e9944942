#!/usr/bin/env bash
# Download, here, the wheels that benchmarks/gpu_acceptance.py needs on the device machine (no network there) into
# .whl/ at the repository root: TRL 1.16.0 and DeepSpeed 0.19.6 with what the device image lacks. Run once, from
# anywhere, on a machine with pip and network (any Python 3; the wheels are for the device's CPython 3.12):
#
#     bash benchmarks/gpu_wheels.sh
#
# The device image (the tool library's device KINDS.md) has torch 2.11, triton 3.6, transformers 5.17.0,
# accelerate 1.15.0, huggingface_hub 1.33.0, peft, pandas, pyarrow, numba, einops, msgpack, ninja, psutil, py-cpuinfo,
# nvidia-ml-py, ... but no trl, datasets (dill, multiprocess), deepspeed (hjson, pydantic and its three helpers).
# The versions are those of the tests-trl nox session (the stack the CPU suite runs TRL and DeepSpeed on).
# megatron-core 0.16.1 (needs torch, numpy, packaging: all in the image) for gpu_megatron.py's Megatron worker.
# verl travels for one file only: gpu_real_sizes.py loads verl/utils/kernel/fp8_kernel.py (torch + triton) by path.
# typing_extensions travels too: pydantic 2.14 needs a recent one and the device's version was never read.
# DeepSpeed publishes only an sdist: it is built here into a pure-Python wheel with no C++ op (DS_BUILD_OPS=0);
# the acceptance run uses torch's AdamW ("torch_adam": true), so no op is ever JIT-built on the device.
#
# .whl/ is ignored (.gitignore), so it travels only where a `run` call names it: carry [".whl"]. The exact device
# command is at the top of benchmarks/gpu_acceptance.py and in docs/kernels.md.
set -euo pipefail

cd "$(dirname "$0")/.."
DEST=.whl
LIMIT_MIB=64  # the device tool's limit for the working tree and every carried path together

PINS=(
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  hjson==3.1.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5
  typing_extensions==4.16.0
  verl==0.9.1 megatron-core==0.16.1
)
DEEPSPEED=deepspeed==0.19.6
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

if ! git check-ignore -q "$DEST/x.whl"; then
  echo "gpu_wheels: $DEST/ is not ignored by git (expected /.whl/ in .gitignore); refusing to fill it" >&2
  exit 1
fi
rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" "${PINS[@]}"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$DEST" "$DEEPSPEED"

# Exactly one wheel per distribution (two versions of one stop the whole install on the device).
names=$(for f in "$DEST"/*.whl; do basename "$f" | cut -d- -f1 | tr 'A-Z-' 'a-z_'; done | sort)
if [ -n "$(uniq -d <<<"$names")" ]; then
  echo "gpu_wheels: more than one wheel of: $(uniq -d <<<"$names" | tr '\n' ' ')" >&2
  exit 1
fi
expected=$(( ${#PINS[@]} + 1 ))
if [ "$(wc -l <<<"$names")" -ne "$expected" ]; then
  echo "gpu_wheels: expected $expected wheels, found: $(tr '\n' ' ' <<<"$names")" >&2
  exit 1
fi
if unzip -l "$DEST"/deepspeed-*.whl | grep -q '\.so$'; then
  echo "gpu_wheels: the DeepSpeed wheel holds compiled ops; build it with DS_BUILD_OPS=0" >&2
  exit 1
fi

# The device install line, tried here when a CPython 3.12 is at hand (it checks the wheels' tags, not imports).
PY312=${PY312:-$(command -v python3.12 || ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1 || true)}
if [ -n "$PY312" ] && "$PY312" -m pip --version >/dev/null 2>&1; then
  target=$(mktemp -d)
  "$PY312" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$DEST"/*.whl
  rm -rf "$target"
  echo "gpu_wheels: the device's pip install line installs them under $("$PY312" --version)"
fi

wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null || true) \
        | awk '$2 == "total" {s += $1} END {print s + 0}')
ls -l "$DEST"
echo "gpu_wheels: $((wheels / 1024)) KiB of wheels + $((tree / 1024)) KiB of working tree (limit $LIMIT_MIB MiB)"
if [ $((wheels + tree)) -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "gpu_wheels: over the device tool's $LIMIT_MIB MiB" >&2
  exit 1
fi
