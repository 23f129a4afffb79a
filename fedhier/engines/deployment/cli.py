"""``fedhier deploy local`` (also ``python -m fedhier.engines.deployment local``): parse the
flags, start a :class:`~fedhier.engines.deployment.local.LocalDeployment`, run the app, keep
its material in the run folder, stop everything.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedhier.cli.flags import (
    OneLineParser,
    add_config_flags,
    config_from_args,
    prepare_data,
    resumed_config,
    run_command,
)
from fedhier.common.errors import ConfigError
from fedhier.engines.deployment.connection import run_config_overrides
from fedhier.engines.deployment.errors import DeployError, DeployTimeoutError
from fedhier.engines.deployment.local import (
    DEFAULT_BASE_PORT,
    REPO_ROOT,
    LocalDeployment,
)
from fedhier.engines.deployment.polling import DEFAULT_INTERVAL, FLOWER_IDLE
from fedhier.engines.deployment.ports import check_ports, ports_needed
from fedhier.settings.run_config import RunConfig


@contextmanager
def _interrupt_on_sigterm() -> Iterator[None]:
    """Treat SIGTERM/SIGHUP like Ctrl-C so that every started process is stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The run configuration of ``fedhier deploy``: clients = --nodes; with ``--edges E``,
    E edge servers (groups = E, edge_servers on), with ``--regions R`` too, R region servers
    above them (groups = E,R); with ``--resume DIR``, DIR's own."""
    if args.resume is not None:
        return _resumed(args)
    edges, regions = getattr(args, "edges", None), getattr(args, "regions", None)
    servers = None if edges is None else (edges,) if regions is None else (edges, regions)
    cfg = config_from_args(args, None if servers is None else {"groups": servers})
    if args.nodes is None:
        raise ConfigError("--nodes N is required (or --resume RUN_DIR)")
    if args.nodes < 1:
        raise ConfigError(f"--nodes must be at least 1, got {args.nodes}")
    if args.clients is not None and args.clients != args.nodes:
        raise ConfigError(f"--clients {args.clients} contradicts --nodes {args.nodes}: each "
                          "SuperNode is one client; give --nodes only")
    cfg = cfg.replace(clients=args.nodes)
    if cfg.on_bad_reply == "auto":  # real processes: one client must not stop everyone's run
        cfg = cfg.replace(on_bad_reply="drop")
    if edges is None:
        if regions is not None:
            raise ConfigError("--regions needs --edges: regions are servers over edge servers")
        return cfg
    if not 1 <= edges <= args.nodes:
        raise ConfigError(f"--edges must be between 1 and --nodes {args.nodes}, got {edges}")
    if regions is not None and not 1 <= regions <= edges:
        raise ConfigError(f"--regions must be between 1 and --edges {edges}, got {regions}")
    groups = servers
    if args.groups is not None and cfg.groups != groups:
        raise ConfigError(f"--groups {args.groups} contradicts --edges {edges}"
                          f"{'' if regions is None else f' --regions {regions}'}: with edge "
                          "servers the groups are the servers; give --edges (--regions) only")
    cfg = cfg.replace(groups=groups, edge_servers=True)
    cfg.validate()
    return cfg


def _resumed(args: argparse.Namespace) -> RunConfig:
    """The configuration of the run folder ``--resume`` continues (``--nodes`` and
    ``--edges`` may repeat it; nothing may change it)."""
    cfg = resumed_config(args, engine="inprocess")  # the engine is not passed to the app
    if args.nodes is not None and args.nodes != cfg.clients:
        raise ConfigError(f"--nodes {args.nodes} contradicts the resumed run's "
                          f"{cfg.clients} clients; drop --nodes")
    edges = cfg.num_edges if cfg.edge_servers else None
    if args.edges is not None and args.edges != edges:
        raise ConfigError(f"--edges {args.edges} contradicts the resumed run ("
                          f"{f'{edges} edge servers' if edges else 'no edge servers'}); "
                          "drop --edges")
    regions = cfg.groups[1] if cfg.edge_servers and len(cfg.groups) > 1 else None
    if getattr(args, "regions", None) is not None and args.regions != regions:
        raise ConfigError(f"--regions {args.regions} contradicts the resumed run; drop "
                          "--regions")
    args.nodes = cfg.clients
    return cfg.replace(out=str(Path(args.resume).resolve()))


