"""The round of hierarchical SGD as parts (docs/index.md, "The round as parts").

One loop (:class:`fedhier.round.loop.HierarchicalSGD`) asks each part its question and names none of
the features behind it:

* :mod:`~fedhier.round.executor`: the seam to whatever runs the clients;
* :mod:`~fedhier.round.membership`: which clients each edge has (regrouping, mobility);
* :mod:`~fedhier.round.schedule`: when each node aggregates (equal or per-edge periods);
* :mod:`~fedhier.round.updates`: a client's update on its way up (FedNova scale, screening);
* :mod:`~fedhier.round.aggregation`: the registry's rule per level, the models nodes hold;
* :mod:`~fedhier.round.cloud`: the cloud step (plain mean or a Flower Strategy);
* :mod:`~fedhier.round.record_fields`: the evaluation and diagnostics keys of a record.

The clock is :mod:`fedhier.round.clock`.
"""
