# Sourced by background jobs (benchmarks/device_bg.sh) that want Marlin beside our kernel: waits, at most
# WAIT_VLLM seconds (default 600), for install.sh's marker while the pieces still arrive, then sources env.sh;
# without the marker the job goes on with no Marlin, and says so.
_end=$((SECONDS + ${WAIT_VLLM:-600}))
while [ ! -f /tmp/site/.glm5_fp4_installed ] && [ $SECONDS -lt $_end ]; do sleep 5; done
if [ -f /tmp/site/.glm5_fp4_installed ]; then . "$(dirname "${BASH_SOURCE[0]}")/env.sh"; else echo "vLLM not installed: no Marlin"; fi
unset _end
