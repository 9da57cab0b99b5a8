"""Convert fitted scikit-learn linear classifiers (and affine preprocessing) into probes.

Probes are usually trained offline with scikit-learn on cached activations. A probe is one
direction and one threshold, so only *binary linear* models convert, and any preprocessing in a
``Pipeline`` must be affine so that it can be folded into the direction exactly::

    decision(x) = T(x) @ w + b,  T(x) = x @ A + c   =>   decision(x) = x @ (A @ w) + (c @ w + b)

The resulting probe satisfies ``probe.decision_function(X) == estimator.decision_function(X)``
up to float32 rounding of the folded weights (the threshold ``-b`` stays float64).

Precision note: folding a centring step (``StandardScaler(with_mean=True)``, PCA) moves
``mean @ w`` into the threshold. The probe then computes ``x @ w'`` whose terms can be much larger
than the final margin when activations have large offsets, so float32 weights lose relative
precision there (error about ``6e-8 * sum_i |x_i w'_i|``). This is inherent to a probe that reads
raw activations; it is negligible unless offsets exceed the spread by orders of magnitude.

scikit-learn is imported lazily: it is an optional dependency (``dynsteer[sklearn]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .probe import MetadataValue, ModelFingerprint, Probe, ProbeSite

SUPPORTED_CLASSIFIERS = (
    "LogisticRegression, LogisticRegressionCV, LinearSVC, SGDClassifier, Perceptron, "
    "RidgeClassifier, RidgeClassifierCV, LinearDiscriminantAnalysis, SVC/NuSVC(kernel='linear')"
)
SUPPORTED_STEPS = (
    "StandardScaler, MinMaxScaler(clip=False), MaxAbsScaler(clip=False), PCA, IncrementalPCA, "
    "TruncatedSVD, 'passthrough', nested Pipeline"
)

_Affine = tuple[NDArray[np.float64], float]


def from_sklearn(
    estimator: Any,
    *,
    layer: int,
    hook: str = "post_block",
    sharpness: float | None = None,
    name: str | None = None,
    fingerprint: ModelFingerprint | None = None,
    metadata: Mapping[str, MetadataValue] | None = None,
) -> Probe:
    """Build a :class:`Probe` from a fitted binary linear classifier or ``Pipeline``.

    The probe fires (``decision_function > 0``) for ``estimator.classes_[1]``, the class that
    scikit-learn's ``decision_function`` is positive for; it is recorded in
    ``metadata["sklearn.positive_class"]``.

    ``sharpness`` defaults to 1.0, which makes ``probe.gate(X)`` equal to
    ``predict_proba(X)[:, 1]`` for ``LogisticRegression`` (and ``SGDClassifier(loss="log_loss")``);
    for margin-based models (SVMs, ridge) the gate is then just a squashed margin, and a
    calibrated sharpness is up to the caller. ``name`` defaults to the classifier's class name.

    Raises ``ValueError`` naming the estimator and the fix for unfitted or multiclass models,
    non-linear classifiers and non-affine pipeline steps.
    """
    try:
        import sklearn
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("from_sklearn needs scikit-learn: pip install 'dynsteer[sklearn]'") from e

    steps, head = _flatten(estimator)
    for label, step in [*steps, ("final estimator", head)]:
        _check_fitted(step, label)
    w, b, classes, default_sharpness = _linear_head(head)
    for label, step in reversed(steps):
        w, b = _fold_step(step, label, w, b)
    if not (np.isfinite(w).all() and np.isfinite(b)):
        raise ValueError(
            f"{_describe(estimator)} has non-finite coefficients after folding the pipeline; "
            "check the fitted model"
        )

    meta: dict[str, MetadataValue] = {
        "source": "sklearn",
        "sklearn.estimator": _describe(estimator),
        "sklearn.version": str(sklearn.__version__),
        "sklearn.positive_class": _meta_value(classes[1]),
        "sklearn.negative_class": _meta_value(classes[0]),
    }
    meta.update(metadata or {})
    return Probe(
        name=name if name is not None else type(head).__name__,
        weights=w,
        threshold=-b,
        sharpness=default_sharpness if sharpness is None else sharpness,
        site=ProbeSite(layer=layer, hook=hook),  # type: ignore[arg-type]  # validated here
        fingerprint=fingerprint,
        metadata=meta,
    )


# --- structure ----------------------------------------------------------------------------------


def _describe(estimator: Any) -> str:
    from sklearn.pipeline import Pipeline

    if isinstance(estimator, Pipeline):
        inner = ", ".join(_describe(s) for _, s in estimator.steps if not _is_passthrough(s))
        return f"Pipeline({inner})"
    return type(estimator).__name__


def _flatten(estimator: Any) -> tuple[list[tuple[str, Any]], Any]:
    """(preprocessing steps in order, final estimator), with nested pipelines inlined."""
    from sklearn.base import BaseEstimator
    from sklearn.pipeline import Pipeline

    if not isinstance(estimator, Pipeline):
        if not isinstance(estimator, BaseEstimator):
            raise ValueError(
                f"expected a fitted scikit-learn classifier or Pipeline, got "
                f"{type(estimator).__name__}"
            )
        return [], estimator
    steps = _pipeline_steps(estimator)
    if not steps or _is_passthrough(estimator.steps[-1][1]):
        raise ValueError(
            "Pipeline has no final classifier (its last step is 'passthrough'); end it with one "
            f"of: {SUPPORTED_CLASSIFIERS}"
        )
    return steps[:-1], steps[-1][1]


def _is_passthrough(step: Any) -> bool:
    return step is None or (isinstance(step, str) and step == "passthrough")


def _pipeline_steps(pipe: Any) -> list[tuple[str, Any]]:
    """All steps of ``pipe`` in order, skipping 'passthrough' and inlining nested pipelines."""
    from sklearn.pipeline import Pipeline

    out: list[tuple[str, Any]] = []
    for label, step in pipe.steps:
        if _is_passthrough(step):
            continue
        if isinstance(step, Pipeline):
            out.extend((f"{label}/{inner}", s) for inner, s in _pipeline_steps(step))
        else:
            out.append((label, step))
    return out


def _check_fitted(step: Any, label: str) -> None:
    from sklearn.exceptions import NotFittedError
    from sklearn.utils.validation import check_is_fitted

    try:
        check_is_fitted(step)
    except NotFittedError as e:
        where = "" if label == "final estimator" else f" (pipeline step {label!r})"
        raise ValueError(
            f"{type(step).__name__}{where} is not fitted; call .fit(X, y) on the estimator "
            "before converting it to a probe"
        ) from e
    except TypeError as e:  # not an estimator at all
        raise ValueError(
            f"pipeline step {label!r} is a {type(step).__name__}, not a scikit-learn estimator"
        ) from e


# --- the linear head ----------------------------------------------------------------------------


def _linear_head(est: Any) -> tuple[NDArray[np.float64], float, NDArray[Any], float]:
    """(w, b, classes_, default sharpness) with ``est.decision_function(X) == X @ w + b``."""
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    from sklearn.linear_model import (
        LogisticRegression,
        Perceptron,
        RidgeClassifier,
        RidgeClassifierCV,
        SGDClassifier,
    )
    from sklearn.svm import SVC, LinearSVC, NuSVC

    cls = type(est).__name__
    linear = (
        LogisticRegression,  # includes LogisticRegressionCV
        LinearSVC,
        SGDClassifier,
        Perceptron,
        RidgeClassifier,
        RidgeClassifierCV,
        LinearDiscriminantAnalysis,
    )
    if isinstance(est, SVC | NuSVC):
        if est.kernel != "linear":
            raise ValueError(
                f"{cls}(kernel={est.kernel!r}) is not a linear classifier, so it has no single "
                f"probe direction; refit with kernel='linear' or use LinearSVC"
            )
    elif not isinstance(est, linear):
        raise ValueError(
            f"{cls} is not a supported linear classifier: a probe is one direction w scored as "
            f"x @ w, so only binary linear models convert ({SUPPORTED_CLASSIFIERS}, optionally "
            f"after {SUPPORTED_STEPS} in a Pipeline); train e.g. LogisticRegression on the same "
            "activations"
        )

    classes = np.asarray(est.classes_)
    coef = est.coef_
    if hasattr(coef, "toarray"):  # sparsified models / SVC fitted on sparse data
        coef = coef.toarray()
    coef = np.asarray(coef, dtype=np.float64)
    if coef.ndim == 1:  # RidgeClassifier on binary targets stores a flat coef_
        coef = coef[np.newaxis, :]
    if classes.shape[0] != 2 or coef.ndim != 2 or coef.shape[0] != 1:
        raise ValueError(
            f"{cls} was fitted on {classes.shape[0]} classes {classes[:10].tolist()}; a probe "
            "scores one direction, so fit a binary classifier (e.g. one-vs-rest: "
            "y == target_class)"
        )
    intercept = np.ravel(np.asarray(est.intercept_, dtype=np.float64))
    b = float(intercept[0]) if intercept.size else 0.0

    default_sharpness = 1.0
    # scikit-learn < 1.8 with LogisticRegression(multi_class="multinomial") on two classes used
    # softmax([-d, d]) = sigmoid(2 d) in predict_proba; keep gate == predict_proba there too.
    if isinstance(est, LogisticRegression) and getattr(est, "multi_class", None) == "multinomial":
        default_sharpness = 2.0
    return coef[0], b, classes, default_sharpness


# --- folding affine preprocessing ----------------------------------------------------------------


def _fold_step(step: Any, label: str, w: NDArray[np.float64], b: float) -> _Affine:
    """Fold ``T(x) = x @ A + c`` into ``(w, b)``: returns ``(A @ w, c @ w + b)``."""
    from sklearn.decomposition import PCA, IncrementalPCA, TruncatedSVD
    from sklearn.preprocessing import MaxAbsScaler, MinMaxScaler, StandardScaler

    cls = type(step).__name__

    def out_width(n: int) -> None:
        if w.shape[0] != n:
            raise ValueError(
                f"pipeline step {label!r} ({cls}) outputs {n} features but the next step "
                f"expects {w.shape[0]}"
            )

    if isinstance(step, StandardScaler):  # (x - mean) / scale
        out_width(int(step.n_features_in_))
        w2 = w if step.scale_ is None else w / np.asarray(step.scale_, dtype=np.float64)
        mean = step.mean_ if step.with_mean else None
        shift = 0.0 if mean is None else float(np.asarray(mean, dtype=np.float64) @ w2)
        return w2, b - shift
    if isinstance(step, MinMaxScaler | MaxAbsScaler) and getattr(step, "clip", False):
        raise ValueError(
            f"pipeline step {label!r} is {cls}(clip=True), which clips and so is not affine; "
            "refit with clip=False to convert"
        )
    if isinstance(step, MinMaxScaler):  # x * scale + min
        out_width(int(step.n_features_in_))
        w2 = w * np.asarray(step.scale_, dtype=np.float64)
        return w2, b + float(np.asarray(step.min_, dtype=np.float64) @ w)
    if isinstance(step, MaxAbsScaler):  # x / scale
        out_width(int(step.n_features_in_))
        return w / np.asarray(step.scale_, dtype=np.float64), b
    if isinstance(step, PCA | IncrementalPCA):  # (x - mean) @ C.T [/ sqrt(var)]
        components = np.asarray(step.components_, dtype=np.float64)
        out_width(components.shape[0])
        v = w
        if step.whiten:
            # Same clipping as sklearn's _BasePCA._transform (eps of the fitted dtype).
            scale = np.sqrt(np.asarray(step.explained_variance_))
            scale = np.maximum(scale, np.finfo(scale.dtype).eps).astype(np.float64)
            v = w / scale
        w2 = components.T @ v
        return w2, b - float(np.asarray(step.mean_, dtype=np.float64) @ w2)
    if isinstance(step, TruncatedSVD):  # x @ C.T
        components = np.asarray(step.components_, dtype=np.float64)
        out_width(components.shape[0])
        return components.T @ w, b
    raise ValueError(
        f"pipeline step {label!r} is a {cls}, which is not an affine transform that can be folded "
        f"into a probe direction (supported: {SUPPORTED_STEPS}); drop the step or apply it "
        "outside the pipeline and train on its output in a way the engine can reproduce"
    )


def _meta_value(value: Any) -> MetadataValue:
    """A class label as a JSON scalar (numpy scalars unwrapped, anything else stringified)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool | int | str):
        return value
    if isinstance(value, float) and np.isfinite(value):
        return value
    return str(value)
