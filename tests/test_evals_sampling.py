"""Probabilistic (n, p) extraction (evals/sampling.py): per-token scheme probabilities against an fp64
reference and transformers' own logits warpers, p_z against HF `generate` sampling frequencies, the
scan's log p_z columns, the (n, p) arithmetic, bad scheme strings, and a Y=2 split vocabulary."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import tiny_model
from scipy.stats import binom
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from evals import greedy_generate, sampling
from evals.sampling import (
    DEFAULT_SCHEMES,
    Scheme,
    extractable,
    log_pz,
    np_summary,
    parse_schemes,
    scheme_logprobs,
    scheme_token_logprob,
)
from evals.scan import METRICS, score_windows
from memorize_core import ConfigError

torch.set_num_threads(1)
# top-p values that no count of equal probabilities hits exactly (0.6 of 50 ties would sit on the cut,
# where float rounding decides: see the module docstring of evals/sampling.py)
EXTRA = "t=1.5,top_k=3;top_p=0.517;t=2.0,top_k=8,top_p=0.613;top_k=1;t=0.5,top_k=250,top_p=0.77;top_p=0.01"
SCHEMES = parse_schemes(f"{DEFAULT_SCHEMES};{EXTRA}")
# no large top_k: the first candidates (64 of a rank's 128 logits) leave flat rows' top-p to widen
SPLIT = parse_schemes(f"{DEFAULT_SCHEMES};top_p=0.517;t=2.0,top_k=8,top_p=0.613;top_p=0.999;top_k=3")
TOP_P = parse_schemes("top_p=0.9;top_p=0.517;t=1.3,top_p=0.999;top_p=0.01;t=0.5,top_p=0.77")
PREFIX, SUFFIX = 4, 3


def reference(logits: torch.Tensor, scheme: Scheme, keep: int = 1) -> torch.Tensor:
    """log-probs [N, V] of every token under the scheme, straight from HF's definitions in fp64 (the
    temperature division in float32, as HF does it; ties at the top-p cut: a stable ascending sort)."""
    x = logits.float()
    x = (x if scheme.temperature == 1.0 else x / scheme.temperature).double()
    if scheme.top_k is not None:
        kth = x.topk(min(max(scheme.top_k, keep), x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if scheme.top_p is not None:
        vals, order = x.sort(dim=-1, stable=True)
        drop = vals.softmax(-1).cumsum(-1) <= 1 - scheme.top_p
        drop[..., -keep:] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return x.log_softmax(-1)


def every_token(logits: torch.Tensor, schemes, keep: int = 1, **kw) -> dict:
    """Our log-prob of every token id at every row: {scheme: [N, V]}."""
    n, v = logits.shape
    got = scheme_logprobs(logits.repeat_interleave(v, 0), torch.arange(v).repeat(n), schemes,
                          min_tokens_to_keep=keep, **kw)
    return {s: g.reshape(n, v) for s, g in got.items()}


def same(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5, msg: str = "") -> None:
    fin = torch.isfinite(want)
    differ = int((torch.isfinite(got) != fin).sum())
    assert not differ, f"{msg}: kept sets differ at {differ} tokens"
    assert (got[fin].double() - want[fin].double()).abs().max().item() < tol, msg


def block_logits(seed: int = 0, n: int = 12, v: int = 256) -> dict[str, torch.Tensor]:
    """Hand-built [N, V] logits: ordinary, flat (top-p needs most of the vocabulary), quantized (ties
    everywhere, at the k-th value and at the top-p cut), peaked."""
    g = torch.Generator().manual_seed(seed)
    return {"normal": torch.randn(n, v, generator=g) * 2, "flat": torch.randn(n, v, generator=g) * 0.1,
            "ties": torch.randint(0, 5, (n, v), generator=g).float(),
            "peaked": torch.randn(n, v, generator=g) * 8}


# -- schemes ------------------------------------------------------------------------------------------
def test_scheme_names_and_parsing():
    assert [s.name for s in parse_schemes(DEFAULT_SCHEMES)] == ["t=1.0", "t=0.7,top_k=40", "top_p=0.9"]
    assert parse_schemes(DEFAULT_SCHEMES) == (Scheme(), Scheme(0.7, 40), Scheme(top_p=0.9))
    spaced = parse_schemes(" temperature = 2 , top_p=0.5 ;top_k=5,t=1")
    assert spaced == (Scheme(2.0, top_p=0.5), Scheme(top_k=5))
    assert Scheme(top_p=1.0) == Scheme() and Scheme(1.0, 3, 1).name == "top_k=3"
    assert parse_schemes(";".join(s.name for s in SCHEMES)) == SCHEMES
    assert parse_schemes("  ") == ()


@pytest.mark.parametrize("text", ["t=0", "t=-1", "t=nan", "t=inf", "top_k=0", "top_k=4.5", "top_k=x",
                                  "top_p=0", "top_p=1.5", "foo=1", "t", "t=1.0;t=1.0", "t=1.0;top_p=1",
                                  "t=1.0,t=0.5", "t=1.0;;top_p=0.9", "t=0.7,"])
def test_bad_scheme_strings_name_sampling(text):
    with pytest.raises(ConfigError, match="^sampling="):
        parse_schemes(text)


def test_bad_scheme_values():
    for kw in ({"temperature": 0.0}, {"top_k": True}, {"top_p": -0.1}):
        with pytest.raises(ConfigError, match="^sampling="):
            Scheme(**kw)
    with pytest.raises(ConfigError, match="^sampling="):
        score_windows(tiny_model(), torch.zeros(1, 6, dtype=torch.long), 3, schemes=["t=1.0"])


# -- per-token probabilities --------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [1, 3])
def test_matches_fp64_reference(keep):
    for name, logits in block_logits().items():
        got = every_token(logits, SCHEMES, keep)
        for s in SCHEMES:
            same(got[s], reference(logits, s, keep), msg=f"{name} {s.name} keep={keep}")


def test_top_p_widening_matches_reference(monkeypatch):
    """4 candidates first: top-p rows widen 4 -> 64 -> all 512 (a sort), or stop where they settle."""
    monkeypatch.setattr(sampling, "_FIRST", 4)
    for name, logits in block_logits(2, v=512).items():
        for keep in (1, 2):
            got = every_token(logits, TOP_P, keep)
            for s in TOP_P:
                same(got[s], reference(logits, s, keep), msg=f"{name} {s.name} keep={keep}")


def hf_warped(logits: torch.Tensor, scheme: Scheme, keep: int) -> torch.Tensor:
    """transformers' own warpers in generate's order, then softmax (float32)."""
    procs = [TemperatureLogitsWarper(scheme.temperature)] if scheme.temperature != 1.0 else []
    if scheme.top_k is not None:
        procs.append(TopKLogitsWarper(top_k=scheme.top_k, min_tokens_to_keep=keep))
    if scheme.top_p is not None:
        procs.append(TopPLogitsWarper(top_p=scheme.top_p, min_tokens_to_keep=keep))
    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    return LogitsProcessorList(procs)(ids, logits.clone()).log_softmax(-1)


def test_matches_transformers_warpers():
    rows = torch.tensor([
        [5.0, 4.0, 3.0, 3.0, 3.0, 2.0, 1.0, 0.0],  # three ties at the 3rd value: top_k=3 keeps 5 tokens
        [3.0, 3.0, 3.0, 5.0, 4.0, 3.0, 2.0, 3.0],
        [10.0, 1.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0],  # min_tokens_to_keep=3 cuts through the 0.0 ties
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
    ])
    quarter = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 1e-9, 1e-9, 1e-9, 1e-9]]))  # top_p=0.5 cuts a tie
    g = torch.Generator().manual_seed(3)
    rand = (torch.randn(6, 16, generator=g) * 3).round()  # ties everywhere
    schemes = parse_schemes("top_k=3;top_k=2;t=0.7,top_k=4;top_p=0.5;top_p=0.83;t=1.3,top_k=5,top_p=0.6;"
                            "t=0.5;top_p=0.95;top_k=1")
    for logits in (rows, quarter, rand):
        for keep in (1, 3, 4):
            got = every_token(logits, schemes, keep)
            for s in schemes:
                same(got[s], hf_warped(logits, s, keep), msg=f"{s.name} keep={keep}")
    kept = torch.isfinite(every_token(quarter, [Scheme(top_p=0.5)])[Scheme(top_p=0.5)][0])
    assert kept.nonzero().squeeze(1).tolist() == [0, 3]  # of the tied 0.2s the highest id stays


def test_generate_applies_temperature_then_top_k_then_top_p():
    model = tiny_model()
    cfg = GenerationConfig(do_sample=True, temperature=0.7, top_k=40, top_p=0.9)
    procs = model._get_logits_processor(generation_config=cfg, input_ids_seq_length=4, device="cpu")
    order = [type(p) for p in procs if isinstance(p, (TemperatureLogitsWarper, TopKLogitsWarper,
                                                      TopPLogitsWarper))]
    assert order == [TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper]
    assert [p.min_tokens_to_keep for p in procs if hasattr(p, "min_tokens_to_keep")] == [1, 1]


# -- the scan -----------------------------------------------------------------------------------------
def scan_windows(model) -> torch.Tensor:
    """7 windows of 4 + 3 tokens: rows 0, 2, 4 are the model's greedy continuation (exact matches)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randint(0, 64, (7, PREFIX + SUFFIX), generator=g)
    greedy = greedy_generate(model, w[:, :PREFIX], SUFFIX)
    w[[0, 2, 4], PREFIX:] = greedy[[0, 2, 4]]
    return w


