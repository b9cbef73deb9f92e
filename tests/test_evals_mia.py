"""Membership-inference scores: ROC metrics, Min-K%, Min-K%++ by brute force, end to end."""
import zlib

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from transformers import LlamaConfig, LlamaForCausalLM

from evals import membership_inference, min_k_mean, roc_metrics, score_sequences, sequence_logprobs
from evals.mia import bootstrap_ci, mia_metrics, roc_on_resamples
from memorize_core import ConfigError

torch.set_num_threads(1)


def tiny_llama(vocab: int = 64, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def ragged(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_auc_equals_sklearn():
    rng = np.random.default_rng(0)
    members, nonmembers = rng.normal(0.5, 1, 300), rng.normal(0, 1, 500)
    got = roc_metrics(members, nonmembers)
    want = roc_auc_score(np.r_[np.ones(300), np.zeros(500)], np.r_[members, nonmembers])
    assert got["auc"] == pytest.approx(want, abs=1e-12)


def test_tpr_at_fpr_hand_made():
    nonmembers = np.arange(1000.0)  # 0..999
    members = np.r_[[2000.0] * 5,  # above every non-member
                    [998.5] * 5,  # above all but one non-member: FPR 0.001
                    [991.5] * 10,  # 8 non-members above (992..999): FPR 0.008
                    [-1.0] * 80]  # below everything
    got = roc_metrics(members, nonmembers)
    assert got["tpr_at_0.1pct_fpr"] == pytest.approx(0.10)
    assert got["tpr_at_1pct_fpr"] == pytest.approx(0.20)
    # AUC by hand: P(member > non-member) = (5*1000 + 5*999 + 10*992 + 80*0) / (100*1000).
    assert got["auc"] == pytest.approx((5000 + 4995 + 9920) / 100_000)


def test_roc_rejects_bad_input():
    with pytest.raises(ConfigError, match="member_scores"):
        roc_metrics([], [1.0])
    with pytest.raises(ConfigError, match="nonmember_scores"):
        roc_metrics([1.0], [np.nan])


def test_min_k_hand_checked():
    v = [-1, -5, -2, -8, -3, -0.5, -4, -6, -7, -9]
    assert min_k_mean(v, 0.2) == pytest.approx(-8.5)  # lowest 2: -9, -8
    assert min_k_mean(v, 0.5) == pytest.approx(-7.0)  # lowest 5: -9..-5
    assert min_k_mean(v, 1.0) == pytest.approx(np.mean(v))
    assert min_k_mean([-1, -3, -2], 0.2) == -3  # int(0.6) = 0 -> at least one value


def test_loss_zlib_min_k_match_unbatched_logprobs():
    model = tiny_llama()
    seqs = ragged(7, 64, seed=1)  # ragged lengths exercise padding and length-sorting
    got = score_sequences(model, seqs, batch_size=3, k=0.3)
    for i, s in enumerate(seqs):
        lp = sequence_logprobs(model, torch.tensor([s]))[0].double().numpy()
        zlen = len(zlib.compress(" ".join(map(str, s)).encode()))
        assert got["loss"][i] == pytest.approx(lp.mean(), abs=1e-5)
        assert got["zlib"][i] == pytest.approx(lp.mean() / zlen, abs=1e-6)
        assert got["min_k"][i] == pytest.approx(np.sort(lp)[:max(1, int(0.3 * len(lp)))].mean(), abs=1e-5)
    assert "ref_ratio" not in got


def test_starts_score_only_the_tokens_after_them_in_context():
    # a chat response given its prompt: every statistic reads tokens start..L-1, scored with the prompt in
    # context; zlib compresses only their text
    model, ref = tiny_llama(seed=0), tiny_llama(seed=4)
    seqs = ragged(6, 64, seed=9)
    starts = [max(1, len(s) // 2) for s in seqs]
    got = score_sequences(model, seqs, batch_size=4, k=0.5, starts=starts, ref_model=ref)
    whole = score_sequences(model, seqs, batch_size=4, k=0.5)
    for i, (s, f) in enumerate(zip(seqs, starts)):
        lp = sequence_logprobs(model, torch.tensor([s]))[0].double().numpy()[f - 1:]
        ref_lp = sequence_logprobs(ref, torch.tensor([s]))[0].double().numpy()[f - 1:]
        zlen = len(zlib.compress(" ".join(map(str, s[f:])).encode()))
        assert got["loss"][i] == pytest.approx(lp.mean(), abs=1e-5)
        assert got["zlib"][i] == pytest.approx(lp.mean() / zlen, abs=1e-6)
        assert got["min_k"][i] == pytest.approx(np.sort(lp)[:max(1, int(0.5 * len(lp)))].mean(), abs=1e-5)
        assert got["ref_ratio"][i] == pytest.approx(lp.mean() - ref_lp.mean(), abs=1e-5)
    assert not np.allclose(got["loss"], whole["loss"])  # the prompt's tokens are not scored
    assert np.allclose(score_sequences(model, seqs, starts=[1] * len(seqs))["loss"], whole["loss"], atol=1e-6)
    with pytest.raises(ConfigError, match=r"starts\[0\]"):
        score_sequences(model, seqs, starts=[len(seqs[0])] + starts[1:])
    with pytest.raises(ConfigError, match="one start per sequence"):
        score_sequences(model, seqs, starts=starts[:2])


def test_min_k_plus_plus_matches_brute_force():
    model = tiny_llama(seed=2).eval()
    seqs = ragged(4, 64, seed=3)
    got = score_sequences(model, seqs, batch_size=2, k=0.4)["min_k_plus_plus"]
    for i, s in enumerate(seqs):
        z = []
        for t in range(1, len(s)):
            # One unbatched forward per context; the moments in float64 from their definitions.
            with torch.no_grad():
                logits = model(torch.tensor([s[:t]])).logits[0, -1].double()
            logp = torch.log_softmax(logits, -1).numpy()
            p = np.exp(logp)
            mu = float((p * logp).sum())
            sigma = float(np.sqrt((p * (logp - mu) ** 2).sum()))
            z.append((logp[s[t]] - mu) / sigma)
        want = np.sort(z)[:max(1, int(0.4 * len(z)))].mean()
        assert got[i] == pytest.approx(want, abs=1e-4)


def test_ref_ratio_is_reference_loss_minus_target_loss():
    model, ref = tiny_llama(seed=0), tiny_llama(seed=4)
    seqs = ragged(5, 64, seed=5)
    assert np.allclose(score_sequences(model, seqs, ref_model=model)["ref_ratio"], 0.0, atol=1e-6)
    got = score_sequences(model, seqs, ref_model=ref)
    ref_loss = score_sequences(ref, seqs)["loss"]
    assert np.allclose(got["ref_ratio"], got["loss"] - ref_loss, atol=1e-6)


def test_membership_inference_separates_trained_sequences():
    model = tiny_llama(seed=6)
    g = torch.Generator().manual_seed(7)
    members = torch.randint(0, 64, (8, 16), generator=g)
    nonmembers = torch.randint(0, 64, (8, 16), generator=g).tolist()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = model(members, labels=members).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = membership_inference(model, members.tolist(), nonmembers, ref_model=tiny_llama(seed=8))
    assert set(report) == {"loss", "zlib", "min_k", "min_k_plus_plus", "ref_ratio"}
    for method, metrics in report.items():
        assert set(metrics) == {"auc", "tpr_at_1pct_fpr", "tpr_at_0.1pct_fpr"}
        assert metrics["auc"] > 0.9, method  # higher score = member, for every method


def test_score_sequences_rejects_bad_input():
    model = tiny_llama()
    with pytest.raises(ConfigError, match=r"seqs\[1\]"):
        score_sequences(model, [[1, 2, 3], [4]])
    with pytest.raises(ConfigError, match="k=0"):
        score_sequences(model, [[1, 2, 3]], k=0)


def test_resample_metrics_equal_sklearn_on_the_data_itself():
    rng = np.random.default_rng(1)
    for _ in range(20):  # rounded scores: many ties within and across the classes
        pos = np.round(rng.normal(0.5, 1, rng.integers(1, 40)), 1)
        neg = np.round(rng.normal(0, 1, rng.integers(1, 300)), 1)
        auc, tpr = roc_on_resamples(pos, neg, np.arange(pos.size)[None], np.arange(neg.size)[None])
        y = np.r_[np.ones(pos.size), np.zeros(neg.size)]
        assert auc[0] == pytest.approx(roc_auc_score(y, np.r_[pos, neg]), abs=1e-12)
        assert tpr[0] == pytest.approx(roc_metrics(pos, neg)["tpr_at_1pct_fpr"], abs=1e-12)


def test_resample_metrics_equal_a_loop_over_resamples():
    rng = np.random.default_rng(2)
    pos, neg = np.round(rng.normal(1, 1, 60), 1), np.round(rng.normal(0, 1, 150), 1)
    pi, ni = rng.integers(0, 60, (30, 60)), rng.integers(0, 150, (30, 150))
    auc, tpr = roc_on_resamples(pos, neg, pi, ni)
    for b in range(30):
        want = roc_metrics(pos[pi[b]], neg[ni[b]])
        assert auc[b] == pytest.approx(want["auc"], abs=1e-12)
        assert tpr[b] == pytest.approx(want["tpr_at_1pct_fpr"], abs=1e-12)


def test_bootstrap_ci_is_seeded_and_brackets_the_estimate():
    rng = np.random.default_rng(3)
    pos, neg = rng.normal(0.8, 1, 100), rng.normal(0, 1, 100)
    ci = bootstrap_ci(pos, neg, resamples=1000, seed=7)
    assert ci == bootstrap_ci(pos, neg, resamples=1000, seed=7)
    assert ci != bootstrap_ci(pos, neg, resamples=1000, seed=8)
    point = roc_metrics(pos, neg)
    lo, hi = ci["auc_ci"]
    assert lo <= point["auc"] <= hi and hi - lo < 0.3
    lo, hi = ci["tpr_at_1pct_fpr_ci"]
    assert 0 <= lo <= point["tpr_at_1pct_fpr"] <= hi <= 1
    narrow = bootstrap_ci(pos, neg, resamples=1000, seed=7, confidence=0.5)
    assert ci["auc_ci"][0] <= narrow["auc_ci"][0] <= narrow["auc_ci"][1] <= ci["auc_ci"][1]


def test_bootstrap_ci_hand_checked_extremes():
    # Perfectly separated: every resample separates too.
    assert bootstrap_ci([5.0, 6.0, 7.0], [1.0, 2.0], resamples=200) == {
        "auc_ci": [1.0, 1.0], "tpr_at_1pct_fpr_ci": [1.0, 1.0]}
    # All scores equal: AUC is a coin flip and no threshold admits a member without every non-member.
    assert bootstrap_ci([1.0] * 4, [1.0] * 6, resamples=200) == {
        "auc_ci": [0.5, 0.5], "tpr_at_1pct_fpr_ci": [0.0, 0.0]}


def test_bootstrap_ci_rejects_bad_input():
    with pytest.raises(ConfigError, match="resamples=0"):
        bootstrap_ci([1.0], [0.0], resamples=0)
    with pytest.raises(ConfigError, match="confidence=1"):
        bootstrap_ci([1.0], [0.0], confidence=1)
    with pytest.raises(ConfigError, match="member_scores"):
        bootstrap_ci([], [0.0])


def test_membership_inference_bootstrap_adds_paired_intervals():
    model, ref = tiny_llama(seed=0), tiny_llama(seed=9)
    members, nonmembers = ragged(12, 64, seed=10), ragged(15, 64, seed=11)
    plain = membership_inference(model, members, nonmembers, ref_model=ref)
    boot = membership_inference(model, members, nonmembers, ref_model=ref, bootstrap=300, seed=4)
    scores_m = score_sequences(model, members, ref_model=ref)
    scores_n = score_sequences(model, nonmembers, ref_model=ref)
    for method, metrics in boot.items():
        assert set(metrics) == set(plain[method]) | {"auc_ci", "tpr_at_1pct_fpr_ci"}
        assert {k: metrics[k] for k in plain[method]} == pytest.approx(plain[method])
        # Each method's interval is bootstrap_ci of its own scores with the shared seed.
        want = bootstrap_ci(scores_m[method], scores_n[method], resamples=300, seed=4)
        assert metrics["auc_ci"] == pytest.approx(want["auc_ci"])
        assert metrics["tpr_at_1pct_fpr_ci"] == pytest.approx(want["tpr_at_1pct_fpr_ci"])
    with pytest.raises(ConfigError, match="bootstrap=-1"):
        membership_inference(model, members, nonmembers, bootstrap=-1)


def test_mia_metrics_equal_roc_metrics_per_method_and_refuse_other_methods():
    rng = np.random.default_rng(3)
    m = {"loss": rng.normal(1, 1, 30), "zlib": rng.normal(0, 1, 30)}
    n = {"loss": rng.normal(0, 1, 40), "zlib": rng.normal(0, 1, 40)}
    got = mia_metrics(m, n, bootstrap=50, seed=2)
    for method in m:
        assert got[method] == {**roc_metrics(m[method], n[method]),
                               **bootstrap_ci(m[method], n[method], resamples=50, seed=2)}
    with pytest.raises(ConfigError, match="nonmember_scores.*members' methods"):
        mia_metrics(m, {"loss": n["loss"]})
