#!/usr/bin/env bash
# Device calls of improvements/20, 22 and 24 (run on an H100 on 2026-12-06, commands and results there): opt-in forms of
# T <= 4 against the default (FORMS), their GPU gates (TESTS_K), the align probe, ncu per kernel, stall reasons at T=1
# and stall samples per SASS instruction. (improvements/22's runs used x_natural_job.sh of 1bb0455 / 596034b, whose
# steps are these.)
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh ab      # same-run A/B, TP8 T = 2-4 then TP4 and EP8-sized
#                                                                # whole experts (AB1_TOKENS=none: TP8 only)
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh sweep   # around dedup_by_arrival: GEMM2 splits, GEMM1 split-K
#                                                                # (SWEEP_FORM ("default": the default plan),
#                                                                # SWEEP_TOKENS, SWEEP_ONLY, SWEEP_SHARDS,
#                                                                # SWEEP_ROUTINGS, SWEEP_LAYERS)
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh floor   # benchmarks/small_t_floor.py: T <= 2's bytes read by
#                                                                # one launch, by two, with today's round trips
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh table   # moe_kernel.py table, TP8 T = 1-16, 3 routings
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh tests   # tests/gpu: the new forms, slot dedup, fused reduce
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh sanitize
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh ncu     # per-kernel durations, TP8 T=4 (NCU_TOKENS;
#                                                                # default, each form)
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh probe   # benchmarks/align_probe.py, TP8 T = 64-1024
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh stalls1 # ncu stall reasons per issued instruction, TP8 T=1
#                                                                # (goal 4's other half: 17.8 us against 12)
#   OUT=dir bash benchmarks/h200/small_t_two_launch_job.sh source  # ncu --set full, then its SASS source page (stall
#                                                                # samples per instruction), TP8 at SOURCE_TOKENS (1)
# carry [".whl"] (pydantic for glm5_fp4.hardware: benchmarks/gpu_deps.sh); pass GLM5_FP4_GIT_SHA.
set -u
. benchmarks/h200/job_steps.sh || exit 2
FORMS=${FORMS:-dedup_by_arrival,per_slot_split}
for s in "$@"; do
  case $s in
    ab)
      ab_step small_t_tp8 "${T_AB:-240}" tp8 "${AB_TOKENS:-2,3,4}" "${AB_ROUTINGS:-balanced,same_k,zipf1.2}" 4
      [ "${AB1_TOKENS:-}" = none ] || ab_step small_t_tp4_tp1 "${T_AB1:-240}" "${AB1_SHARDS:-tp4,tp1}" \
        "${AB1_TOKENS:-2,4}" "${AB1_ROUTINGS:-balanced,same_k}" 2 ;;
    sweep)
      form=${SWEEP_FORM:-dedup_by_arrival}
      for sh in ${SWEEP_SHARDS:-tp8}; do for r in ${SWEEP_ROUTINGS:-balanced}; do
        GREP="precompiled|best|rror" step "sweep_small_t_${sh}_$r" "${T_SWEEP:-240}" python3 benchmarks/moe_kernel.py \
          --sweep --shards "$sh" --tokens "${SWEEP_TOKENS:-3,4}" --layers "${SWEEP_LAYERS:-4}" --sweep-routing "$r" \
          $([ "$form" = default ] || echo "--form $form") --only "${SWEEP_ONLY:-^g2 n|^splitK}" --precompile 14 \
          --json "$OUT/sweep_small_t_${sh}_$r.json"
      done; done ;;
    floor)
      GREP="T=|rror" step small_t_floor "${T_FLOOR:-180}" python3 benchmarks/small_t_floor.py \
        --tokens "${FLOOR_TOKENS:-1,2}" --json "$OUT/small_t_floor.json" ;;
    table)
      GREP="precompiled|T=|rror" step table_small_t "${T_TABLE:-300}" python3 benchmarks/moe_kernel.py --shards tp8 \
        --tokens "${TABLE_TOKENS:-1,2,3,4,8,16}" --routings balanced,same_k,zipf1.2 --layers 4 --no-marlin \
        --precompile 14 --json "$OUT/table_small_t.json" --md "$OUT/table_small_t.md" ;;
    tests)
      step tests_small_t "${T_TESTS:-300}" python3 -m pytest tests/gpu/test_moe_kernel_gpu.py -q -rA -p no:cacheprovider \
        -k "${TESTS_K:-dedup_by_arrival or slot_dedup or fused_split_k or gemm2_split_slots or x_in_natural_order}" ;;
    sanitize) sanitize_steps ;;
    ncu)
      for t in ${NCU_TOKENS:-4}; do for f in default ${FORMS//,/ }; do
        form=$([ "$f" = default ] || echo "--form $f")
        GREP="rror" step "ncu_tp8_t${t}_$f" "${T_NCU:-90}" ncu --clock-control none --profile-from-start off --csv \
          --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread \
          python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens "$t" $form
        cp "$L/ncu_tp8_t${t}_$f.log" "$OUT/ncu_tp8_t${t}_$f.csv"
      done; done ;;
    stalls1)
      GREP="rror" step ncu_stalls_tp8_t1 "${T_NCU:-120}" ncu --clock-control none --profile-from-start off --csv \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__warps_active.avg.per_cycle_active,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,launch__grid_size,launch__registers_per_thread" \
        python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens 1
      cp "$L/ncu_stalls_tp8_t1.log" "$OUT/ncu_stalls_tp8_t1.csv" ;;
    source)
      for t in ${SOURCE_TOKENS:-1}; do
        GREP="rror" step "ncu_rep_tp8_t$t" "${T_NCU:-240}" ncu --clock-control none --profile-from-start off --set full \
          -f -o "/tmp/ncu_tp8_t$t" python3 benchmarks/ncu_moe_call.py --shard tp8 --tokens "$t"
        GREP="rror" step "ncu_source_tp8_t$t" 120 ncu --import "/tmp/ncu_tp8_t$t.ncu-rep" --page source --csv \
          --print-source sass
        gzip -c "$L/ncu_source_tp8_t$t.log" > "$OUT/ncu_source_tp8_t$t.csv.gz"
        GREP="rror" step "ncu_details_tp8_t$t" 120 ncu --import "/tmp/ncu_tp8_t$t.ncu-rep" --page details --csv
        gzip -c "$L/ncu_details_tp8_t$t.log" > "$OUT/ncu_details_tp8_t$t.csv.gz"
      done ;;
    probe)
      GREP="T=|rror" step align_probe "${T_PROBE:-120}" python3 benchmarks/align_probe.py --shard tp8 \
        --tokens "${PROBE_TOKENS:-64,256,512,1024}" --json "$OUT/align_probe.json" ;;
  esac
done
