#!/usr/bin/env bash
# Runs the labelled exploration protocols of issue #19, one after another, into out/explore/<name>/ (one shared
# warm-start cache). Usage: benchmarks/ab/explore/run_all.sh [name ...]   (default: all, in the order below)
set -uo pipefail
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
FAIRCAST=${FAIRCAST:-.nox/ab/bin/faircast}
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(e3-lr-sweep e1-offpolicy e4-add3 e5-wide e2-lowlr-long e6-cosine e8-init1 e7-offpolicy-fp32)
mkdir -p out/explore/cache
for n in "${names[@]}"; do
  mkdir -p "out/explore/$n"
  [ -e "out/explore/$n/cache" ] || ln -s ../cache "out/explore/$n/cache"
  echo "=== $n $(date -u +%H:%M)"
  "$FAIRCAST" ab --protocol "benchmarks/ab/explore/$n.json" --out "out/explore/$n" > "out/explore/$n/log.txt" 2>&1
  echo "=== $n exit $? $(date -u +%H:%M)"
done
