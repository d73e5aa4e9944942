#!/usr/bin/env bash
# The wheels `python -m benchmarks.gpu` needs on a GPU machine without network, downloaded here into .whl/ at the
# repository root (ignored by git): TRL 1.16.0, DeepSpeed 0.19.6, megatron-core 0.16.1, verl 0.9.1 (one file of it
# is used: realsize loads verl/utils/kernel/fp8_kernel.py by path) and the dependencies of these that a machine with
# torch, triton, transformers, accelerate, numpy and packaging lacks (datasets, dill, multiprocess, hjson, pydantic
# and its helpers, typing_extensions: pydantic 2.14 needs a recent one). Run once, from anywhere, on a machine with
# pip and network (any Python 3; the wheels are for CPython 3.12 on x86-64 Linux):
#
#     bash benchmarks/gpu/wheels.sh
#
# The versions are those of the tests-trl nox session (DeepSpeed: tests-openrlhf's). DeepSpeed publishes only an
# sdist: it is built here into a pure-Python wheel with no C++ op (DS_BUILD_OPS=0); the GPU run uses torch's AdamW,
# so no op is ever JIT-built there. The install line for the GPU machine is in benchmarks/gpu/README.md.
# WHEELS_LIMIT_MIB (default 64): fail when the checkout and the wheels together exceed it, for a copy with a size
# limit (0: no check).
set -euo pipefail

cd "$(dirname "$0")/../.."
DEST=.whl
LIMIT_MIB=${WHEELS_LIMIT_MIB:-64}

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
  echo "wheels.sh: $DEST/ is not ignored by git (expected /.whl/ in .gitignore); refusing to fill it" >&2
  exit 1
fi
rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$DEST" "${PINS[@]}"
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$DEST" "$DEEPSPEED"

# Exactly one wheel per distribution (two versions of one stop the whole install on the GPU machine).
names=$(for f in "$DEST"/*.whl; do basename "$f" | cut -d- -f1 | tr 'A-Z-' 'a-z_'; done | sort)
if [ -n "$(uniq -d <<<"$names")" ]; then
  echo "wheels.sh: more than one wheel of: $(uniq -d <<<"$names" | tr '\n' ' ')" >&2
  exit 1
fi
expected=$(( ${#PINS[@]} + 1 ))
if [ "$(wc -l <<<"$names")" -ne "$expected" ]; then
  echo "wheels.sh: expected $expected wheels, found: $(tr '\n' ' ' <<<"$names")" >&2
  exit 1
fi
if unzip -l "$DEST"/deepspeed-*.whl | grep -q '\.so$'; then
  echo "wheels.sh: the DeepSpeed wheel holds compiled ops; build it with DS_BUILD_OPS=0" >&2
  exit 1
fi

# The GPU machine's install line, tried here when a CPython 3.12 is at hand (it checks the wheels' tags, not imports).
PY312=${PY312:-$(command -v python3.12 || ls /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1 || true)}
if [ -n "$PY312" ] && "$PY312" -m pip --version >/dev/null 2>&1; then
  target=$(mktemp -d)
  "$PY312" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$DEST"/*.whl
  rm -rf "$target"
  echo "wheels.sh: the README's install line installs them under $("$PY312" --version)"
fi

wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null || true) \
        | awk '$2 == "total" {s += $1} END {print s + 0}')
ls -l "$DEST"
echo "wheels.sh: $((wheels / 1024)) KiB of wheels + $((tree / 1024)) KiB of working tree (limit $LIMIT_MIB MiB)"
if [ "$LIMIT_MIB" -gt 0 ] && [ $((wheels + tree)) -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
  echo "wheels.sh: over WHEELS_LIMIT_MIB=$LIMIT_MIB MiB" >&2
  exit 1
fi
