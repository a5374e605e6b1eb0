#!/usr/bin/env bash
# The GPU checks of one lent-GPU session, in priority order, each with its own time limit, results under $OUT.
# Run on the device machine from the repository root: PYTHONPATH=src (tomli_w carried in .h4carry).
# A device call runs at most 600 s and a session has 15 minutes of device time (the start included), so pick:
# `RUNS="64 default" bash benchmarks/gpu_session.sh 1 8 12 9` took 440 s on an H200 and `ROUNDS=2 ... 11` 180 s
# more on the same warm machine (RESULTS.md 5e); the rest: `... 2 3 4 5`, `... 10`, `... 6 7` (no arguments:
# every step but 12 and 13, the attention kernels and torch.compile's modes, which are named alone). Not yet run:
# `bash benchmarks/gpu_session.sh 13` (compile modes, about 3 x 2-4 min with max-autotune's tuning: alone in a call).
set -u
export PYTHONPATH=src:.h4carry PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
STEPS=" ${*:-1 2 3 4 5 8 9 10 11 6 7} "
on() { [[ $STEPS == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
GPT124="--model.n_layer=12 --model.n_head=12 --model.n_embd=768 --model.vocab_size=50304 --data.seq_len=1024"
OFF="--model.loss=split --model.residual=fp32"  # the speed keys off (auto is on, on a GPU)
ON="--model.bias=false --model.loss=fused --model.residual=bf16"
if on 1; then
echo "== 1. the GPU path of the trainer (tests/unit/test_cuda.py: digits fp32, bf16-mixed, fp16-mixed; a session under fp16-mixed)"
timeout 120 python -m pytest -q -p no:cacheprovider tests/unit/test_cuda.py 2>&1 | tail -4 | tee "$OUT/test_cuda.txt"
fi
if on 2; then
echo "== 2. throughput cpu vs cuda (the lecture's table)"
timeout 70 python -m scaletrain bench throughput --recipe digits --devices cpu,cuda --batch-sizes 2,4,64 \
  --steps 20 --repeats 3 --json "$OUT/throughput_digits.json" 2>&1 | tail -12
fi
if on 3; then
echo "== 3. gpt-stdlib on one GPU, bf16-mixed: MFU and phase times from CUDA events"
timeout 60 python -m scaletrain train gpt-stdlib --train.max_steps=150 --train.precision=bf16-mixed \
  --data.batch_size=64 --log.every=25 --train.eval_batches=2 --train.progress=false --run.dir="$OUT/gpt" 2>&1 | tail -22
fi
if on 4; then
echo "== 4. verify-resume on the GPU"
timeout 75 python -m scaletrain verify-resume digits --steps 30 --at 13 --device=cuda --model.dropout=0.1 2>&1 | tail -3
fi
if on 5; then
echo "== 5. the bottleneck verdict on a GPU: the small GPTs of steps 3 and 5 are host-bound (the GPU waits for"
echo "   Python: next to nothing queued at log steps), the GPT at GPT-2-124M shape is compute-bound"
timeout 60 python -m scaletrain train gpt-stdlib --train.max_steps=200 --model.n_layer=1 --model.n_embd=32 \
  --model.n_head=2 --data.batch_size=4 --log.every=20 --train.eval_batches=1 --train.progress=false \
  --run.dir="$OUT/tiny" > /dev/null 2>&1
timeout 90 python -m scaletrain train gpt-stdlib --model.n_layer=12 --model.n_head=12 --model.n_embd=768 \
  --data.seq_len=1024 --data.batch_size=16 --train.precision=bf16-mixed --train.max_steps=60 --log.every=20 \
  --train.eval_batches=1 --train.progress=false --run.dir="$OUT/big" > /dev/null 2>&1
for run in gpt tiny big; do
  python -c "import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], s['mfu'], s['bottleneck']['verdict'])" \
    "$OUT/$run/summary.json" "$run"
  # plan vs actual (issue 14: peak memory and step time within 10%): planned, measured, error per quantity
  python -c "import json,sys; p=json.load(open(sys.argv[1]))['plan_vs_actual']; print(sys.argv[2], 'plan vs actual', p['predicted'], p['actual'], p['error'])" \
    "$OUT/$run/summary.json" "$run"
  grep -o '"gpu_lead_s": \[[^]]*\]' "$OUT/$run/metrics.jsonl" | tail -2
done
fi
if on 6; then
echo "== 6. MFU of the GPT at 124M (issue 4, target 50%): as it was, and the best settings so far (RESULTS 5b)"
for flags in "" "--residual bf16 --loss fused --batch-size 128"; do
  timeout 120 python benchmarks/gpu_mfu.py --shape 124m --no-bias --steps 30 --warmup 5 $flags 2>&1 | grep -A1 "^124m"
done
fi
if on 7; then
echo "== 7. the attention kernels not yet compared side by side at 124M (cuDNN's backward is 16% of a step):"
echo "   FlashAttention-2 and memory-efficient through SDPA, with the best settings of step 6 (its second row: cuDNN)"
for sdpa in flash efficient; do
  timeout 120 python benchmarks/gpu_mfu.py --shape 124m --no-bias --steps 30 --warmup 5 --residual bf16 --loss fused \
    --batch-size 128 --sdpa $sdpa 2>&1 | grep -A1 "^124m"
done
fi
if on 8; then
echo "== 8. issue 14: the trainer at GPT-2 124M (vocab 50304, seq 1024, bf16, compiled: the whole model and the loss"
echo "   one graph), its speed keys off and on, beside gpu_mfu.py (a minimal hand-written loop of the same model) at"
echo "   the same batch and flags, in one call: steady-state tokens/s, MFU, peak memory, plan vs actual, goodput"
IFS=, read -ra RUNS <<< "${RUNS:-16 off,16 default,16 on,64 on}"  # RUNS="64 default" bash ... 8: those alone
for run in "${RUNS[@]}"; do  # default: auto (fused loss, bf16 residual on a GPU), biases
  set -- $run; name=keys-$2-b$1; keys=$([ "$2" = on ] && echo "$ON"; [ "$2" = off ] && echo "$OFF")
  timeout 200 python -m scaletrain train gpt-stdlib $GPT124 --data.batch_size=$1 --train.precision=bf16-mixed \
    --train.compile=true --train.max_steps=120 --log.every=20 --train.eval_batches=1 --train.progress=false \
    --run.dir="/tmp/$name" $keys > "/tmp/$name.txt" 2>&1 || tail -5 "/tmp/$name.txt"
  python benchmarks/summary_line.py "/tmp/$name/summary.json" "$name"
  if [ "$2" = on ]; then
    timeout 120 python benchmarks/gpu_mfu.py --shape 124m --no-bias --steps 30 --warmup 5 --residual bf16 --loss fused \
      --batch-size $1 2>&1 | grep -A1 "^124m"
  fi
done
fi
if on 12; then
echo "== 12. issue 14: the attention kernel through the trainer (--train.attention; auto = PyTorch's choice, cuDNN's on"
echo "   Hopper, whose backward was 16% of a 124M step in RESULTS 5b): GPT-2 124M, batch 16, the trainer's defaults"
for attention in auto flash efficient; do
  name=att-$attention
  timeout 150 python -m scaletrain train gpt-stdlib $GPT124 --data.batch_size=16 --train.precision=bf16-mixed \
    --train.compile=true --train.max_steps=120 --log.every=20 --train.eval_batches=1 --train.progress=false \
    --train.attention=$attention --run.dir="/tmp/$name" > "/tmp/$name.txt" 2>&1 || tail -5 "/tmp/$name.txt"
  python benchmarks/summary_line.py "/tmp/$name/summary.json" "$name"
done
fi
if on 13; then
echo "== 13. issue 14: torch.compile's mode through the trainer (--train.compile_mode): default, max-autotune-no-cudagraphs"
echo "   (matmul and kernel autotuning), reduce-overhead (CUDA graphs), at GPT-2 124M, batch ${BATCH:-64}, the trainer's defaults"
for mode in ${MODES:-default reduce-overhead max-autotune-no-cudagraphs}; do  # the long tuning last
  name=mode-$mode
  timeout 330 python -m scaletrain train gpt-stdlib $GPT124 --data.batch_size=${BATCH:-64} --train.precision=bf16-mixed \
    --train.compile=true --train.compile_mode=$mode --train.max_steps=120 --log.every=20 --train.eval_batches=1 \
    --train.progress=false --run.dir="/tmp/$name" > "/tmp/$name.txt" 2>&1 || tail -5 "/tmp/$name.txt"
  python benchmarks/summary_line.py "/tmp/$name/summary.json" "$name"
done
fi
if on 9; then
echo "== 9. issue 14: ~1B (18 x 2048, 16 heads) on one GPU through the trainer, bf16, compiled, speed keys on"
for strategy in ${STRATEGIES:-ddp fsdp}; do  # one process: ddp = the plain model compiled whole, fsdp = compiled per block
  name=1b-$strategy
  timeout 240 python -m scaletrain train gpt-stdlib --model.n_layer=18 --model.n_head=16 --model.n_embd=2048 \
    --model.vocab_size=50304 --data.seq_len=1024 --data.batch_size=16 --train.precision=bf16-mixed \
    --train.compile=true --train.max_steps=60 --log.every=10 --train.eval_batches=1 --train.progress=false \
    --parallel.strategy=$strategy --model.bias=false --model.loss=fused --model.residual=bf16 \
    --run.dir="/tmp/$name" > "/tmp/$name.txt" 2>&1 || tail -5 "/tmp/$name.txt"
  python benchmarks/summary_line.py "/tmp/$name/summary.json" "$name"
done
fi
if on 10; then
echo "== 10. issue 14: each speed key alone at GPT-2 124M, batch 16 (what each buys; step 8 has all off and all on)"
for keys in "--model.bias=false $OFF" "--model.loss=fused --model.residual=fp32" "--model.residual=bf16 --model.loss=split"; do
  name=key-${keys#--model.}; name=${name%% *}; name=${name/=/-}
  timeout 150 python -m scaletrain train gpt-stdlib $GPT124 --data.batch_size=16 --train.precision=bf16-mixed \
    --train.compile=true --train.max_steps=120 --log.every=20 --train.eval_batches=1 --train.progress=false \
    --run.dir="/tmp/$name" $keys > "/tmp/$name.txt" 2>&1 || tail -5 "/tmp/$name.txt"
  python benchmarks/summary_line.py "/tmp/$name/summary.json" "$name"
done
fi
if on 11; then
echo "== 11. issue 14: peers on the GPU: the trainer against a minimal hand-written loop of the same model (GPT-2"
echo "   124M with biases, bf16, compiled, fused AdamW; the trainer with its defaults), interleaved rounds in one call"
timeout 330 python benchmarks/peers/run.py --job gpt2-124m --nproc 1 --impls ddp,scaletrain --device cuda \
  --steps 60 --log-every 10 --rounds ${ROUNDS:-3} --json "$OUT/peers-cuda-124m.json" 2>&1 | tail -12
fi
# every run's summary, metrics and config in one file (a device call brings back at most 8): plan --calibrate,
# the steady-state and goodput checks read them here afterwards
(cd /tmp && find keys-* key-* 1b-* att-* mode-* -maxdepth 1 \( -name summary.json -o -name metrics.jsonl -o -name '*.toml' \) \
  2>/dev/null | tar czf "$OUT/runs.tgz" -T -) || true
