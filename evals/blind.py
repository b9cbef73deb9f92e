"""A blind baseline for membership inference: how well the texts alone tell members from non-members.

A model-free classifier (Das et al. 2024, "Blind Baselines Beat Membership Inference Attacks for
Foundation Models") sees only the documents: word 1-2-gram and character 2-4-gram TF-IDF features,
an L2-regularised logistic regression, scored out of fold by stratified k-fold cross-validation, so
every document's score comes from a classifier that never saw it. Its ROC AUC (with the same
stratified bootstrap CI as the attacks, evals.mia.bootstrap_ci) measures the distribution shift
between the two sets. Near 0.5 the sets are alike and an attack's AUC is about membership; far
above it, an attack's AUC measures the shift as much as the model (Duan et al. 2024, MIMIR: attacks
fall to chance once members and non-members come from one distribution).

SHIFT_AUC is the warning threshold on the CI's lower bound (the point estimate without a CI): 0.6.
With the 40-100 documents per side these evaluations have, a same-distribution pair's blind AUC
spreads about +-0.1 around 0.5 (so a point estimate would raise false alarms), while a lower bound
above 0.6 says, at 95%, that a text classifier separates the sets better than 60/40: beyond what
sampling noise gives, and large enough to explain a reported attack AUC by itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from evals.mia import bootstrap_ci, roc_metrics
from memorize_core import fail

SHIFT_AUC = 0.6  # warn when the blind baseline's AUC (CI lower bound) exceeds this: see the docstring
FOLDS = 5


def blind_scores(members: Sequence[str], nonmembers: Sequence[str], *, folds: int = FOLDS,
                 seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Out-of-fold member probabilities of a text-only classifier (members, non-members)."""
    from scipy.sparse import hstack  # deferred: sklearn's text stack is only needed here
    from sklearn.feature_extraction.text import TfidfVectorizer  # deferred: +1-12 s, only the baseline
    from sklearn.linear_model import LogisticRegression  # deferred: as above
    from sklearn.model_selection import StratifiedKFold  # deferred: as above

    if len(members) < 2 or len(nonmembers) < 2:
        raise fail("members/nonmembers", f"{len(members)}/{len(nonmembers)} documents",
                   "the blind baseline cross-validates: pass at least 2 of each")
    texts = [str(t) for t in members] + [str(t) for t in nonmembers]
    y = np.r_[np.ones(len(members)), np.zeros(len(nonmembers))]
    k = max(2, min(folds, len(members), len(nonmembers)))
    out = np.zeros(len(texts))
    for train, test in StratifiedKFold(k, shuffle=True, random_state=seed).split(texts, y):
        # features fitted on the training fold only: the held-out fold's vocabulary stays unseen
        word = TfidfVectorizer(analyzer="word", ngram_range=(1, 2), min_df=1, sublinear_tf=True)
        char = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), min_df=1, sublinear_tf=True)
        fit = [texts[i] for i in train]
        x_train = hstack([word.fit_transform(fit), char.fit_transform(fit)]).tocsr()
        held = [texts[i] for i in test]
        x_test = hstack([word.transform(held), char.transform(held)]).tocsr()
        clf = LogisticRegression(C=1.0, max_iter=1000)
        clf.fit(x_train, y[train])
        out[test] = clf.decision_function(x_test)
    return out[:len(members)], out[len(members):]


def blind_baseline(members: Sequence[str], nonmembers: Sequence[str], *, bootstrap: int = 1000,
                   seed: int = 0, folds: int = FOLDS) -> dict[str, Any]:
    """ROC metrics (+ bootstrap CIs) of the text-only classifier, and whether it signals a shift."""
    m, n = blind_scores(members, nonmembers, folds=folds, seed=seed)
    out: dict[str, Any] = roc_metrics(m, n)
    if bootstrap:
        out.update(bootstrap_ci(m, n, resamples=bootstrap, seed=seed))
    low = out["auc_ci"][0] if "auc_ci" in out else out["auc"]
    out.update({"folds": max(2, min(folds, len(members), len(nonmembers))), "threshold": SHIFT_AUC,
                "shifted": bool(low > SHIFT_AUC)})
    return out


def shift_warning(blind: dict[str, Any], members: str, nonmembers: str) -> str | None:
    """The one-line warning for a blind baseline far from chance, else None."""
    if not blind.get("shifted"):
        return None
    ci = blind.get("auc_ci")
    where = f"{blind['auc']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
    return (f"warning: a model-free text classifier tells {members} from {nonmembers} with AUC {where} "
            f"(> {blind['threshold']}): the sets differ in distribution, so the attacks' AUCs measure that "
            "shift, not membership; use non-members from the members' own distribution")
