# Sourced by the device commands after install.sh: this tree's glm5_fp4 first, then what install.sh put on /tmp/site.
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
# Many servers compile at once on 16 cores: one Inductor compile worker each instead of one per core.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
