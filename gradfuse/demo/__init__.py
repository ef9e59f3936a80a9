"""The demo (``python -m gradfuse demo``): a small model trained on built-in data with the monitor
on, and the synthetic workloads the benchmarks and tests share (``gradfuse.demo.workloads``).

Layer: the top, beside the CLI. Imports any of gradfuse.
"""
