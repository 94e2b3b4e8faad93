"""Benchmarks: every timing and memory figure in the docs comes from a command here.

Sample efficiency (``efficiency``, ``sweep``, ``grid``, ``cells``, ``regime_map``, ``curves``),
throughput and growth with length (``throughput``, ``growth``, ``flops``, ``sampler``), memory
(``memory``, ``peak``) and the first-device check (``accelerator``, ``accelerator_points``,
``bounded``, ``hbm``). Timing lives here, never in tests. The top of the house: may import any
stage, and nothing imports it.
"""
