#!/usr/bin/env bash
# On the GPU machine: per-kernel GPU time of an idle decode step (8B shape, graphs off)
# for stock and for the given idle_variants.py variants, with Inductor's generated code kept, so
# that the add + RMSNorm kernels two site forms fuse into can be timed and read side by side
# (with the config Triton's autotuner chose for each kernel: its .best_config files). Each
# variant's log holds --trace-realize's lines (the values Inductor stored, and why).
# Usage: bash experiments/codegen_diff.sh OUT BATCH VARIANT[:unfused][:looped][:KEY=VALUE]...
#   (unfused: engine option fused_norms false; looped: idle_variants.py --looped-sites;
#   KEY=VALUE: an Inductor setting for that engine)
#   Variants run first, stock last; writes OUT/compare.txt, OUT/code.tar.gz, OUT/logs.tar.gz.
set -u
out=$1; batch=$2; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out/runs" "$out/logs"
for spec in "$@"; do
    IFS=: read -r -a parts <<< "$spec"
    flags=(--variant "${parts[0]}" --trace-realize)
    settings=()
    for part in "${parts[@]:1}"; do
        case $part in
            unfused) flags+=(--unfused-norm) ;;
            looped) flags+=(--looped-sites) ;;
            *) settings+=("$part") ;;
        esac
    done
    (( ${#settings[@]} )) && flags+=(--inductor "${settings[@]}")
    python -u "$root/experiments/idle_variants.py" --out "$out/runs" "${flags[@]}" --batch "$batch" \
        --code "$out/code" > "$out/logs/${spec//[:=]/-}.log" 2>&1
done
(cd "$root/benchmarks" && python -u launches.py --out "$out/runs" --shape 8b --batch "$batch" \
    --engine stock > "$out/logs/stock.log" 2>&1)
(cd "$root/benchmarks" && python launches.py --compare "$out/runs" > "$out/compare.txt" 2>&1)
(cd "$out" && tar czf logs.tar.gz logs runs && rm -rf logs runs)
(cd "$out" && find code -name '*.py' -o -name '*.best_config' | tar czf code.tar.gz -T - && rm -rf code)
