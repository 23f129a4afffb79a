"""Studies built from runs: the experiment suites that reproduce the papers
(:mod:`fedhier.studies.experiments`) and a researcher's own sweeps
(:mod:`fedhier.studies.sweep`)."""
