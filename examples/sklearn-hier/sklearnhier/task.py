"""sklearnhier: the data and the model of a scikit-learn logistic regression app.

Data: scikit-learn's handwritten digits (shipped with scikit-learn, no download), shuffled
with a seed and dealt to the clients in equal shares (every client holds every class, which
``LogisticRegression`` needs to keep its coefficients' shape); each client keeps 20% of its
rows as its test rows. ``load_data`` returns the usual sklearn example's shape,
``(X_train, y_train, X_test, y_test)``.
"""

from __future__ import annotations

import warnings

import numpy as np
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

NUM_CLASSES, NUM_FEATURES = 10, 64


def load_data(partition_id: int, num_partitions: int, seed: int = 0):
    """This client's (X_train, y_train, X_test, y_test): float64 [m, 64] in [0, 1], int."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    rows = np.array_split(order, num_partitions)[partition_id]
    cut = int(0.8 * len(rows))
    train, test = rows[:cut], rows[cut:]
    return x[train] / 16.0, y[train], x[test] / 16.0, y[test]


def new_model(c: float = 1.0, local_steps: int = 1) -> LogisticRegression:
    """An L2-regularised logistic regression (inverse strength ``c``) that continues from
    its coefficients (warm start) for ``local_steps`` lbfgs iterations per fit."""
    model = LogisticRegression(C=c, max_iter=local_steps, warm_start=True)
    model.classes_ = np.arange(NUM_CLASSES)
    return model


def initial_params() -> list[np.ndarray]:
    """The initial model: zero coefficients [10, 64] and intercepts [10] (float64)."""
    return [np.zeros((NUM_CLASSES, NUM_FEATURES)), np.zeros(NUM_CLASSES)]


def set_params(model: LogisticRegression, params: list[np.ndarray]) -> LogisticRegression:
    model.coef_, model.intercept_ = params[0].copy(), params[1].copy()
    return model


def get_params(model: LogisticRegression) -> list[np.ndarray]:
    return [model.coef_, model.intercept_]


def fit(model: LogisticRegression, x: np.ndarray, y: np.ndarray) -> LogisticRegression:
    """``max_iter`` lbfgs iterations from the model's coefficients (not run to convergence:
    the warning that says so is expected)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(x, y)
    return model
