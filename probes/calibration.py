"""Threshold calibration on held-out negatives.

A probe trained with a classification loss puts its threshold where the training classes balance,
which is rarely where a deployment wants it: steering that fires on benign traffic is the costly
error. :func:`calibrate_threshold` moves only the threshold so that at most a chosen fraction of
known-negative activations fire; the direction (and therefore the ranking of tokens) is unchanged.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from .probe import Probe


def calibrate_threshold(probe: Probe, negatives: ArrayLike, target_fpr: float) -> Probe:
    """A copy of ``probe`` whose threshold lets at most ``target_fpr`` of ``negatives`` fire.

    "Fire" means ``score > threshold`` (``decision_function > 0``, ``gate > 0.5``). With ``n``
    negatives the allowed count is ``k = floor(target_fpr * n)`` and the new threshold is the
    ``(k+1)``-th largest negative score: the lowest threshold (hence the most sensitive probe)
    that meets the bound on these negatives.

    Ties: a score *equal* to the threshold does not fire. If several negatives share the cut
    score, all of them are kept below the bar, so the achieved rate may be below the target
    (never above it). With few negatives the rate is coarse (steps of ``1/n``); ``target_fpr=0``
    puts the threshold at the highest negative score.

    The returned probe records ``calibration.target_fpr``, ``calibration.fpr`` (achieved on these
    negatives) and ``calibration.n_negatives`` in its metadata. Use negatives that were not used
    for training, or the rate will be optimistic on new data.

    Raises ``ValueError`` for a ``target_fpr`` outside ``[0, 1)``, an empty or non-2-D
    ``negatives``, a width other than the probe's hidden size, or non-finite scores.
    """
    if isinstance(target_fpr, bool) or not isinstance(target_fpr, int | float | np.floating):
        raise ValueError(f"target_fpr must be a number in [0, 1), got {target_fpr!r}")
    target = float(target_fpr)
    if not (math.isfinite(target) and 0.0 <= target < 1.0):
        raise ValueError(f"target_fpr must be in [0, 1), got {target_fpr!r}")
    x = np.asarray(negatives)
    if x.ndim != 2:
        raise ValueError(
            f"negatives must be a 2-D array (n_samples, {probe.hidden_size}), got shape {x.shape}"
        )
    n = x.shape[0]
    if n == 0:
        raise ValueError("negatives is empty; calibration needs at least one held-out negative")
    scores = probe.score(x)
    if not np.isfinite(scores).all():
        raise ValueError("negatives give non-finite scores (NaN/inf in the activations?)")

    allowed = math.floor(target * n)
    if (allowed + 1) / n <= target:  # guard against floor(0.29 * 100) == 28 style rounding
        allowed += 1
    descending = np.sort(scores)[::-1]
    threshold = float(descending[allowed])  # allowed <= n - 1 because target < 1
    achieved = float(np.count_nonzero(scores > threshold)) / n
    metadata = {
        **probe.metadata,
        "calibration.target_fpr": target,
        "calibration.fpr": achieved,
        "calibration.n_negatives": int(n),
    }
    return probe.replace(threshold=threshold, metadata=metadata)
