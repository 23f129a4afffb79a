"""Where W1's timed window goes, part by part and kernel by kernel, against the matmul peak.

Issue 26, item 3 ("half the peak"): the vectorized engine on W1 (replicated to ``--clients``
clients as in ``benchmarks/engines.py --scale``: client j holds W1 client j mod 100's rows, 10
clients per edge), one torch thread, each client count in this process after a one-round
warm-up. Everything is CPU time of this process (``time.process_time``), which a shared
machine's other load disturbs far less than wall time; the float32 matmul peak (2048 x 2048,
the benchmark's) is measured by CPU time too, before every timed run, and the median taken.

1. **The window by part** (median of ``--repeats`` runs): the local SGD kernels
   (``linear_chain_training``: the batched products and the element-wise work of every step),
   the rest of the edge rounds' local work (each client's start model, mini-batch indices,
   gathering the batches), the evaluation (global model on every client's rows + the test
   set), and the remainder (edge/cloud aggregation, records, the engine's loop).
2. **The local step kernel by kernel**: one real chunk (the run's first edge round, the
   automatic chunk of 54 clients) trained ``--kernel-repeats`` times under ``torch.profiler``;
   each aten op's share of the profiled time, applied to the kernels' CPU time of part 1.
3. **Ceilings**: the fraction of peak the window would reach if it held nothing but (a) the
   products, (b) the local kernels, (c) the edge rounds' local work.

Useful FLOPs are the benchmark's (``benchmarks/engines.py``): 3 x 2 x MACs per real row and
step (MACs = 64*128 + 128*10 = 9,472), summed over each client's b_j rows. The products execute
2 x MACs (forward) + 2 x MACs (weight gradients) + 2 x 1,280 (input gradient of the second
layer; the first layer's is never needed) = 40,448 FLOPs per *padded* row (16 per client).

Run: ``python benchmarks/peak_profile.py --clients 100,1000 --rounds 2 --repeats 3``
(results: benchmarks/results/peak_profile.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engines as bench  # noqa: E402 - the benchmark's workload, peak and FLOP counting

RESULTS = bench.ROOT / "benchmarks" / "results" / "peak_profile.json"
#: FLOPs the products execute per padded row and step (see the module docstring).
EXECUTED_FLOPS_PER_ROW = 2 * bench.MLP_MACS * 2 + 2 * 128 * 10
#: aten ops that are the batched products (the rest of the kernel is element-wise work).
PRODUCTS = ("aten::baddbmm", "aten::baddbmm_", "aten::bmm")


class Clock:
    """CPU seconds spent inside wrapped callables, per part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.process_time() - start
        return timed


def instrument(clock: Clock, captured: list[tuple[Any, ...]]) -> None:
    """Time the executor's parts (benchmark-only patches of the vectorized engine)."""
    import fedhier.engines.vectorized.engine as vec

    executor = vec.BatchedExecutor
    executor.train = clock.wrap("local work", executor.train)  # type: ignore[method-assign]
    executor.evaluate = clock.wrap("evaluation", executor.evaluate)  # type: ignore[method-assign]
    training_for = vec.training_for

    def timed_training_for(model: Any, device: Any) -> Any:
        raw = training_for(model, device)
        train = clock.wrap("kernels", raw)

        def capture(params: Any, batches: Any, lrs: Any, optimizer: Any, buffers: Any) -> Any:
            if not captured:  # the first chunk of the run: kept for the kernel profile
                captured.append((raw, {k: v.clone() for k, v in params.items()}, batches,
                                 lrs, optimizer))
            return train(params, batches, lrs, optimizer, buffers)
        return capture

    vec.training_for = timed_training_for  # type: ignore[assignment]


def kernel_profile(captured: tuple[Any, ...], repeats: int) -> dict[str, float]:
    """Each aten op's share of the local kernels' time: the captured chunk's edge round,
    trained ``repeats`` times under ``torch.profiler`` (self time per op)."""
    from torch.profiler import ProfilerActivity, profile

    train, start, batches, lrs, optimizer = captured
    params = {k: v.clone() for k, v in start.items()}
    train(params, batches, lrs, optimizer, None)  # warm
    times: dict[str, float] = {}
    for _ in range(repeats):  # from the captured start models each time (no drift)
        for key, value in start.items():
            params[key].copy_(value)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train(params, batches, lrs, optimizer, None)
        for event in prof.key_averages():
            times[event.key] = times.get(event.key, 0.0) + event.self_cpu_time_total
    total = sum(times.values())
    return {key: value / total for key, value in sorted(times.items(), key=lambda kv: -kv[1])}