def test_scan_columns_equal_fp64_product_and_keep_old_columns():
    model = tiny_model().eval()
    w = scan_windows(model)
    for generate in (False, True):
        old = score_windows(model, w, PREFIX, generate=generate)
        new = score_windows(model, w, PREFIX, generate=generate, schemes=SCHEMES)
        assert set(new) == set(old) | {"logpz_greedy"} | {f"logpz/{s.name}" for s in SCHEMES}
        for key, v in old.items():
            assert np.array_equal(new[key], v), key
    assert new["exact_match"].tolist() == [True, False, True, False, True, False, False]
    assert new["logpz_greedy"].tolist() == [0.0 if e else -math.inf for e in new["exact_match"]]
    assert new["logpz/top_k=1"].tolist() == new["logpz_greedy"].tolist()  # top-1 sampling is greedy
    with torch.no_grad():
        logits = model(w[:, :-1]).logits[:, -SUFFIX:].reshape(-1, 64)
    picked = torch.arange(logits.shape[0]), w[:, PREFIX:].reshape(-1)
    for s in SCHEMES:
        want = reference(logits, s)[picked].reshape(7, SUFFIX).sum(-1).numpy()
        np.testing.assert_allclose(new[f"logpz/{s.name}"], want, rtol=1e-5, atol=1e-6, err_msg=s.name)
        assert new[f"logpz/{s.name}"].dtype == np.float64
    np.testing.assert_allclose(new["logpz/t=1.0"], -SUFFIX * new["suffix_loss"], rtol=1e-6)
    assert all(set(np.asarray(v).shape) <= {7, SUFFIX} for v in new.values())
    assert set(METRICS) <= set(new)


