#!/usr/bin/env bash
# On the GPU machine: per-kernel GPU time of an idle decode step (8B shape, graphs off)
# for stock and for the given idle_variants.py variants, with Inductor's generated code kept, so
# that the add + RMSNorm kernels two site forms fuse into can be timed and read side by side
# (with the config Triton's autotuner chose for each kernel: its .best_config files).
# Usage: bash experiments/codegen_diff.sh OUT BATCH VARIANT[:unfused]...   (writes OUT/compare.txt, OUT/code.tar.gz)
set -u
out=$1; batch=$2; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out/runs"
(cd "$root/benchmarks" && python -u launches.py --out "$out/runs" --shape 8b --batch "$batch" \
    --engine stock > "$out/stock.log" 2>&1)
for variant in "$@"; do  # NAME, or NAME:unfused (engine option fused_norms false)
    flags=(--variant "${variant%:unfused}")
    [[ $variant == *:unfused ]] && flags+=(--unfused-norm)
    python -u "$root/experiments/idle_variants.py" --out "$out/runs" "${flags[@]}" --batch "$batch" \
        --code "$out/code" > "$out/${variant/:/-}.log" 2>&1
done
(cd "$root/benchmarks" && python launches.py --compare "$out/runs" > "$out/compare.txt" 2>&1)
(cd "$out" && find code -name '*.py' -o -name '*.best_config' | tar czf code.tar.gz -T - && rm -rf code)
(cd "$out" && tar czf runs.tar.gz runs && rm -rf runs)
