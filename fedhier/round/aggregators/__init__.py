"""How children's models combine at a level: the registry of rules with the weighted mean
every engine calls (:mod:`fedhier.round.aggregators.averaging`) and the robust rules
(:mod:`~fedhier.round.aggregators.robust`)."""