# -- against HF sampling ------------------------------------------------------------------------------
def test_pz_matches_generate_sampling_frequency():
    """p_z of one prefix's greedy suffix (3 tokens) under each scheme against 3000 HF samples."""
    model = tiny_model().eval()
    model.generation_config.eos_token_id = None  # no early stop, no EOS suppression by min_new_tokens
    model.generation_config.pad_token_id = 0
    prefix = torch.tensor([[5, 17, 33, 42]])
    suffix = greedy_generate(model, prefix, SUFFIX)
    with torch.no_grad():
        model.model.norm.weight.mul_(60.0)  # logits x60: the greedy path gets p_z ~ 0.1-0.5 (argmax kept)
        logits = model(torch.cat([prefix, suffix], 1)[:, :-1]).logits[:, -SUFFIX:]
    schemes = parse_schemes(f"{DEFAULT_SCHEMES};t=1.5,top_k=3;top_p=0.5;t=2.0,top_k=8,top_p=0.6")
    per = scheme_logprobs(logits, suffix, schemes)
    m = 3000
    for i, s in enumerate(schemes):
        pz = log_pz(per[s]).exp().item()
        assert 0.05 < pz < 0.95, (s.name, pz)
        torch.manual_seed(100 + i)
        out = model.generate(prefix.expand(m, -1), attention_mask=torch.ones(m, PREFIX, dtype=torch.long),
                             do_sample=True, temperature=s.temperature, top_k=s.top_k or 0,
                             top_p=s.top_p or 1.0, max_new_tokens=SUFFIX, min_new_tokens=SUFFIX)
        assert out.shape == (m, PREFIX + SUFFIX)
        hits = int((out[:, PREFIX:] == suffix).all(1).sum())
        lo, hi = binom.interval(0.99, m, pz)
        assert lo <= hits <= hi, (s.name, hits / m, pz)


