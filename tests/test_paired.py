"""Paired tests of two models on the same documents (evals.paired) and the report table built from them
(memorization.paired), against hand computations."""
from __future__ import annotations

import math

import numpy as np
import pytest

from evals.mia import roc_metrics
from evals.paired import adjust, format_test, mcnemar, paired_auc, paired_difference
from memorization.experiments.averaging import table_specs
from memorization.paired import Question, paired_table, per_document
from memorize_core import ConfigError


def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_documents():
    a = [1, 1, 1, 1, 1, 1, 0, 1, 0, 0]
    b = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0]
    t = mcnemar(a, b)
    # 5 documents only a gets right, 1 only b: p = 2 * P(X <= 1), X ~ Bin(6, 1/2) = 2 * 7/64
    assert (t["a_only"], t["b_only"], t["n"]) == (5, 1, 10)
    assert t["p_value"] == pytest.approx(2 * 7 / 64)
    assert t["diff"] == pytest.approx(0.7 - 0.3) and t["rate_a"] == pytest.approx(0.7)
    # no discordant document: nothing tells the models apart
    assert mcnemar([True, False], [True, False])["p_value"] == 1.0
    # swapping the models swaps the counts and keeps p
    s = mcnemar(b, a)
    assert (s["a_only"], s["b_only"]) == (1, 5) and s["p_value"] == pytest.approx(t["p_value"])


def test_paired_difference_interval_and_permutation_p_match_their_definitions():
    rng = np.random.default_rng(1)
    b = rng.normal(size=40)
    a = b + 0.5 + 0.1 * rng.normal(size=40)
    t = paired_difference(a, b, resamples=2000, seed=3)
    d = a - b
    assert t["diff"] == pytest.approx(d.mean()) and t["n"] == 40
    # the percentile interval of the resampled means, resampled as the function documents
    idx = np.random.default_rng(3).integers(0, 40, (2000, 40))
    lo, hi = np.percentile(d[idx].mean(axis=1), [2.5, 97.5])
    assert t["ci"] == pytest.approx([lo, hi])
    # every difference positive, 40 documents: no random sign flip reaches the mean: p = 2 / (9,999 + 1)
    assert t["p_value"] == pytest.approx(2 / 10_000)
    # 10 documents: every one of the 2^10 flips; only "all +" and "all -" reach |mean|: p = 2 / 1024 exactly
    assert paired_difference(list(range(1, 11)), [0] * 10, resamples=10)["p_value"] == pytest.approx(2 / 1024)
    # the p is about the mean, as the interval is: many small drops and a few large gains, the mean up by
    # +0.386 near its interval's lower edge; a signed-rank test, led by the 30 drops, says p = 0.008
    skew = paired_difference([-0.05] * 30 + [3.0] * 5, [0.0] * 35, resamples=500)
    assert skew["diff"] > 0 and skew["ci"][0] > 0 and 0.02 < skew["p_value"] < 0.2
    # unchanged documents do not make a few small changes look surer: 5 of +1/16 among 40 zeros
    few = paired_difference([1 / 16] * 5 + [0.0] * 40, [0.0] * 45, resamples=10)
    assert few["p_value"] == pytest.approx(2 / 32, abs=0.01)
    same = paired_difference([0.3, 0.5, 0.9], [0.3, 0.5, 0.9], resamples=10)
    assert same["diff"] == 0 and same["ci"] == [0.0, 0.0] and same["p_value"] == 1.0


def test_paired_auc_resamples_both_models_on_one_draw():
    rng = np.random.default_rng(0)
    members, nonmembers = rng.normal(1.0, 1, 60), rng.normal(0.0, 1, 60)
    t = paired_auc(members, nonmembers, members * 0.2, nonmembers, resamples=500, seed=0)
    assert t["auc_a"] == pytest.approx(roc_metrics(members, nonmembers)["auc"])
    assert t["diff"] == pytest.approx(t["auc_a"] - t["auc_b"]) and t["ci"][0] <= t["diff"] <= t["ci"][1]
    # the same scores for both models: every resampled difference is 0, so the interval is [0, 0], p = 1
    same = paired_auc(members, nonmembers, members, nonmembers, resamples=50)
    assert same["diff"] == 0 and same["ci"] == [0.0, 0.0] and same["p_value"] == 1.0
    # a perfect attack against a constant score: +0.5 on every resample, no z; p is the smallest a relabelling
    # of 2 members and 2 non-members can give, 2 / C(4, 2), not 1 (no difference) or 0 (certainty)
    flat = paired_auc([2.0, 3.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], resamples=50)
    assert flat["diff"] == 0.5 and flat["ci"] == [0.5, 0.5] and flat["p_value"] == pytest.approx(2 / 6)
    # a monotone transform of the scores ranks alike: AUC unchanged, no difference
    monotone = paired_auc(members, nonmembers, np.exp(members), np.exp(nonmembers), resamples=50)
    assert monotone["diff"] == 0 and monotone["p_value"] == 1.0
    # scores that separate the classes much better: a small p
    strong = paired_auc(members + 5, nonmembers, members, nonmembers, resamples=500)
    assert strong["diff"] > 0.2 and strong["p_value"] < 1e-3


