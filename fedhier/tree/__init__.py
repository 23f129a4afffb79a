"""The hierarchy: clients under edges under regions ... (:mod:`fedhier.tree.hierarchy`), how
clients are grouped (:mod:`~fedhier.tree.grouping`) and how they move between edges
(:mod:`~fedhier.tree.mobility`, :mod:`~fedhier.tree.admission`)."""