# -- (n, p) -------------------------------------------------------------------------------------------
def test_extractable_by_hand():
    lz = np.array([math.log(0.5), math.log(0.01), -np.inf, 0.0])
    assert extractable(lz, 1, 0.5).tolist() == [True, False, False, True]
    assert extractable(lz, 100, 0.5).tolist() == [True, True, False, True]  # 1 - 0.99^100 = 0.634
    assert extractable(lz, 10, 0.5).tolist() == [True, False, False, True]  # 1 - 0.99^10 = 0.0956
    assert extractable(lz, 100, 0.64).tolist() == [True, False, False, True]
    tiny = np.array([math.log(1e-20)])  # 1 - (1 - 1e-20)^(1e20) = 0.632: naive 1 - p_z rounds to 1
    assert extractable(tiny, 10 ** 20, 0.6).tolist() == [True]
    assert extractable(tiny, 10 ** 20, 0.65).tolist() == [False]
    near = np.array([-1e-12])  # p_z = 1 - 1e-12
    assert extractable(near, 1, 1 - 1e-11).tolist() == [True]
    assert extractable(near, 2, 1 - 1e-15).tolist() == [True]
    assert extractable(np.array([np.nan, -np.inf]), 5, 0.5).tolist() == [False, False]
    for n, p in ((0, 0.5), (2.5, 0.5), (True, 0.5), (5, 0.0), (5, 1.0)):
        with pytest.raises(ConfigError):
            extractable(lz, n, p)


def test_np_summary_by_hand():
    lz = {"a": np.array([math.log(0.5), math.log(0.01), -np.inf, math.log(0.001)]),
          "b": np.array([0.0, -np.inf, -np.inf, -np.inf])}
    got = np_summary(lz, ns=(1, 100, 1000), p=0.5, greedy=np.array([True, False, False, False]))
    assert got["rows"] == 4 and got["ns"] == [1, 100, 1000] and list(got["schemes"]) == ["greedy", "a", "b"]
    assert [got["schemes"]["a"][f"n={n}"]["count"] for n in (1, 100, 1000)] == [1, 2, 3]
    assert got["schemes"]["a"]["n=1000"]["fraction"] == 0.75
    assert got["schemes"]["greedy"] == got["schemes"]["b"]
    with pytest.raises(ConfigError):
        np_summary(lz, ns=(0,))
    with pytest.raises(ConfigError):
        np_summary({"a": np.zeros(2), "b": np.zeros(3)})


def test_single_scheme_and_log_pz_shape():
    logits = block_logits()["normal"].reshape(3, 4, 256)
    targets = torch.randint(0, 256, (3, 4), generator=torch.Generator().manual_seed(0))
    one = scheme_token_logprob(logits, targets, Scheme(0.7, 40))
    assert one.shape == (3, 4) and one.dtype == torch.float64
    assert torch.equal(one, scheme_logprobs(logits, targets, SCHEMES)[Scheme(0.7, 40)])
    assert log_pz(one).shape == (3,)


