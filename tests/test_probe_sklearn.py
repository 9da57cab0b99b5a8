"""scikit-learn -> Probe conversion: exactness, pipelines with affine steps, clear rejections."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sklearn")

from sklearn.base import clone
from sklearn.decomposition import PCA, IncrementalPCA, TruncatedSVD
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.ensemble import RandomForestClassifier
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import (
    LinearRegression,
    LogisticRegression,
    LogisticRegressionCV,
    Perceptron,
    RidgeClassifier,
    RidgeClassifierCV,
    SGDClassifier,
)
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import (
    MaxAbsScaler,
    MinMaxScaler,
    Normalizer,
    PolynomialFeatures,
    StandardScaler,
)
from sklearn.svm import SVC, LinearSVC, NuSVC

from dynsteer.probes import ModelFingerprint, Probe, from_sklearn

D = 12


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two shifted Gaussian classes with uneven feature scales/offsets (so scalers matter),
    string labels (so the positive class is checked by name), and a held-out evaluation set."""
    rng = np.random.default_rng(0)
    n = 400
    y = np.where(rng.random(n) < 0.45, "pos", "neg")
    scales = rng.uniform(0.3, 4.0, D)
    offsets = rng.uniform(-3.0, 3.0, D)
    direction = rng.standard_normal(D)
    X = rng.standard_normal((n, D)) * scales + offsets + np.outer(y == "pos", direction)
    X_eval = rng.standard_normal((200, D)) * scales * 1.5 + offsets
    return X, y, X_eval


def assert_decision_matches(probe: Probe, est: Any, X: np.ndarray) -> None:
    """1e-5 relative to the scale of the decision values (elementwise rtol is meaningless for
    points on the boundary, where the true value is ~0)."""
    want = est.decision_function(X)
    got = probe.decision_function(X)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))


CLASSIFIERS: dict[str, Callable[[], Any]] = {
    "logreg": lambda: LogisticRegression(C=0.5, max_iter=1000),
    "logreg_no_intercept": lambda: LogisticRegression(fit_intercept=False, max_iter=1000),
    "logreg_cv": lambda: LogisticRegressionCV(Cs=3, cv=3, max_iter=1000),
    "linear_svc": lambda: LinearSVC(C=0.1, max_iter=20_000),
    "linear_svc_no_intercept": lambda: LinearSVC(fit_intercept=False, max_iter=20_000),
    "sgd_hinge": lambda: SGDClassifier(random_state=0, max_iter=2000, tol=1e-4),
    "sgd_log": lambda: SGDClassifier(loss="log_loss", random_state=0, average=True),
    "perceptron": lambda: Perceptron(random_state=0),
    "ridge": lambda: RidgeClassifier(alpha=2.0),
    "ridge_cv": lambda: RidgeClassifierCV(),
    "lda_svd": lambda: LinearDiscriminantAnalysis(),
    "lda_lsqr": lambda: LinearDiscriminantAnalysis(solver="lsqr", shrinkage="auto"),
    "lda_eigen": lambda: LinearDiscriminantAnalysis(solver="eigen"),
    "svc_linear": lambda: SVC(kernel="linear", C=0.1),
    "nusvc_linear": lambda: NuSVC(kernel="linear", nu=0.3),
}

PREPROCESSING: dict[str, Callable[[], list[Any]]] = {
    "none": lambda: [],
    "standard": lambda: [StandardScaler()],
    "standard_no_mean": lambda: [StandardScaler(with_mean=False)],
    "standard_no_std": lambda: [StandardScaler(with_std=False)],
}


def _fit(est: Any, X: np.ndarray, y: np.ndarray) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        warnings.simplefilter("ignore", FutureWarning)  # LogisticRegressionCV's changing defaults
        return est.fit(X, y)


