"""Chi-square tests without scipy (not a dependency): Wilson-Hilferty quantiles are close enough here."""

from __future__ import annotations

import math

Z_999 = 3.0902  # standard normal 0.999 quantile: tests fail by chance once in a thousand runs at most


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Approximate upper quantile of the chi-square distribution with ``df`` degrees of freedom."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def goodness_of_fit(counts: list[int], probs: list[float], min_expected: float = 5.0) -> tuple[float, float]:
    """Chi-square statistic of observed counts against exact probabilities (cells with a tiny expected
    count are merged into one), and the critical value it must stay below."""
    n = sum(counts)
    stat, df, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for c, p in zip(counts, probs):
        if n * p < min_expected:
            rest_obs += c
            rest_exp += n * p
            continue
        stat += (c - n * p) ** 2 / (n * p)
        df += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / max(rest_exp, 1e-9)
        df += 1
    return stat, chi2_critical(max(df, 1))


def two_sample(a: list[int], b: list[int]) -> tuple[float, float]:
    """Chi-square homogeneity statistic of two count vectors over the same cells, and its critical value."""
    na, nb = sum(a), sum(b)
    stat, df = 0.0, -1
    for x, y in zip(a, b):
        total = x + y
        if total == 0:
            continue
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
        df += 1
    return stat, chi2_critical(max(df, 1))
