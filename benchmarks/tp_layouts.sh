#!/usr/bin/env bash
# Issue 15: tensor and pipeline parallelism against data parallelism at the same global batch, on this
# machine's CPUs over Gloo: a Llama of 4 blocks x 256 (8 heads, 4 key/value heads, SwiGLU 768), 128 tokens,
# global batch 16, fp32, 30 steps; steady-state step time, phase shares and (pipelines) the measured bubble
# against (p - 1)/(m + p - 1) from each run's summary.json. ONLY=name,name runs some of the layouts.
#   bash benchmarks/tp_layouts.sh [OUT_DIR]
set -eu
OUT=${1:-/tmp/tp-layouts}; mkdir -p "$OUT"
MODEL="--model.n_layer=4 --model.n_embd=256 --model.n_head=8 --model.n_kv_head=4 --model.ffn_hidden=768"
COMMON="llama-tiny $MODEL --data.seq_len=128 --train.global_batch=16 --train.max_steps=30 --log.every=10 \
  --train.eval_batches=1 --train.progress=false --checkpoint.every=1000"
run() {  # name, nproc, per-rank batch, flags
  [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",$1,"* ]] || return 0
  OMP_NUM_THREADS=1 python -m scaletrain train $COMMON --nproc "$2" --data.batch_size="$3" ${4:-} \
    --run.dir="$OUT/$1" > "$OUT/$1.txt" 2>&1 || { tail -3 "$OUT/$1.txt"; return 1; }
  python -c "import json,sys; s=json.load(open(sys.argv[1])); b=s['bottleneck']; p=s.get('pipeline'); print(f\"{sys.argv[2]:<10} {1000 * s['global_batch'] / s['samples_per_s']:7.1f} ms/step  loss {s['train_loss']:.4f}  {b['evidence']}\" + (f\"  bubble {100 * p['bubble']:.1f}% (formula {100 * p['bubble_formula']:.1f}%)\" if p else ''))" \
    "$OUT/$1/summary.json" "$1"
}
run one 1 16
run ddp2 2 8
run tp2 2 16 --parallel.tp=2
run fsdp2 2 8 --parallel.strategy=fsdp
run ddp4 4 4
run fsdp4 4 4 --parallel.strategy=fsdp
run fsdp2xtp2 4 8 "--parallel.strategy=fsdp --parallel.tp=2"
run pp2 2 16 --parallel.pp=2
run pp2m8 2 16 "--parallel.pp=2 --parallel.microbatches=8"
run pp2gpipe 2 16 "--parallel.pp=2 --parallel.pp_schedule=gpipe"
run pp2i 2 16 "--parallel.pp=2 --parallel.pp_schedule=interleaved"
run pp2im8 2 16 "--parallel.pp=2 --parallel.pp_schedule=interleaved --parallel.microbatches=8"
run pp4m8 4 16 "--parallel.pp=4 --parallel.microbatches=8"
run pp2xdp2 4 8 --parallel.pp=2