@pytest.mark.parametrize("prep", PREPROCESSING)
@pytest.mark.parametrize("clf", CLASSIFIERS)
def test_conversion_is_exact(data, clf: str, prep: str) -> None:  # type: ignore[no-untyped-def]
    X, y, X_eval = data
    steps = PREPROCESSING[prep]()
    est = CLASSIFIERS[clf]()
    model = _fit(make_pipeline(*steps, est) if steps else est, X, y)
    probe = from_sklearn(model, layer=3)
    assert_decision_matches(probe, model, X_eval)
    assert_decision_matches(probe, model, X)
    # The probe fires exactly where sklearn predicts the positive class (off the boundary).
    margin = np.abs(model.decision_function(X_eval)) > 1e-4 * np.max(np.abs(X_eval))
    predicted_pos = model.predict(X_eval) == "pos"
    np.testing.assert_array_equal(
        (probe.decision_function(X_eval) > 0)[margin], predicted_pos[margin]
    )
    assert probe.metadata["sklearn.positive_class"] == "pos"
    assert probe.metadata["sklearn.negative_class"] == "neg"
    assert probe.threshold == pytest.approx(-_folded_intercept(model))
    assert probe.weights.dtype == np.float32 and probe.hidden_size == D


def _folded_intercept(model: Any) -> float:
    """The pipeline's decision at x = 0 is exactly its folded intercept."""
    return float(model.decision_function(np.zeros((1, D)))[0])


@pytest.mark.parametrize("prep", ["none", "standard"])
def test_logistic_regression_gate_is_predict_proba(data, prep: str) -> None:  # type: ignore[no-untyped-def]
    X, y, X_eval = data
    model = make_pipeline(*PREPROCESSING[prep](), LogisticRegression(max_iter=1000)).fit(X, y)
    probe = from_sklearn(model, layer=0)
    assert probe.sharpness == 1.0
    np.testing.assert_allclose(probe.gate(X_eval), model.predict_proba(X_eval)[:, 1], atol=1e-6)


def test_sgd_log_loss_gate_is_predict_proba(data) -> None:  # type: ignore[no-untyped-def]
    X, y, X_eval = data
    model = SGDClassifier(loss="log_loss", random_state=0).fit(X, y)
    probe = from_sklearn(model, layer=0)
    np.testing.assert_allclose(probe.gate(X_eval), model.predict_proba(X_eval)[:, 1], atol=1e-6)


AFFINE_PIPELINES: dict[str, Callable[[], list[Any]]] = {
    "minmax": lambda: [MinMaxScaler(feature_range=(-2, 3))],
    "maxabs": lambda: [MaxAbsScaler()],
    "pca": lambda: [PCA(n_components=8)],
    "pca_whiten": lambda: [StandardScaler(), PCA(n_components=8, whiten=True)],
    "incremental_pca": lambda: [IncrementalPCA(n_components=6, whiten=True)],
    "truncated_svd": lambda: [TruncatedSVD(n_components=5, random_state=0)],
    "two_scalers": lambda: [StandardScaler(), MinMaxScaler()],
    "passthrough": lambda: ["passthrough", StandardScaler()],
    "nested": lambda: [make_pipeline(StandardScaler(), PCA(n_components=7)), MaxAbsScaler()],
}


@pytest.mark.parametrize("steps", AFFINE_PIPELINES)
def test_other_affine_steps_fold_exactly(data, steps: str) -> None:  # type: ignore[no-untyped-def]
    X, y, X_eval = data
    model = make_pipeline(*AFFINE_PIPELINES[steps](), LogisticRegression(max_iter=1000)).fit(X, y)
    probe = from_sklearn(model, layer=1)
    assert probe.hidden_size == D
    assert_decision_matches(probe, model, X_eval)
    np.testing.assert_allclose(probe.gate(X_eval), model.predict_proba(X_eval)[:, 1], atol=1e-6)


def test_nested_pipeline_as_final_step(data) -> None:  # type: ignore[no-untyped-def]
    X, y, X_eval = data
    inner = make_pipeline(StandardScaler(), LogisticRegression())
    model = Pipeline([("maxabs", MaxAbsScaler()), ("model", inner)]).fit(X, y)
    probe = from_sklearn(model, layer=1)
    assert_decision_matches(probe, model, X_eval)
    assert probe.metadata["sklearn.estimator"] == (
        "Pipeline(MaxAbsScaler, Pipeline(StandardScaler, LogisticRegression))"
    )


