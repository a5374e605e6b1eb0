"""What a run shows and records: console output on rank 0, metrics.jsonl, summary.json."""
