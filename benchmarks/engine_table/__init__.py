"""The parts of ``benchmarks/engines.py`` (the engine table), one concept per module.

- :mod:`.workload`: workloads W1 and W2, their configurations and useful FLOPs.
- :mod:`.measure`: measurements inside one process: the timed window, memory, the matmul
  peak, the machine.
- :mod:`.runs`: one run of W1 by the plain loop or by a fedhier engine.
- :mod:`.worker`: the fresh worker process that measures one engine.
- :mod:`.processes`: launching workers and merging their results (the parent's side).
- :mod:`.w1_table`, :mod:`.w2_table`, :mod:`.scale_table`: each table, measured and printed.
"""
