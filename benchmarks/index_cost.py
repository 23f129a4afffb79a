"""What the mini-batch indices cost the vectorized engine: W1 (or W1 replicated to more
clients) timed with ``fedhier.local.train.clients_batch_indices`` computed as usual, and served
from a cache filled by an earlier run, i.e. free. ``--per-client`` computes them the way the
engine did before ``fedhier.common.permutations``: one ``batch_indices`` (one generator per epoch)
per client. The difference bounds what any faster index stream (a
counter-based one drawn for all clients at once, say) could save.

    .venv/bin/python benchmarks/index_cost.py --clients 1000

Prints the median CPU seconds of the timed window (cloud round 0's record to the last one) over
``--repeats`` interleaved passes, one torch thread.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import engines as bench
import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100, help="W1 replicated to this many")
    parser.add_argument("--rounds", type=int, default=10, help="cloud rounds")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes")
    parser.add_argument("--per-client", action="store_true",
                        help="compute them client by client, as before fedhier.common.permutations")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import fedhier.engines.vectorized.kernels as batched

    cfg = bench.w1_config(args.rounds)
    fed = None
    if args.clients != 100:
        fed = bench.replicated_federation(cfg, args.clients)
        cfg = cfg.replace(clients=args.clients, groups=(max(1, args.clients // 10),))
    marks = bench.Marks()
    bench.instrument_recorder(marks)

    def window() -> float:
        marks.marks.clear()
        bench.run_engine("vectorized", cfg, marks, fed)
        return marks.window()["cpu"]

    from fedhier.local.train import batch_indices

    def per_client(seed: int, num_rows: list[int], *rest: int,
                   first_client: int = 0) -> list[np.ndarray]:
        return [batch_indices(seed, first_client + k, n, *rest) for k, n in enumerate(num_rows)]

    computed: Callable[..., list[np.ndarray]] = (
        per_client if args.per_client else batched.clients_batch_indices)
    cache: dict[tuple[Any, ...], list[np.ndarray]] = {}

    def cached(seed: int, num_rows: list[int], *rest: int,
               first_client: int = 0) -> list[np.ndarray]:
        key = (seed, tuple(num_rows), *rest, first_client)
        if key not in cache:
            cache[key] = computed(seed, num_rows, *rest, first_client=first_client)
        return [a.copy() for a in cache[key]]

    def use(indices: Callable[..., list[np.ndarray]]) -> None:
        setattr(batched, "clients_batch_indices", indices)  # noqa: B010 - benchmark-only patch

    bench.run_engine("vectorized", cfg.replace(rounds=1), marks, fed)  # warm-up
    use(cached)
    window()  # fills the cache
    times: dict[str, list[float]] = {"computed": [], "cached (free)": []}
    for _ in range(args.repeats):
        use(computed)
        times["computed"].append(window())
        use(cached)
        times["cached (free)"].append(window())
    use(computed)
    medians = {name: statistics.median(values) for name, values in times.items()}
    how = "client by client" if args.per_client else "all clients at once"
    print(f"W1 replicated to {args.clients} clients, {args.rounds} cloud rounds, vectorized, "
          f"1 thread, indices {how}: CPU seconds of the timed window (median of "
          f"{args.repeats})")
    for name, value in medians.items():
        print(f"  indices {name:<14} {value:8.3f}")
    share = 1 - medians["cached (free)"] / medians["computed"]
    print(f"  free indices save {share:.1%} of the window")


if __name__ == "__main__":
    main()