def measure(clients: int, args: argparse.Namespace) -> dict[str, Any]:
    """Parts of the window (median over repeats), the kernel profile and the ceilings."""
    clock, captured = Clock(), []
    instrument(clock, captured)
    marks = bench.Marks()
    bench.instrument_recorder(marks)
    small = bench.w1_config(1)
    bench.run_engine("vectorized", small, marks, bench.replicated_federation(small, 100))
    cfg = bench.w1_config(args.rounds, clients=clients, groups=(max(1, clients // 10),))
    fed = bench.replicated_federation(cfg, clients)
    runs, peaks = [], []
    for _ in range(args.repeats):
        peaks.append(bench.matmul_peak(1, repeats=5)["matmul_cpu_gflops"])
        marks.marks.clear()
        clock.seconds.clear()
        captured.clear()
        bench.run_engine("vectorized", cfg, marks, fed)
        runs.append({"window": marks.window()["cpu"], "wall": marks.window()["wall"],
                     **clock.seconds})
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    peak = statistics.median(peaks)
    from fedhier.local.train import effective_batch_size

    sizes = fed.client_sizes()
    rows = int(sum(effective_batch_size(cfg.batch_size, int(m)) for m in sizes))
    steps = args.rounds * cfg.global_period
    useful = rows * bench.FLOPS_PER_EXAMPLE * steps
    executed = clients * cfg.batch_size * EXECUTED_FLOPS_PER_ROW * steps
    shares = kernel_profile(captured[0], args.kernel_repeats)
    product_share = sum(v for k, v in shares.items() if k in PRODUCTS)
    products = med["kernels"] * product_share
    parts = {"local SGD kernels": med["kernels"],
             "rest of the local work (start models, indices, batch gather)":
                 med["local work"] - med["kernels"],
             "evaluation (every client's rows + test set)": med["evaluation"],
             "aggregation, records, engine loop": med["window"] - med["local work"]
                 - med["evaluation"]}

    def of_peak(seconds: float) -> float:
        return useful / seconds / 1e9 / peak

    return {
        "clients": clients, "rounds": args.rounds, "repeats": args.repeats,
        "client_steps": clients * steps, "mean_rows_per_step": rows / clients,
        "matmul_peak_gflops_cpu": peak, "matmul_peaks": peaks,
        "useful_gflop": useful / 1e9, "executed_product_gflop": executed / 1e9,
        "runs": runs, "window_cpu_s": med["window"], "window_wall_s": med["wall"],
        "steps_per_cpu_s": clients * steps / med["window"],
        "fraction_of_peak": of_peak(med["window"]),
        "parts_cpu_s": parts,
        "kernel_op_shares": shares,
        "products_cpu_s": products,
        "products_gflops_executed": executed / products / 1e9,
        "ceilings": {"only the products": of_peak(products),
                     "only the local SGD kernels": of_peak(med["kernels"]),
                     "only the edge rounds' local work": of_peak(med["local work"])},
    }


def print_result(res: dict[str, Any]) -> None:
    print(f"\nW1 replicated to {res['clients']:,} clients, {res['rounds']} cloud round(s), one "
          f"thread, median of {res['repeats']}: window {res['window_cpu_s']:.3f} CPU s "
          f"({res['window_wall_s']:.3f} wall s), {res['steps_per_cpu_s']:,.0f} steps per CPU s, "
          f"{res['useful_gflop']:.2f} useful GFLOP, matmul peak "
          f"{res['matmul_peak_gflops_cpu']:.1f} GFLOP/s -> {res['fraction_of_peak']:.1%} of peak")
    window = res["window_cpu_s"]
    print(f"{'part of the window':<64}{'CPU s':>8}{'share':>8}")
    for part, seconds in res["parts_cpu_s"].items():
        print(f"{part:<64}{seconds:>8.3f}{seconds / window:>8.1%}")
    print(f"\n{'local SGD kernels, op by op (torch.profiler shares)':<64}{'CPU s':>8}"
          f"{'share':>8}")
    kernels = res["parts_cpu_s"]["local SGD kernels"]
    for op, share in res["kernel_op_shares"].items():
        if share >= 0.005:
            print(f"{op:<64}{share * kernels:>8.3f}{share * kernels / window:>8.1%}")
    print(f"\nproducts: {res['executed_product_gflop']:.2f} GFLOP executed (padding included) "
          f"at {res['products_gflops_executed']:.1f} GFLOP/s")
    for name, value in res["ceilings"].items():
        print(f"ceiling if the window held {name}: {value:.1%} of peak")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="100,1000", help="comma-separated client counts")
    parser.add_argument("--rounds", type=int, default=2, help="cloud rounds per run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per client count")
    parser.add_argument("--kernel-repeats", type=int, default=40,
                        help="profiled trainings of the captured chunk")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results = []
    for clients in (int(n) for n in args.clients.split(",")):
        results.append(measure(clients, args))
        print_result(results[-1])
    report = {"command": "python benchmarks/peak_profile.py " + " ".join(sys.argv[1:]),
              "machine": bench.machine(), "results": results}
    bench.write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
