#!/usr/bin/env bash
# The GPU checks of one lent-GPU session, in priority order, each with its own time limit (1,335 s in all), results under $OUT.
# Run on the device machine from the repository root: PYTHONPATH=src (tomli_w carried in .h4carry).
# A device call runs at most 600 s, so run it in three: `bash benchmarks/gpu_session.sh 1 2 3 4 5`, then `... 6 7`,
# then `... 8` (no arguments: every step).
set -u
export PYTHONPATH=src:.h4carry PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
STEPS=" ${*:-1 2 3 4 5 6 7 8} "
on() { [[ $STEPS == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if on 1; then
echo "== 1. the GPU path of the trainer (tests/unit/test_cuda.py: digits fp32, bf16-mixed, fp16-mixed; a session under fp16-mixed)"
timeout 80 python -m pytest -q -p no:cacheprovider tests/unit/test_cuda.py 2>&1 | tail -4 | tee "$OUT/test_cuda.txt"
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
echo "== 8. issue 14: the trainer's own speed keys at GPT-2 124M (vocab 50304, seq 1024, batch 16, bf16, compiled),"
echo "   off and on, side by side in one call: steady-state tokens/s, MFU, peak memory and plan vs actual"
for keys in "" "--model.bias=false --model.loss=fused --model.residual=bf16"; do
  name=keys-$([ -z "$keys" ] && echo off || echo on)
  timeout 200 python -m scaletrain train gpt-stdlib --model.n_layer=12 --model.n_head=12 --model.n_embd=768 \
    --model.vocab_size=50304 --data.seq_len=1024 --data.batch_size=16 --train.precision=bf16-mixed \
    --train.compile=true --train.max_steps=120 --log.every=20 --train.eval_batches=1 --train.progress=false \
    --run.dir="$OUT/$name" $keys > "$OUT/$name.txt" 2>&1
  python -c "import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], round(s.get('tokens_per_s', 0)), s.get('mfu'), s['steady_state'], s['peak_mem_bytes'], s.get('plan_vs_actual', {}).get('error'))" \
    "$OUT/$name/summary.json" "$name"
done
fi