def cmd_deploy(args: argparse.Namespace) -> int:
    """``fedhier deploy local``: 0 on success, 1 if the run failed, 124 on --timeout."""
    from fedhier.runs.folder import default_run_dir

    cfg = resolve_config(args)
    if args.insecure and args.certs is not None:
        raise ConfigError("--insecure and --certs contradict each other; give one")
    if args.certs is not None and not Path(args.certs).is_dir():
        raise ConfigError(f"--certs {args.certs}: no such folder")
    if not args.timeout > 0:  # NaN too
        raise ConfigError(f"--timeout must be positive, got {args.timeout}")
    if not 0 <= args.poll_interval <= FLOWER_IDLE:
        raise ConfigError(f"--poll-interval must be between 0 and {FLOWER_IDLE:g} seconds, "
                          f"got {args.poll_interval}")
    if cfg.replay_arrivals:  # fedhier.round.tiers.asynchronous (resolve_config read it)
        if not (cfg.edge_servers and cfg.asynchronous().active):
            raise ConfigError("--replay-arrivals replays asynchronous edge servers: it needs "
                              "--edges and --async-buffer")
        if args.resume is not None:
            raise ConfigError("--resume continues with the run's own recorded arrivals; "
                              "drop --replay-arrivals")
    app = Path(args.app).resolve()
    if cfg.edge_servers and app != REPO_ROOT.resolve():
        raise ConfigError("--edges runs fedhier's own app (its ServerApp drives the edge "
                          "servers; clients follow docs/contract.md); drop --app")
    run_config_overrides(cfg, app)  # every flag must reach the ServerApp
    out = Path(cfg.out or default_run_dir(f"{cfg.dataset}-deploy")).resolve()
    from fedhier.engines.resume import resumable_checkpoint
    from fedhier.local.train import resolve_device
    from fedhier.runs.folder import RunFolder

    if args.resume is not None:  # the checkpoint fits, and no other run writes the folder
        resumable_checkpoint(out, cfg)
        RunFolder.claim_existing(out).lock.release()
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"run folder {out} already exists and is not empty; choose another "
                          "--out (or continue it with --resume)")
    else:
        RunFolder.check_target(out)  # not under a file
    check_ports(args.base_port, ports_needed(args.nodes, sum(cfg.groups) if cfg.edge_servers
                                             else 0) - 1)
    resolve_device(cfg.device)
    prepare_data(cfg)  # data and partition are valid before anything starts
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.deploy-", dir=out.parent))
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot write beside it ({exc.strerror or exc})") from None
    from fedhier.tree.grouping.base import contiguous_edges

    echo: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
    edges = (contiguous_edges(args.nodes, cfg.num_edges)
             if cfg.grouping in ("contiguous", "edge-tag") else None)
    common: dict[str, Any] = dict(
        nodes=args.nodes, work=work, base_port=args.base_port, secure=not args.insecure,
        supernode_auth=not args.no_supernode_auth,
        certs_dir=Path(args.certs) if args.certs else None, app=app, echo=echo,
        wait_online=False, wire_dir=work / "wire",
        resume_dir=out if args.resume is not None else None,
        poll_interval=args.poll_interval,
        client_runtime=app == REPO_ROOT.resolve())  # fedhier's own ClientApp: one process
    try:
        deployment: LocalDeployment
        if cfg.edge_servers:
            from fedhier.engines.deployment.edge_servers import EdgeTierDeployment
            from fedhier.engines.deployment.placement import tree_placement

            tree = tree_placement(cfg)
            deployment = EdgeTierDeployment(
                **common, edges=tree[0].tolist(), upper=[p.tolist() for p in tree[1:]],
                num_edges=cfg.num_edges, edge_timeout=cfg.round_timeout,
                moves_clients=cfg.mobility().active or cfg.regroup_every > 0)
        else:
            deployment = LocalDeployment(**common, edges=edges)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    t0 = time.time()
    code = 1
    try:
        with _interrupt_on_sigterm(), deployment:
            summary = deployment.run_app(cfg, out, timeout=args.timeout, verbose=args.verbose)
            echo(f"final test accuracy {summary['final_test_accuracy']:.4f}, test loss "
                 f"{summary['final_test_loss']:.4f} after {summary['iterations']} iterations "
                 f"({summary['rounds']} cloud rounds) on {args.nodes} SuperNodes in "
                 f"{time.time() - t0:.1f} s")
            code = 0
    except DeployTimeoutError as exc:
        print(f"fedhier: error: {exc}", file=sys.stderr)
        code = 124
    except DeployError as exc:
        print(f"fedhier: error: {exc}", file=sys.stderr)
        code = 1
    finally:
        _write_wire(work / "wire", out, echo)
        _keep(work, out)
        echo(f"stopped all {len(deployment.procs.started)} processes started; run folder: "
             f"{out} (logs in {out / 'deploy' / 'logs'})")
    return code


