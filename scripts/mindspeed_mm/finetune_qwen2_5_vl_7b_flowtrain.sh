#!/bin/bash
# Qwen2.5-VL-7B fine-tuning in MindSpeed-MM with mindspeed-flow on (Ascend NPUs).
#
# The training arguments are those of MindSpeed-MM's examples/qwen2.5vl/finetune_qwen2_5_vl_7b.sh
# at commit 57069cd55a8ab16d5affe379a2e2c5f0a4d962b9 (the pinned upstream, see ../shared/upstream),
# unchanged, plus the plugin: the job starts through `-m mindspeed_flow.launch` and passes
# --use-flowtrain (every feature; turn one off with --no-flow-X, see the README's flag table).
#
# Run it from the MindSpeed-MM root, after upstream's own set-up (CANN, MindSpeed, the
# converted checkpoint in ckpt/mm_path, the data named by data_7b.json) and
# `pip install <mindspeed-flow checkout>`:
#     cd MindSpeed-MM && bash <mindspeed-flow>/scripts/mindspeed_mm/finetune_qwen2_5_vl_7b_flowtrain.sh
# Check it against your MindSpeed-MM / MindSpeed before you book the machine (reads source,
# imports nothing):
#     mindspeed-flow doctor --src MindSpeed-MM --src MindSpeed
set -eo pipefail

if [ ! -f pretrain_vlm.py ]; then
    echo "run this from the MindSpeed-MM root (no pretrain_vlm.py in $PWD)" >&2
    exit 2
fi

# Ascend toolkit and runtime settings of the upstream example (ASCEND_HOME: the install root).
ASCEND_HOME=${ASCEND_HOME:-/usr/local/Ascend}
source "$ASCEND_HOME/cann/set_env.sh"
source "$ASCEND_HOME/nnal/atb/set_env.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron checks it; no effect on an NPU
export ASCEND_SLOG_PRINT_TO_STDOUT=0
export ASCEND_GLOBAL_LOG_LEVEL=3
export TASK_QUEUE_ENABLE=2
export COMBINED_ENABLE=1
export CPU_AFFINITY_CONF=1
export HCCL_CONNECT_TIMEOUT=1200
export NPU_ASD_ENABLE=0
export ASCEND_LAUNCH_BLOCKING=0
export ACLNN_CACHE_LIMIT=100000

NPUS_PER_NODE=8
MASTER_ADDR=localhost
MASTER_PORT=6000
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))

MM_DATA="./examples/qwen2.5vl/data_7b.json"
MM_MODEL="./examples/qwen2.5vl/model_7b.json"
MM_TOOL="./mindspeed_mm/tools/tools.json"
LOAD_PATH="ckpt/mm_path/Qwen2.5-VL-7B-Instruct"
SAVE_PATH="save_dir"
TP=1
PP=2
CP=1
MBS=1
GRAD_ACC_STEP=48
DP=$(($WORLD_SIZE/$TP/$PP/$CP))
GBS=$(($MBS*$GRAD_ACC_STEP*$DP))

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

# Model sizes are in model_7b.json; these are the training settings.
GPT_ARGS="
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --context-parallel-size ${CP} \
    --context-parallel-algo ulysses_cp_algo \
    --micro-batch-size ${MBS} \
    --global-batch-size ${GBS} \
    --tokenizer-type NullTokenizer \
    --vocab-size 152064 \
    --seq-length 1024 \
    --make-vocab-size-divisible-by 1 \
    --normalization RMSNorm \
    --use-fused-rmsnorm \
    --swiglu \
    --use-fused-swiglu \
    --no-masked-softmax-fusion \
    --lr 1.0e-5 \
    --lr-decay-style cosine \
    --weight-decay 0 \
    --train-iters 10000 \
    --lr-warmup-fraction 0.1 \
    --clip-grad 0.0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --seed 42 \
    --bf16 \
    --load $LOAD_PATH \
    --use-flash-attn \
    --variable-seq-lengths \
    --use-distributed-optimizer \
    --no-load-optim \
    --no-load-rng \
    --no-save-optim \
    --no-save-rng \
    --num-workers 8 \
    --distributed-timeout-minutes 20
"

MM_ARGS="
    --mm-data $MM_DATA \
    --mm-model $MM_MODEL \
    --mm-tool $MM_TOOL
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 10000 \
    --eval-interval 10000 \
    --eval-iters 5000 \
    --save $SAVE_PATH \
    --ckpt-format torch \
    --log-tps
"

# The plugin's switches: --use-flowtrain turns on packing, the schedule runtime, the pool,
# fused varlen attention and Conv->Matmul (the allocator too once --flow-allocator-plan names
# a plan made by `mindspeed-flow plan`); --flow-pool-backend picks the pool's store.
FLOW_ARGS="
    --use-flowtrain
"

mkdir -p logs
LOG=logs/train_flowtrain_$(date +%Y%m%d_%H%M%S).log
torchrun $DISTRIBUTED_ARGS -m mindspeed_flow.launch pretrain_vlm.py \
    $GPT_ARGS \
    $MM_ARGS \
    $OUTPUT_ARGS \
    $FLOW_ARGS \
    --distributed-backend nccl \
    2>&1 | tee "$LOG"