# -- split vocabulary ---------------------------------------------------------------------------------
def _split_rank(rank, world, windows, small, wide):
    import axonn
    from evals.scoring import Scorer

    grid = axonn.init(1, 2, 1, 1)
    model = axonn.parallelize(tiny_model().eval(), grid, mode="paired")
    sc = Scorer(model)
    assert sc.sharded_vocab
    scan = score_windows(model, windows, PREFIX, schemes=SCHEMES, scorer=sc)
    out = {"scan": {k: np.asarray(v).tolist() for k, v in scan.items()}}
    for first, schemes, blocks in ((64, SPLIT, small), (4, TOP_P, wide)):
        sampling._FIRST = first  # 4: top-p widens 4 -> 64 (of the rank's 512) -> all
        for name, logits in blocks.items():  # this rank's slice of hand-built logits
            n, v = logits.shape
            half = v // 2
            mine = logits[:, rank * half:(rank + 1) * half].repeat_interleave(v, 0)
            got = scheme_logprobs(mine, torch.arange(v).repeat(n), schemes, grid, True, min_tokens_to_keep=2)
            out[name, first] = {s.name: g.reshape(n, v).tolist() for s, g in got.items()}
    return out


@pytest.mark.distributed
def test_split_vocab_equals_serial():
    from axonn.spawn import run_distributed

    model = tiny_model().eval()
    w = scan_windows(model)
    serial = score_windows(model, w, PREFIX, schemes=SCHEMES)
    small, wide = block_logits(1, n=6), block_logits(4, n=3, v=1024)
    for got in run_distributed(_split_rank, 2, w, small, wide, timeout=300):
        for key, v in serial.items():
            if key.startswith("logpz") or key in ("exact_match", "lead"):
                np.testing.assert_allclose(got["scan"][key], v, rtol=1e-5, atol=1e-6, err_msg=key)
        for first, schemes, blocks in ((64, SPLIT, small), (4, TOP_P, wide)):
            for name, logits in blocks.items():
                for s in schemes:
                    same(torch.tensor(got[name, first][s.name]), reference(logits, s, 2),
                         msg=f"{name} {s.name} first={first}")


def test_sampled_pairs_score_each_target_from_its_whole_prompt():
    """Chat answers from prompts of any length: each pair's log p_z and greedy match equal score_windows on
    that pair alone; pairs whose prompts share a length give sampled_extraction's rows on those windows."""
    from evals.probabilistic import sampled_extraction, sampled_pairs

    model = tiny_model(vocab=64).eval()
    schemes = parse_schemes("t=1.0;top_k=5")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 5, 3, 7, 5, 3)]
    targets = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (4, 4, 4, 2, 4, 6)]
    prompts[2] = prompts[0]
    targets[2] = greedy_generate(model, torch.tensor([prompts[0]]), 4)[0, -4:].tolist()  # its greedy answer
    got = sampled_pairs(model, prompts, targets, schemes=schemes, ns=[1, 10], batch_size=2,
                        doc_ids=list("abcdef"))
    rows = got["offsets"]["0"]["rows"]
    assert [r["doc"] for r in rows] == list("abcdef") and got["prefix"] == "prompt" and got["suffix"] == 6
    for p, t, r in zip(prompts, targets, rows):
        one = score_windows(model, torch.tensor([p + t]), len(p), schemes=schemes)
        assert r["logpz"]["greedy"] == (0.0 if one["exact_match"][0] else None)
        for s in schemes:  # -inf (top-k never emits the target) is JSON's None
            want = float(one[f"logpz/{s.name}"][0])
            assert r["logpz"][s.name] == (pytest.approx(want, abs=1e-9) if math.isfinite(want) else None)
    assert rows[2]["logpz"]["greedy"] == 0.0 and got["offsets"]["0"]["exact_match_rate"] >= 1 / 6
    same_len = [0, 2]  # prompt 3 + target 4: documents of 7 tokens with prefix 3
    docs = sampled_extraction(model, [prompts[i] + targets[i] for i in same_len], prefix_len=3, suffix_len=4,
                              schemes=schemes, ns=[1, 10], doc_ids=["a", "c"])
    assert docs["offsets"]["0"]["rows"] == [rows[i] for i in same_len]
    with pytest.raises(ConfigError, match="one target per prompt"):
        sampled_pairs(model, prompts, targets[:2], schemes=schemes)
