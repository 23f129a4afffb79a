"""``fedhier sweep``: a researcher's own comparison in one command.

A spec (:mod:`fedhier.studies.sweep.spec`) names a base configuration, axes over any run setting and
seeds; every (arm, seed) is an ordinary run folder made by ``fedhier run``'s own code path
(:mod:`fedhier.studies.sweep.trials`), executed on Ray Tune
(:mod:`fedhier.studies.sweep.tune_runner`);
:mod:`fedhier.studies.sweep.stats` computes the intervals and paired differences and
:mod:`fedhier.studies.sweep.report` writes results.md, results.json and figures. docs/sweeps.md.
"""
