#!/bin/bash
# Nsight Compute's per-instruction view of the decode kernel as engines launch it (8B gate_up, tiled weights,
# `throughput_options`) at M = 16 and 64: warp-stall samples by SASS instruction (SourceCounters), to locate
# where the main loop waits (the decode's ALU chain, the ring's cp.async waits, the LDS of the staged
# activations, the MMAs). From the repository root on the device (`bash bench/h200.sh ncu_mma_source`): the
# reports ($OUT/ncu_source_mM.ncu-rep) and their source pages as CSV ($OUT/ncu_source_mM.csv).
set -u
: "${OUT:?set OUT to the results folder}"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for m in 16 64; do
    "$ncu" --clock-control none -k w4a16_mma -c 1 --section SourceCounters --section WarpStateStats \
        -f -o "$OUT/ncu_source_m$m" python3 bench/profile_mma.py --m "$m" --launches 1 || exit 1
    "$ncu" --import "$OUT/ncu_source_m$m.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_source_m$m.csv"
done
