"""Intervals over streams (pure): the 95% interval of a mean over a few streams or episodes.

Every report's "± a 95% interval" is Student's t with n - 1 degrees of freedom times the
standard error: with 5 streams 2.78 standard errors, where the normal quantile's 1.96
would cover about 88% and call ties "beats". Selections that compare choices by a fixed
threshold instead (the training side's teacher picks) use :func:`standard_error` with
their own multiple.
"""

from __future__ import annotations

import math

import numpy as np

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t 0.975 quantiles for 1-30 degrees of freedom, to three decimals (the
standard table, e.g. Abramowitz & Stegun, table 26.10)."""
_Z975 = 1.959964
"""The normal distribution's 0.975 quantile: the limit of t as the degrees of freedom grow."""


def t975(df: int) -> float:
    """Student's t 0.975 quantile for ``df`` degrees of freedom: the table up to 30, then
    the Cornish-Fisher expansion in 1/df (Abramowitz & Stegun 26.7.5, first two terms;
    within 1e-4 of the exact value from 31 on)."""
    if df < 1:
        raise ValueError(f"df: got {df}, must be >= 1")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def standard_error(values) -> float:
    """The standard error of the mean of ``values`` (sample sd / sqrt n); 0 with fewer
    than two values."""
    v = np.asarray(values, dtype=float)
    return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0


def ci95_half(values) -> float:
    """Half-width of the 95% interval of the mean of ``values``: Student's t with n - 1
    degrees of freedom times the standard error; 0 with fewer than two values."""
    n = len(values)
    return t975(n - 1) * standard_error(values) if n > 1 else 0.0
