"""The run settings: each declared once (:mod:`fedhier.settings.run_config`), validated
(:mod:`~fedhier.settings.checks`), parsed from flags, TOML files and Flower run configs
(:mod:`~fedhier.settings.parse`), with their valid ranges (:mod:`~fedhier.settings.ranges`)
and the table every list of settings is derived from (:mod:`~fedhier.settings.table`)."""
