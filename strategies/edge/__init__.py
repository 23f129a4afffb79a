"""The edge servers' Flower side (docs/deployment.md#edge-servers).

- :mod:`.messages`: the messages between the cloud and its edge servers;
- :mod:`.server`: :class:`~fedhier.strategies.edge.server.EdgeServer`, an edge server's
  handler of the cloud's messages, reaching its own clients through its own Grid;
- :mod:`.cloud_executor`: the cloud's executor whose nodes are edge servers.

The algorithm both halves run is :mod:`fedhier.round.tiers.jobs` (no Flower); the processes around
an edge server are :mod:`fedhier.engines.deployment.edge_process` and
:mod:`fedhier.engines.deployment.edge_servers`.
"""
