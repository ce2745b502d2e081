#!/bin/bash
# Qwen3-VL-8B fine-tuning in MindSpeed-MM with mindspeed-flow on (Ascend NPUs).
#
# The job is MindSpeed-MM's examples/qwen3vl/finetune_qwen3vl_8B.sh at commit
# 57069cd55a8ab16d5affe379a2e2c5f0a4d962b9 (the pinned upstream, see ../shared/upstream):
# `pretrain_transformers.py CONFIG.yaml` with its YAML, examples/qwen3vl/qwen3vl_full_sft_8B.yaml
# (FSDP2 from examples/qwen3vl/fsdp2_config.yaml, torch_dcp checkpoints), unchanged, plus the
# plugin: the job starts through `-m mindspeed_flow.launch` and passes --use-flowtrain.
#
# How the flags reach the plugin on this path: pretrain_transformers.py first runs
# mindspeed_mm/configs/read_yaml_config.py, which rebuilds the command line from the YAML's
# gpt_args alone and drops every word after the YAML. The plugin reads its own flags
# (--use-flowtrain, --no-flow-X, --flow-module-lr ...) before that, so they go after the YAML
# here, or in MINDSPEED_FLOW_FLAGS; in the YAML they do not work (Megatron refuses them).
# Upstream's own settings (the distributed backend included: upstream's script passes
# --distributed-backend nccl after the YAML, which the reader drops) belong in the YAML.
# On this path --use-flowtrain runs packing, conv_matmul (the ViT's patch embedding as a
# matmul; the HF checkpoint loads and saves unconverted), recipes and system; the features
# that need Megatron's pipeline (schedule, pool, allocator) and fused_attn are off, each named
# in the job's feature log line (docs/qwen3vl.md).
#
# Run it from the MindSpeed-MM root, after upstream's own set-up (CANN, MindSpeed, the HF
# checkpoint in ckpt/hf_path/Qwen3-VL-8B-Instruct, the data the YAML names) and
# `pip install <mindspeed-flow checkout>`:
#     cd MindSpeed-MM && bash <mindspeed-flow>/scripts/mindspeed_mm/finetune_qwen3vl_8b_flowtrain.sh
# Check it against your MindSpeed-MM / MindSpeed before you book the machine (reads source and
# the YAML, imports nothing):
#     mindspeed-flow doctor --src MindSpeed-MM --src MindSpeed \
#         --launch-script <mindspeed-flow>/scripts/mindspeed_mm/finetune_qwen3vl_8b_flowtrain.sh
set -eo pipefail

if [ ! -f pretrain_transformers.py ]; then
    echo "run this from the MindSpeed-MM root (no pretrain_transformers.py in $PWD)" >&2
    exit 2
fi

# Ascend toolkit and runtime settings of the upstream example (ASCEND_HOME: the install root).
ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}
source "$ASCEND_HOME/cann/set_env.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=2   # FSDP2 refuses 1
export ASCEND_SLOG_PRINT_TO_STDOUT=0
export ASCEND_GLOBAL_LOG_LEVEL=3
export TASK_QUEUE_ENABLE=2
export COMBINED_ENABLE=1
export CPU_AFFINITY_CONF=1
export HCCL_CONNECT_TIMEOUT=1200
export NPU_ASD_ENABLE=0
export ASCEND_LAUNCH_BLOCKING=0
export ACLNN_CACHE_LIMIT=100000
export TOKENIZERS_PARALLELISM=false
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export MULTI_STREAM_MEMORY_REUSE=1

NPUS_PER_NODE=8
MASTER_ADDR=localhost
MASTER_PORT=6000
NNODES=1
NODE_RANK=0

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

# Model, data, parallelism and training settings: all in the YAML.
CONFIG=examples/qwen3vl/qwen3vl_full_sft_8B.yaml

# The plugin's switches (after the YAML; see above). Examples: --no-flow-packing keeps
# MindSpeed-MM's own data path; the recipe freezes the ViT and its mergers (freeze: true in the
# YAML) - with them trainable, --flow-module-lr model.model.visual=0.1 gives the ViT a tenth of
# the LR, --flow-module-grad-clip model.model.visual=1.0 clips its gradient on its own.
FLOW_ARGS="
    --use-flowtrain
"

mkdir -p logs
LOG=logs/train_flowtrain_$(date +%Y%m%d_%H%M%S).log
torchrun $DISTRIBUTED_ARGS -m mindspeed_flow.launch pretrain_transformers.py $CONFIG \
    $FLOW_ARGS \
    2>&1 | tee "$LOG"
