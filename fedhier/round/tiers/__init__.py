"""The round split between processes: the jobs a parent sends a server of its own (an edge, a
region) and the reports it gets back (:mod:`fedhier.round.tiers.jobs`), asynchronous edge
servers (:mod:`~fedhier.round.tiers.asynchronous`) and clients moving between servers
(:mod:`~fedhier.round.tiers.moves`). No Flower import: the Flower side is
:mod:`fedhier.strategies.edge`."""
