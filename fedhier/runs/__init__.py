"""A run as a folder: what it writes (:mod:`fedhier.runs.folder`, :mod:`~fedhier.runs.recorder`),
how the loop is driven with records and checkpoints (:mod:`~fedhier.runs.driver`), how it is
resumed, and what it shows (trackers, plots)."""