def _write_wire(wire_dir: Path, out: Path, echo: Callable[[str], None]) -> None:
    """The run's measured traffic per link (after every process stopped) to wire.json."""
    import json

    from fedhier.engines.deployment.wire import read_wire

    totals = read_wire(wire_dir)
    if not totals or not out.is_dir():
        return
    (out / "wire.json").write_text(json.dumps(totals, indent=1) + "\n")
    for link, t in sorted(totals.items()):
        echo(f"wire bytes on the {link} link: {t['sent']:,} sent, {t['received']:,} received "
             f"({t['connections']} connections, {t['processes']} processes)")


def _keep(work: Path, out: Path) -> None:
    """Move the staged deploy material into ``out/deploy``."""
    if not work.exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    target = out / "deploy"
    if target.exists():
        target = out / work.name.lstrip(".")
    shutil.move(str(work), str(target))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``deploy`` (action ``local``) to the ``fedhier`` subcommands."""
    parser = subparsers.add_parser(
        "deploy", help="run on Flower's Deployment Engine (SuperLink + SuperNodes)",
        description="Start a SuperLink and --nodes SuperNodes on 127.0.0.1, run the "
        "hierarchical app on them with `flwr run`, write the run folder, stop everything. "
        "TLS and SuperNode authentication are on unless --insecure.")
    parser.add_argument("action", choices=["local"],
                        help="local: every process on this machine, loopback only")
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="number of SuperNodes = clients (SuperNode i has partition-id i); "
                        "required unless --resume")
    parser.add_argument("--resume", type=Path, metavar="RUN_DIR",
                        help="continue a deployed run from its checkpoint.pt (written every "
                        "--checkpoint-every rounds) with its own configuration, on fresh "
                        "processes")
    parser.add_argument("--edges", type=int, metavar="E",
                        help="run E edge servers as processes (each its own SuperLink for its "
                        "clients and a SuperNode of the cloud's); clients connect to their "
                        "edge, which meets the cloud every global period (docs/deployment.md)")
    parser.add_argument("--regions", type=int, metavar="R",
                        help="with --edges: R region servers over the edge servers (a "
                        "third tier: each a SuperLink for its edges and a SuperNode of the "
                        "cloud's); needs --periods I,G1,G2 (docs/deployment.md)")
    parser.add_argument("--config", type=Path, metavar="FILE.toml",
                        help="TOML file with run configuration keys")
    security = parser.add_argument_group("security")
    security.add_argument("--insecure", action="store_true",
                          help="no TLS, no SuperNode authentication (only when asked for)")
    security.add_argument("--certs", type=Path, metavar="DIR",
                          help="use DIR/ca.crt, server.crt, server.key (and supernode-<i> "
                          "keys if present) instead of generated test certificates")
    security.add_argument("--no-supernode-auth", action="store_true",
                          help="TLS only: do not register and authenticate SuperNode keys")
    proc = parser.add_argument_group("processes")
    proc.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT, metavar="PORT",
                      help=f"SuperLink port; SuperNode i uses PORT+1+i (default "
                      f"{DEFAULT_BASE_PORT})")
    proc.add_argument("--timeout", type=float, default=3600, metavar="SECONDS",
                      help="stop everything if the run takes longer (default 3600)")
    proc.add_argument("--app", type=Path, default=REPO_ROOT, metavar="DIR",
                      help="the Flower app to run (default: the fedhier source tree)")
    proc.add_argument("--poll-interval", type=float, default=DEFAULT_INTERVAL,
                      metavar="SECONDS",
                      help="while a run is in flight, SuperNodes ask their SuperLink for work "
                      f"this often (default {DEFAULT_INTERVAL:g}; idle and 0: Flower's "
                      f"{FLOWER_IDLE:g} s; docs/deployment.md#latency)")
    proc.add_argument("--verbose", action="store_true", help="echo the whole ServerApp log")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    add_config_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedhier.engines.deployment local --nodes N ...`` (same as ``fedhier deploy``)."""
    parser = OneLineParser(prog="fedhier")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["deploy", *(sys.argv[1:] if argv is None else argv)])
    return run_command(cmd_deploy, args)

if __name__ == "__main__":
    sys.exit(main())
