"""One line of a run's summary.json for benchmarks/gpu_session.sh: tokens/s and MFU in steady state, the
steps they cover, the peak memory, plan vs actual (planned, measured, error) and the goodput account.

    python benchmarks/summary_line.py RUN_DIR/summary.json NAME
"""

import json
import sys
from pathlib import Path

from scaletrain.observe.goodput import describe

path, name = sys.argv[1], sys.argv[2]
try:
    s = json.loads(Path(path).read_text())
except (OSError, ValueError) as e:
    sys.exit(f"{name}: no summary ({e})")
pva = s.get("plan_vs_actual", {})
print(f"{name}: {round(s.get('tokens_per_s', 0)):,} tokens/s, MFU {s.get('mfu')}, steady {s.get('steady_state')}, "
      f"peak {s.get('peak_mem_bytes')} B, plan {pva.get('predicted')} vs actual {pva.get('actual')} "
      f"error {pva.get('error')}, wall {s.get('wall_s')} s, time spent on {describe(s['goodput'])}")
