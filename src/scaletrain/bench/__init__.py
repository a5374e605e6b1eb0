"""Benchmarks: collective bandwidth, training throughput per device, and scaling with the number of ranks.

``scaletrain bench allreduce|throughput|scaling`` (cli/bench.py) drive the modules here; benchmarks/ in the
repository reuses them for the peer comparison and the DDP bucket-size sweep. Nothing is imported here, so
that ``python -m scaletrain.bench.throughput`` runs its module once.
"""
