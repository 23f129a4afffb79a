"""One hostile client of 10 on digits, under each aggregation rule at the edge or the cloud
(the table in docs/security.md).

Two topologies, so that each level has members to choose among: ``edge`` = 2 edges of 5
clients with the rule at the edges (``--aggregators RULE,mean``), ``cloud`` = 5 edges of 2
clients with the rule at the cloud (``mean,RULE``). Client 0 is hostile: ``poison`` replies
100 x the model it was sent, ``flip`` its update sign-flipped and scaled x 10
(w - 10 (w' - w)). Reported: the global model's test accuracy after ``--rounds`` cloud
rounds (non-finite updates skipped, a non-finite model scores 0), and after ONE cloud round
from the initial model its fraction of the way toward the hostile client's last reply m,
<w - w_h, m - w_h> / ||m - w_h||^2 (w_h: the honest round's result; 0 = unmoved,
1 = captured). ``mean+check``: the mean with the default update check
(``--max-update-ratio 1000``) and ``--on-bad-reply drop``; the other rows measure the rules
alone (``--max-update-ratio 0``).

The second table: k hostile clients of n = 10 in ONE edge (clients 0 .. k-1, k = 1 .. 5,
the rule at the edge: ``RULE,mean``), each attack's capture fraction after one cloud round
toward the mean of the hostile replies; ``min_members`` is the fewest members at which the
rule leaves one hostile member out (``fedhier.round.aggregators.averaging.Aggregator.min_members``).

    python benchmarks/hostile_table.py --rounds 15   # both tables, ~8 min on 2 cores
    python benchmarks/hostile_table.py --rounds 2 --rules mean,median   # a quick look
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from fedhier.clients import app as fedhier_client
from fedhier.engines.inprocess_grid import InProcessGrid
from fedhier.runs.prepare import initial_model, prepare, quiet_flower, settings_for, test_metrics
from fedhier.settings.run_config import RunConfig
from fedhier.strategies.hierfedavg import HierFedAvg

RULES = ("mean", "median", "trimmed-mean", "clip", "krum", "multi-krum", "mean+check")
HOSTILE = 0


def attack_app(attack: str, last: dict, hostile: frozenset[int] = frozenset({HOSTILE})
               ) -> ClientApp:
    """fedhier's ClientApp with the clients ``hostile`` replying ``attack``'s model (the
    last one kept in ``last['model']``, each client's in ``last[client]``)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        reply = fedhier_client.train(msg, context)
        client = int(context.node_config["partition-id"])
        if attack == "none" or client not in hostile:
            return reply
        sent = msg.content["arrays"].to_torch_state_dict()
        trained = reply.content["arrays"].to_torch_state_dict()
        bad = {k: 100 * sent[k] if attack == "poison" else sent[k] - 10 * (trained[k] - sent[k])
               for k in trained}
        last["model"] = last[client] = bad
        reply.content["arrays"] = ArrayRecord(bad)
        return reply

    app.evaluate()(fedhier_client.evaluate_local)
    app.query()(fedhier_client.profile)
    return app


def run(cfg: RunConfig, attack: str, hostile: frozenset[int] = frozenset({HOSTILE})
        ) -> tuple[dict[str, torch.Tensor], dict]:
    """The final global model of ``cfg`` with ``attack`` and the hostile clients' last."""
    last: dict = {}
    fed = prepare(cfg)
    grid = InProcessGrid(attack_app(attack, last, hostile), cfg.clients, seed=cfg.seed)
    strategy = HierFedAvg.from_settings(settings_for(cfg))
    initial = initial_model(cfg, fed).state_dict()
    result = strategy.start(grid, ArrayRecord(initial), num_rounds=cfg.rounds,
                            train_config=ConfigRecord(cfg.to_run_config()))
    return result.arrays.to_torch_state_dict(), last


def fraction(final: dict, honest: dict, hostile: dict) -> float:
    """How far ``final`` moved from ``honest`` toward ``hostile`` (projection, 0 .. 1)."""
    num = sum(float(((final[k] - honest[k]).double() * (hostile[k] - honest[k]).double()).sum())
              for k in final)
    den = sum(float(((hostile[k] - honest[k]).double() ** 2).sum()) for k in final)
    return num / den


def accuracy(model: torch.nn.Module, params: dict, fed) -> float:
    """Test accuracy of ``params`` (0 for a model that is not finite)."""
    if not all(bool(torch.isfinite(v).all()) for v in params.values()):
        return 0.0
    return float(test_metrics(model, params, fed, torch.device("cpu"))["test_accuracy"])


def k_of_n(base: RunConfig, rules: list[str], n: int = 10) -> list[dict]:
    """The second table: k = 1 .. n/2 hostile clients of ``n`` in one edge, per rule."""
    from fedhier.round.aggregators.averaging import aggregator

    rows = []
    one = base.replace(clients=n, groups=(1,), rounds=1)
    for rule in rules:
        name = rule.removesuffix("+check")
        cfg = one.replace(aggregators=f"{name},mean")
        if rule.endswith("+check"):
            cfg = cfg.replace(max_update_ratio=1000.0, on_bad_reply="drop")
        honest, _ = run(cfg, "none")
        row: dict = {"rule": rule, "n": n, "min_members": aggregator(name).min_members}
        for attack in ("poison", "flip"):
            for k in range(1, n // 2 + 1):
                hostile = frozenset(range(k))
                final, last = run(cfg, attack, hostile)
                target = {key: torch.stack([last[c][key] for c in sorted(hostile)]).mean(0)
                          for key in final}
                row[f"{attack}_{k}"] = fraction(final, honest, target)
        rows.append(row)
        print(f"{rule:12s} n={n} " + "  ".join(
            f"{a} " + " ".join(f"{row[f'{a}_{k}']:.4f}" for k in range(1, n // 2 + 1))
            for a in ("poison", "flip")), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/hostile.json"))
    args = parser.parse_args()
    logging.getLogger("fedhier").setLevel(logging.ERROR)
    quiet_flower()
    torch.set_num_threads(1)
    base = RunConfig(dataset="digits", clients=10, local_period=2, global_period=4,
                     rounds=args.rounds, batch_size=16, seed=1, grouping="contiguous",
                     on_bad_reply="stop", on_nan="skip-client",
                     max_update_ratio=0)  # the rules alone, without the update check
    topologies = {"edge": base.replace(groups=(2,)), "cloud": base.replace(groups=(5,))}
    rows = []
    for level, topology in topologies.items():
        fed = prepare(topology)
        model = initial_model(topology, fed)
        for rule in args.rules.split(","):
            name = rule.removesuffix("+check")
            cfg = topology.replace(aggregators=f"{name},mean" if level == "edge"
                                   else f"mean,{name}")
            if rule.endswith("+check"):  # the default update check, replies dropped
                cfg = cfg.replace(max_update_ratio=1000.0, on_bad_reply="drop")
            honest, _ = run(cfg, "none")
            honest_one, _ = run(cfg.replace(rounds=1), "none")
            row = {"level": level, "rule": rule, "honest_accuracy": accuracy(model, honest, fed)}
            for attack in ("poison", "flip"):
                final, _ = run(cfg, attack)
                row[f"{attack}_accuracy"] = accuracy(model, final, fed)
                one, last = run(cfg.replace(rounds=1), attack)
                row[f"{attack}_fraction"] = fraction(one, honest_one, last["model"])
            rows.append(row)
            print(f"{level:5s} {rule:12s} honest {row['honest_accuracy']:.3f}  poison "
                  f"{row['poison_accuracy']:.3f} ({row['poison_fraction']:.4f})  flip "
                  f"{row['flip_accuracy']:.3f} ({row['flip_fraction']:.4f})", flush=True)
    several = k_of_n(base, args.rules.split(","))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "rows": rows, "k_of_n": several},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