def test_float32_training_data(data) -> None:  # type: ignore[no-untyped-def]
    X, y, X_eval = data
    model = make_pipeline(StandardScaler(), LogisticRegression()).fit(X.astype(np.float32), y)
    probe = from_sklearn(model, layer=1)
    assert_decision_matches(probe, model, X_eval.astype(np.float32))


def test_positive_class_is_classes_1(data) -> None:  # type: ignore[no-untyped-def]
    X, y, X_eval = data
    y_int = np.where(y == "pos", 7, 3)  # classes_ == [3, 7]
    model = LogisticRegression().fit(X, y_int)
    probe = from_sklearn(model, layer=0)
    assert probe.metadata["sklearn.positive_class"] == 7
    assert type(probe.metadata["sklearn.positive_class"]) is int
    y_bool = y == "neg"  # classes_ == [False, True]: the probe detects "neg" now
    flipped = from_sklearn(LogisticRegression().fit(X, y_bool), layer=0)
    assert flipped.metadata["sklearn.positive_class"] is True
    assert np.corrcoef(probe.score(X_eval), flipped.score(X_eval))[0, 1] < -0.99


def test_options_and_metadata(data) -> None:  # type: ignore[no-untyped-def]
    X, y, _ = data
    model = make_pipeline(StandardScaler(), LogisticRegression()).fit(X, y)
    fp = ModelFingerprint(architecture="GPT2LMHeadModel", hidden_size=D, num_layers=12)
    probe = from_sklearn(
        model,
        layer=11,
        hook="pre_attn",
        sharpness=4.0,
        name="honesty-v2",
        fingerprint=fp,
        metadata={"dataset": "tqa", "source": "mine"},
    )
    assert probe.name == "honesty-v2" and probe.sharpness == 4.0
    assert probe.site.layer == 11 and probe.site.hook == "pre_attn"
    assert probe.fingerprint == fp
    assert probe.metadata["dataset"] == "tqa" and probe.metadata["source"] == "mine"
    assert probe.metadata["sklearn.estimator"] == "Pipeline(StandardScaler, LogisticRegression)"
    assert from_sklearn(model, layer=0).name == "LogisticRegression"
    # The converted probe survives both serialisations.
    assert Probe.from_json_dict(probe.to_json_dict()) == probe


def test_legacy_binary_multinomial_logreg_default_sharpness(data) -> None:  # type: ignore[no-untyped-def]
    """sklearn < 1.8 computed predict_proba as sigmoid(2 d) for multi_class='multinomial'."""
    X, y, _ = data
    model = LogisticRegression().fit(X, y)
    model.multi_class = "multinomial"  # what such a model looks like on old versions
    assert from_sklearn(model, layer=0).sharpness == 2.0
    assert from_sklearn(model, layer=0, sharpness=1.0).sharpness == 1.0


@pytest.mark.parametrize(
    ("layer", "hook", "match"),
    [(-1, "post_block", "layer"), (0, "resid", "hook"), (0, "post_mlp", "hook")],
)
def test_bad_site(data, layer: int, hook: str, match: str) -> None:  # type: ignore[no-untyped-def]
    X, y, _ = data
    with pytest.raises(ValueError, match=match):
        from_sklearn(LogisticRegression().fit(X, y), layer=layer, hook=hook)


def test_bad_fingerprint_for_estimator(data) -> None:  # type: ignore[no-untyped-def]
    X, y, _ = data
    fp = ModelFingerprint(architecture="A", hidden_size=D + 1, num_layers=4)
    with pytest.raises(ValueError, match="hidden_size"):
        from_sklearn(LogisticRegression().fit(X, y), layer=0, fingerprint=fp)


# --- rejections ----------------------------------------------------------------------------------


