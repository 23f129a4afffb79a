"""Gradient diagnostics: the divergences of Wang et al. (2022) and the gradient diversity of
Yin et al. (2018), exact formulas in docs/diagnostics.md (:mod:`fedhier.diagnostics.measures`),
and the ones a cloud round records (:mod:`fedhier.diagnostics.in_rounds`)."""

from fedhier.diagnostics.measures import (
    batch_size_bound,
    divergences,
    flat_gradient,
    gradient_diversity,
    label_distributions,
    label_upward_divergence,
    per_example_gradients,
    sample_gradient_diversity,
)

__all__ = [
    "flat_gradient",
    "per_example_gradients",
    "gradient_diversity",
    "batch_size_bound",
    "sample_gradient_diversity",
    "divergences",
    "label_distributions",
    "label_upward_divergence",
]
