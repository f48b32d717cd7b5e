"""Benchmarks of cpt_jax: quantization overhead, compilations, throughput, memory.

Each script prints its figures with ratios measured side by side in one run
(interleaved repeats, medians) and, with ``--json``, one JSON object on its last
line. See docs/performance.md for the figures and the commands that made them.
"""
