"""The wire format both Flower sides share: the message keys (:mod:`fedhier.clients.wire.keys`),
tensors as Flower ArrayRecords (:mod:`~fedhier.clients.wire.array_records`) and a model
packed as one object (:mod:`~fedhier.clients.wire.packed_model`)."""
