"""Synthetic(alpha, beta) of FedProx (Li et al. 2020, Sec. 5.1 and appendix) / LEAF.

Each user k has its own softmax-regression model and its own input distribution:

    u_k ~ N(0, alpha),  B_k ~ N(0, beta)
    W_k ~ N(u_k, 1)  [dim x num_classes],   b_k ~ N(u_k, 1)  [num_classes]
    v_k ~ N(B_k, 1)  [dim]
    x ~ N(v_k, Sigma),  Sigma diagonal with Sigma_jj = j^(-1.2)  (j = 1..dim)
    y = argmax(softmax(x W_k + b_k))

alpha controls how much the local models differ, beta how much the local inputs differ.
As in the reference code, alpha and beta are used as standard deviations (identical for
the default alpha = beta = 1). Samples per user follow the reference power law
``lognormal(4, 2) + 50``, capped at ``max_samples``.
"""

from __future__ import annotations

import numpy as np


def make_synthetic(
    alpha: float,
    beta: float,
    num_users: int,
    dim: int,
    num_classes: int,
    rng: np.random.Generator,
    *,
    min_samples: int = 50,
    max_samples: int = 1000,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draw a Synthetic(alpha, beta) dataset; a pure function of its arguments.

    Returns ``(x float32 [N, dim], y int64 [N], user int64 [N])`` with rows grouped by
    user (user 0 first); N = sum of per-user sample counts.
    """
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got {alpha}, {beta}")
    if num_users < 1 or dim < 1 or num_classes < 2:
        raise ValueError(
            f"need num_users >= 1, dim >= 1, num_classes >= 2; got {num_users}, {dim}, "
            f"{num_classes}"
        )
    if not 1 <= min_samples <= max_samples:
        raise ValueError(f"need 1 <= min_samples <= max_samples, got {min_samples}, {max_samples}")

    sizes = rng.lognormal(4, 2, num_users).astype(np.int64) + min_samples
    sizes = np.minimum(sizes, max_samples)
    u = rng.normal(0.0, alpha, num_users)  # mean of W_k and b_k
    big_b = rng.normal(0.0, beta, num_users)  # mean of v_k
    v = rng.normal(big_b[:, None], 1.0, (num_users, dim))  # per-user input mean
    std_x = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2 / 2)  # sqrt(Sigma_jj)

    xs, ys, users = [], [], []
    for k in range(num_users):
        w = rng.normal(u[k], 1.0, (dim, num_classes))
        b = rng.normal(u[k], 1.0, num_classes)
        x = v[k] + rng.standard_normal((int(sizes[k]), dim)) * std_x
        # argmax(softmax(z)) == argmax(z): the softmax is monotone.
        y = np.argmax(x @ w + b, axis=1)
        xs.append(x)
        ys.append(y)
        users.append(np.full(int(sizes[k]), k, dtype=np.int64))
    return (
        np.concatenate(xs).astype(np.float32),
        np.concatenate(ys).astype(np.int64),
        np.concatenate(users),
    )
