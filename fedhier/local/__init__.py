"""What one client does: the local SGD step and evaluation (:mod:`fedhier.local.train`), its
optimiser and learning-rate schedule, the models by name, and the device it runs on."""
