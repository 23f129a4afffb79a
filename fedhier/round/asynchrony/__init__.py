"""Asynchronous, buffered aggregation: nodes that aggregate their first K children's reports
(docs/hsgd.md#asynchronous-edges): the settings, the edges' and regions' buffers, the
arrival order and how stale reports combine."""
