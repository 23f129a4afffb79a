"""``fedhier deploy local``: the hierarchical app on Flower's Deployment Engine, one machine.

Starts a SuperLink and N SuperNodes on 127.0.0.1 (SuperNode i gets
``--node-config "partition-id=i num-partitions=N"`` and its own Runtime API port), submits the
app with ``flwr run <app> <connection>``, prints one line per cloud round while the ServerApp
writes the usual run folder, and stops every process it started (by process group, also on
error, timeout or Ctrl-C). fedhier writes no networking of its own: all traffic is Flower's.

Secure by default: TLS between SuperNodes and SuperLink with a generated test CA (or your
certificates, ``--certs DIR``) and Flower's SuperNode authentication (each SuperNode's public
key is registered with ``flwr supernode register`` before it connects). ``--insecure`` turns
both off and must be asked for. See docs/deployment.md.

Layout of the run folder ``out``: the ServerApp's files (config.json, metrics.jsonl, ...) and
``deploy/`` with this command's material: ``flwr-home/<process>`` (each process's FLWR_HOME),
``certs/``, ``logs/`` (one log per process) and ``run_config.toml``. The ServerApp refuses a
non-empty run folder, so ``deploy/`` is staged beside ``out`` during the run and moved in at
the end.

Modules, one concern each:

==================  =========================================================================
``processes``       process supervision: start in new sessions, snapshot trees, stop all
``ports``           free / busy / open ports on 127.0.0.1
``connection``      ``$FLWR_HOME/config.toml`` connection and the ``--run-config`` overrides
``certs``           test CA, SuperLink certificate, SuperNode keys (imports ``cryptography``)
``local``           :class:`LocalDeployment`: SuperLink + SuperNodes, ``flwr run``, rounds
``edge_servers``    :class:`EdgeTierDeployment`: ``--edges E``, E edge servers as processes
``edge_process``    one edge server as one process
``task_runtime``    claiming and answering a SuperNode's tasks from a process of our own
``client_runtime``  fedhier's ClientApp served by one long-lived process per SuperNode
``placement``       each client's edge before the run (the run's grouping, from the data)
``wire``            the wire-byte meter (``wiretap/sitecustomize.py``) and its totals per link
``cli``             the ``fedhier deploy`` subcommand (``python -m fedhier.engines.deployment``)
``errors``          :class:`DeployError`, :class:`DeployTimeoutError`
==================  =========================================================================

This package re-exports the names other modules and the tests use (not ``certs``, so that
importing it does not load ``cryptography``).
"""

from fedhier.engines.deployment.cli import add_parser, cmd_deploy, main, resolve_config
from fedhier.engines.deployment.connection import (
    CONNECTION,
    NOT_PASSED,
    app_config_keys,
    connection_toml,
    run_config_overrides,
    write_run_config,
)
from fedhier.engines.deployment.errors import DeployError, DeployTimeoutError
from fedhier.engines.deployment.local import (
    DEFAULT_BASE_PORT,
    REPO_ROOT,
    LocalDeployment,
    format_round,
)
from fedhier.engines.deployment.ports import (
    HOST,
    check_ports,
    free_port_block,
    port_is_free,
    port_open,
)
from fedhier.engines.deployment.processes import (
    FLOWER_ENV,
    Managed,
    ProcessGroup,
    alive,
    executable,
    process_tree,
)
from fedhier.tree.grouping.base import contiguous_edges

__all__ = [
    "CONNECTION", "DEFAULT_BASE_PORT", "FLOWER_ENV", "HOST", "NOT_PASSED", "REPO_ROOT",
    "DeployError", "DeployTimeoutError", "LocalDeployment", "Managed", "ProcessGroup",
    "add_parser", "alive", "app_config_keys", "check_ports", "cmd_deploy", "connection_toml",
    "contiguous_edges", "executable", "format_round", "free_port_block", "main",
    "port_is_free", "port_open", "process_tree", "resolve_config", "run_config_overrides",
    "write_run_config",
]