@pytest.mark.parametrize("call,field", [
    (lambda: mcnemar([1, 0], [1, 0, 1]), "b"),
    (lambda: mcnemar([1, 2], [1, 0]), "a"),
    (lambda: mcnemar([], []), "a"),
    (lambda: paired_difference([1.0, math.nan], [1.0, 2.0]), "a"),
    (lambda: paired_difference([1.0, 2.0], [1.0, 2.0], resamples=0), "resamples"),
    (lambda: paired_difference([1.0, 2.0], [1.0, 2.0], confidence=1.5), "confidence"),
    (lambda: paired_auc([1.0], [0.0, 0.5], [1.0, 2.0], [0.0, 0.5]), "members_b"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        call()


def test_benjamini_hochberg_and_the_cell():
    assert adjust([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.04 * 4 / 3, 0.04 * 4 / 3, 0.5])
    t = {"diff": -0.25, "ci": [-0.4, -0.1], "p_value": 0.002}
    assert format_test(t, "{:+.2f}", adjusted=0.01) == "-0.25 [-0.40, -0.10] p=0.002*"
    assert format_test(t, "{:+.2f}", adjusted=0.2) == "-0.25 [-0.40, -0.10] p=0.002"
    m = {"diff": -0.5, "a_only": 0, "b_only": 9, "p_value": 2 / 2 ** 9}
    assert format_test(m, "{:+.0%}") == "-50% (0 vs 9) p=0.0039*"
    assert format_test(None) == ""


def _answers(em, nll):
    return {"per_document": {"em": em, "nll": nll}}


def test_paired_table_tests_every_row_against_the_reference_and_adjusts_across_the_table():
    questions = [Question("em", "EM", "binary", per_document("em"), "{:+.0%}"),
                 Question("nll", "NLL", "number", per_document("nll"))]
    ref = _answers([1] * 12, [1.0 + 0.01 * i for i in range(12)])
    strong = _answers([0] * 12, [2.0 + 0.01 * i for i in range(12)])  # loses every copy, NLL +1 everywhere
    weak = _answers([1] * 11 + [0], [1.0 + 0.01 * i for i in range(12)])
    old = {"mia": {}}  # answers cached before per-document scores: no row
    answers = {"none": ref, "goldfish": strong, "other": weak, "stale": old}
    table, tests, notes = paired_table(answers, [(n, "none") for n in answers if n != "none"], questions,
                                       resamples=200)
    assert [r["arm"] for r in table["rows"]] == ["goldfish", "other"] and table["index"] == ("arm",)
    assert tests["goldfish"]["em"]["b_only"] == 12 and tests["goldfish"]["em"]["p_value"] == pytest.approx(
        2 / 2 ** 12)
    assert tests["other"]["nll"]["p_value"] == 1.0 and tests["other"]["em"]["p_value"] == 1.0
    ps = [tests[n][k]["p_value"] for n in ("goldfish", "other") for k in ("em", "nll")]
    assert [tests[n][k]["p_adjusted"] for n in ("goldfish", "other") for k in ("em", "nll")] == \
        pytest.approx(adjust(ps))
    assert table["rows"][0]["em"].endswith("*") and not table["rows"][1]["em"].endswith("*")
    assert "Benjamini-Hochberg" in notes[0]
    # a reference without per-document answers: no table, and a note that says how to get one
    none_table, _, why = paired_table({"none": old, "goldfish": strong}, [("goldfish", "none")], questions,
                                      missing="rerun the sub-runs")
    assert none_table is None and "per-document" in why[0] and "rerun the sub-runs" in why[0]
    # rows against their own references (one per model size): a column says which
    two, tests, _ = paired_table({"a": ref, "b": strong, "c": ref, "d": weak}, [("b", "a"), ("d", "c")],
                                 questions, label="run", resamples=50)
    assert [(r["run"], r["reference"]) for r in two["rows"]] == [("b", "a"), ("d", "c")]
    assert tests["d"]["em"]["reference"] == "c" and "its reference" in two["title"]


def test_a_column_too_small_for_any_outcome_to_be_significant_is_named():
    """5 items: even all five lost gives p = 2/32 >= 0.05, and the note says so; 6 items can decide."""
    questions = [Question("em", "EM duplicated", "binary", per_document("em"), "{:+.0%}"),
                 Question("nll", "exposure", "number", per_document("nll"))]
    five = {"ref": _answers([1] * 5, [9.0] * 6), "row": _answers([0] * 5, [1.0, 2, 3, 4, 5, 6])}
    _, tests, notes = paired_table(five, [("row", "ref")], questions, resamples=50)
    assert tests["row"]["em"]["p_value"] == pytest.approx(2 / 32)
    assert tests["row"]["nll"]["p_value"] == pytest.approx(2 / 64)  # 6 items, every one lower: decides
    few = [n for n in notes if n.startswith("Too few items")]
    assert len(few) == 1 and "'EM duplicated' (5 items: p >= 0.0625)" in few[0] and "exposure" not in few[0]
    six = {"ref": _answers([1] * 6, [9.0] * 6), "row": _answers([0] * 6, [1.0] * 6)}
    assert not any(n.startswith("Too few") for n in paired_table(six, [("row", "ref")], questions,
                                                                 resamples=50)[2])


def test_replicates_leave_per_seed_tables_out():
    report = {"tables": {"Arms": [{"arm": "none"}], "Paired tests": [{"arm": "goldfish", "em": "p=0.1"}]},
              "table_specs": {"Arms": {"columns": [["arm", "arm", "{}"]], "index": ["arm"]},
                              "Paired tests": {"columns": [["arm", "arm", "{}"]], "index": ["arm"],
                                               "per_seed": True}}}
    assert list(table_specs([report, report])) == ["Arms"]
