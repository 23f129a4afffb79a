"""fedhier's ClientApp served by one long-lived process per SuperNode.

``python -m fedhier.engines.deployment.client_runtime --node HOST:PORT`` claims every
ClientApp task of the SuperNode whose runtime API is HOST:PORT (a SuperNode started with
``--isolation process``) and answers it with :data:`fedhier.clients.app.app`, as Flower's
``flwr-clientapp`` would, but without starting a Python process (imports, data loading) per
message: ``fedhier deploy local`` uses it for its own app. The context (the client's kept
state) goes back to the SuperNode with every reply, as in Flower's runtime.

Torch runs on ``--torch-threads`` threads (default 1): ``deploy local`` puts every client on
one machine, where a second thread per client only spins waiting for a core (the default MLP's
train message: 2 ms of CPU on one thread, 11-28 ms on two; docs/deployment.md#latency).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedhier.engines.deployment.client_runtime",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, metavar="HOST:PORT",
                        help="the SuperNode's runtime API")
    parser.add_argument("--name", default="client", help="the name in log lines")
    parser.add_argument("--superexec-secret", type=Path,
                        help="the SuperNode's SuperExec authentication secret")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch's intra-op threads (default 1)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, args.torch_threads))
    from fedhier.clients.app import app
    from fedhier.engines.deployment.task_runtime import exit_on_sigterm, serve_tasks

    exit_on_sigterm()
    secret = args.superexec_secret.read_bytes() if args.superexec_secret else None
    try:
        serve_tasks(args.node, secret, app, args.name)
    except KeyboardInterrupt:  # Ctrl-C, or Flower's HTTP client refused (it sends SIGINT)
        print(f"{args.name}: interrupted (SIGINT); exiting", file=sys.stderr, flush=True)
        return 0
    except SystemExit:
        return 0
    except Exception as exc:  # noqa: BLE001 - one line for the deploy log
        print(f"{args.name}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
