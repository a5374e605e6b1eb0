"""Plans before a run: the accelerator catalog, memory per GPU per layout, time and cost (cli/plan.py)."""