def test_rejects_multiclass(data) -> None:  # type: ignore[no-untyped-def]
    X, _, _ = data
    y3 = np.arange(len(X)) % 3
    for est in (LogisticRegression(max_iter=500), LinearSVC(), LinearDiscriminantAnalysis()):
        model = _fit(make_pipeline(StandardScaler(), est), X, y3)
        with pytest.raises(ValueError, match=type(est).__name__ + r" was fitted on 3 classes") as e:
            from_sklearn(model, layer=0)
        assert "binary" in str(e.value) and "one-vs-rest" in str(e.value)


@pytest.mark.parametrize(
    "model",
    [
        LogisticRegression(),
        make_pipeline(StandardScaler(), LogisticRegression()),
        LinearDiscriminantAnalysis(),
    ],
    ids=["logreg", "pipeline", "lda"],
)
def test_rejects_unfitted(model: Any) -> None:
    with pytest.raises(ValueError, match=r"is not fitted; call \.fit\(X, y\)"):
        from_sklearn(clone(model), layer=0)


def test_rejects_unfitted_step_in_fitted_pipeline(data) -> None:  # type: ignore[no-untyped-def]
    X, y, _ = data
    clf = LogisticRegression().fit(X, y)
    model = Pipeline([("scale", StandardScaler()), ("clf", clf)])  # assembled, never fitted
    with pytest.raises(ValueError, match=r"StandardScaler \(pipeline step 'scale'\) is not fitted"):
        from_sklearn(model, layer=0)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SVC(kernel="rbf"), r"SVC\(kernel='rbf'\) is not a linear classifier"),
        (lambda: NuSVC(kernel="poly"), r"NuSVC\(kernel='poly'\)"),
        (lambda: RandomForestClassifier(n_estimators=3), "RandomForestClassifier is not a supp"),
        (lambda: KNeighborsClassifier(), "KNeighborsClassifier is not a supported linear"),
        (lambda: LinearRegression(), "LinearRegression is not a supported linear classifier"),
    ],
)
def test_rejects_non_linear_estimators(data, make, match: str) -> None:  # type: ignore[no-untyped-def]
    X, y, _ = data
    yy = (y == "pos").astype(float) if match.startswith("LinearRegression") else y
    with pytest.raises(ValueError, match=match) as e:
        from_sklearn(make().fit(X, yy), layer=0)
    assert "LogisticRegression" in str(e.value) or "linear" in str(e.value)


@pytest.mark.parametrize(
    ("step", "match", "fix"),
    [
        (Normalizer(), "'normalizer' is a Normalizer, which is not an affine", "StandardScaler"),
        (PolynomialFeatures(2), "PolynomialFeatures, which is not an affine", "StandardScaler"),
        (MinMaxScaler(clip=True), r"MinMaxScaler\(clip=True\), which clips", "clip=False"),
        (MaxAbsScaler(clip=True), r"MaxAbsScaler\(clip=True\), which clips", "clip=False"),
    ],
)
def test_rejects_non_affine_pipeline_steps(data, step: Any, match: str, fix: str) -> None:  # type: ignore[no-untyped-def]
    X, y, _ = data
    model = make_pipeline(StandardScaler(), step, LogisticRegression(max_iter=1000)).fit(X, y)
    with pytest.raises(ValueError, match=match) as e:
        from_sklearn(model, layer=0)
    assert fix in str(e.value)  # the message says what would work


def test_rejects_pipeline_without_classifier(data) -> None:  # type: ignore[no-untyped-def]
    X, y, _ = data
    model = Pipeline([("scale", StandardScaler()), ("clf", "passthrough")]).fit(X, y)
    with pytest.raises(ValueError, match="no final classifier"):
        from_sklearn(model, layer=0)
    with pytest.raises(ValueError, match="StandardScaler is not a supported linear classifier"):
        from_sklearn(StandardScaler().fit(X), layer=0)


@pytest.mark.parametrize("obj", [None, np.ones((2, 2)), "LogisticRegression"])
def test_rejects_non_estimators(obj: object) -> None:
    with pytest.raises(ValueError, match="expected a fitted scikit-learn classifier"):
        from_sklearn(obj, layer=0)
