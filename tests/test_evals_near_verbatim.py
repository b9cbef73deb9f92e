"""Near-verbatim extraction (evals/near_verbatim.py): with a beam that holds the whole neighbourhood the
bound IS the probability of a sample within d changed tokens (enumerated, and against HF sampling); with
a narrow beam it stays between p_z and that probability; a split vocabulary and batch give the serial
bounds; bad arguments name their field."""
from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
from helpers import levenshtein, tiny_model
from scipy.stats import binom

from evals._model import evaluating
from evals.near_verbatim import _edit_rows, near_verbatim, search
from evals.sampling import log_pz, parse_schemes, scheme_logprobs
from evals.scoring import Scorer
from memorize_core import ConfigError

torch.set_num_threads(1)
SCHEMES = parse_schemes("t=1.0;t=0.7,top_k=3;top_p=0.9")
P, S = 3, 3


def peaked(vocab: int, scale: float) -> torch.nn.Module:
    """A seeded tiny Llama whose logits are `scale` times sharper (so near-copies carry real mass)."""
    model = tiny_model(vocab=vocab).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    return model


def windows(vocab: int, n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, P + S), generator=torch.Generator().manual_seed(seed))


def exact(model, window: torch.Tensor, scheme, max_edits: int, distance: str = "hamming") -> list[float]:
    """log P(a sample is within d changes of the suffix), d = 0..max_edits, by enumerating every suffix
    of the vocabulary and scoring it teacher-forced."""
    vocab, target = model.config.vocab_size, window[P:]
    every = torch.tensor(list(itertools.product(range(vocab), repeat=S)))
    if distance == "hamming":
        changed = (every != target).sum(1)
    else:
        changed = torch.tensor([levenshtein(e, target.tolist()) for e in every.tolist()])
    every, changed = every[changed <= max_edits], changed[changed <= max_edits]
    full = torch.cat([window[:P].expand(len(every), -1), every], 1)
    with torch.no_grad():
        logits = model(full[:, :-1]).logits[:, -S:]
    lp = log_pz(scheme_logprobs(logits, every, (scheme,))[scheme])
    return [torch.logsumexp(lp[changed <= d], 0).item() for d in range(max_edits + 1)]


def bounds(model, w: torch.Tensor, scheme, max_edits: int, beams: int,
           distance: str = "hamming") -> torch.Tensor:
    with evaluating(model), torch.no_grad():
        return search(Scorer(model), w[:, :P], w[:, P:], scheme, max_edits, beams, distance=distance)["bound"]


def test_a_beam_that_holds_the_neighbourhood_gives_its_exact_probability():
    """V = 8, S = 3, d = 2: 169 suffixes; 150 paths per number of changes hold all of them."""
    model, w = peaked(8, 8.0), windows(8)
    for s in SCHEMES:
        got = bounds(model, w, s, 2, 150)
        for i in range(len(w)):
            want = exact(model, w[i], s, 2)
            for d in range(3):
                if math.isinf(want[d]):
                    assert got[i, d].item() == -math.inf, (s.name, i, d)
                else:
                    assert got[i, d].item() == pytest.approx(want[d], abs=1e-5), (s.name, i, d)


def test_levenshtein_beam_that_holds_the_neighbourhood_gives_its_exact_probability():
    """V = 6, S = 3, d = 2 edits (substitutions, insertions, deletions between the 3 sampled tokens and
    the suffix): every one of the 216 suffixes in the beam; the bound equals the enumerated probability
    and is at least the Hamming one (a shifted copy is near by edits, far by substitutions)."""
    model = peaked(6, 8.0)
    w = windows(6)
    w[0, P:] = torch.tensor([2, 2, 5])  # a repeated token: the verbatim path must keep its own copy
    for s in SCHEMES:
        got = bounds(model, w, s, 2, 216, distance="levenshtein")
        ham = bounds(model, w, s, 2, 216)
        for i in range(len(w)):
            want = exact(model, w[i], s, 2, distance="levenshtein")
            for d in range(3):
                if math.isinf(want[d]):
                    assert got[i, d].item() == -math.inf, (s.name, i, d)
                else:
                    assert got[i, d].item() == pytest.approx(want[d], abs=1e-5), (s.name, i, d)
                    assert got[i, d] >= ham[i, d] - 1e-9
        assert (got[:, 2] > ham[:, 2] + 1e-3).any(), s.name  # the edit neighbourhood holds more


@pytest.mark.parametrize("truth", [[0, 1, 2, 3, 4], [1, 1, 0, 1, 1]])
def test_edit_rows_grow_the_edit_distance_of_every_path(truth):
    """The search's running DP rows, grown one token at a time, end at the edit distance by definition
    for every 5-token sequence over 4 symbols (1,024 paths, shifted copies among them)."""
    every = torch.tensor(list(itertools.product(range(4), repeat=5)))
    target = torch.tensor(truth).expand(len(every), -1)
    rows = torch.arange(6).expand(len(every), -1)
    for i in range(5):
        rows = _edit_rows(rows, every[:, i:i + 1], target, i)[:, 0]
    assert rows[:, -1].tolist() == [levenshtein(g, truth) for g in every.tolist()]


def test_levenshtein_narrow_beam_is_a_lower_bound_and_names_its_path_distance():
    model, w = peaked(8, 8.0), windows(8, n=6, seed=1)
    for s in SCHEMES[:2]:
        for beams in (1, 3):
            with evaluating(model), torch.no_grad():
                res = search(Scorer(model), w[:, :P], w[:, P:], s, 2, beams, distance="levenshtein")
            for i in range(len(w)):
                want = exact(model, w[i], s, 2, distance="levenshtein")
                for d in range(3):
                    assert res["bound"][i, d].item() <= want[d] + 1e-6, (s.name, beams, i, d)
                path = res["tokens"][i].tolist()
                assert res["edits"][i].item() == levenshtein(path, w[i, P:].tolist()) <= 2


def test_a_narrow_beam_is_a_lower_bound_never_below_pz():
    """1 or 2 paths per number of changes (a beam short of paths fills with empty ones, whose picks
    must not duplicate a live path: a duplicate would push the bound above the truth)."""
    model, w = peaked(8, 8.0), windows(8, n=6, seed=1)
    with torch.no_grad():
        logits = model(w[:, :-1]).logits[:, -S:]
    for s in SCHEMES:
        pz = log_pz(scheme_logprobs(logits, w[:, P:], (s,))[s])
        for beams in (1, 2):
            got = bounds(model, w, s, 3, beams)  # 3 changes: that level is empty for two steps
            assert torch.allclose(got[:, 0], pz, atol=1e-5)  # -inf (truncated) rows compare equal
            for i in range(len(w)):
                want = exact(model, w[i], s, 3)
                for d in range(4):
                    assert got[i, d].item() <= want[d] + 1e-6, (s.name, beams, i, d)
                    assert d == 0 or got[i, d] >= got[i, d - 1]


def test_full_bound_matches_generate_sampling_frequency():
    """V = 64, S = 3, at most 1 changed token (190 suffixes, all in the beam): the bound against the share
    of 3000 HF `generate` samples within one token of the suffix, per scheme."""
    model = peaked(64, 30.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prefix = torch.tensor([[5, 17, 33]])
    with torch.no_grad():
        suffix = model.generate(prefix, do_sample=False, max_new_tokens=S, min_new_tokens=S)[:, P:]
    # one token off the greedy path: the exact copy is unlikely, one change away is not
    suffix[0, 1] = (suffix[0, 1] + 1) % 64
    w = torch.cat([prefix, suffix], 1)
    m = 3000
    for i, s in enumerate(parse_schemes("t=1.0;t=0.7,top_k=40;top_p=0.9")):
        got = bounds(model, w, s, 1, 3 * 63)[0]
        q = got[1].exp().item()
        assert 0.05 < q < 0.95 and got[1] > got[0] + 1, (s.name, got.tolist())
        torch.manual_seed(200 + i)
        out = model.generate(prefix.expand(m, -1), attention_mask=torch.ones(m, P, dtype=torch.long),
                             do_sample=True, temperature=s.temperature, top_k=s.top_k or 0,
                             top_p=s.top_p or 1.0, max_new_tokens=S, min_new_tokens=S)
        hits = int(((out[:, P:] != suffix).sum(1) <= 1).sum())
        lo, hi = binom.interval(0.99, m, q)
        assert lo <= hits <= hi, (s.name, hits / m, q)


def test_summary_rows_and_likeliest_path():
    model = peaked(8, 8.0)
    docs = [w.tolist() for w in windows(8, n=5)] + [[1, 2]]  # the last is too short: left out
    got = near_verbatim(model, docs, prefix_len=P, suffix_len=S, schemes=SCHEMES[:1], max_edits=2, beams=150,
                        ns=(1, 10), doc_ids=list("abcdef"), batch_size=2)
    at = got["offsets"]["0"]
    assert at["docs"] == 5 and [r["doc"] for r in at["rows"]] == list("abcde")
    name = SCHEMES[0].name
    for r, w in zip(at["rows"], docs):
        want = exact(model, torch.tensor(w), SCHEMES[0], 2)
        assert r["bound"][name] == pytest.approx(want, abs=1e-5)
        best = r["likeliest"][name]
        assert best["edits"] == sum(a != b for a, b in zip(best["tokens"], w[P:])) <= 2
        assert best["logp"] <= r["bound"][name][best["edits"]] + 1e-9
    summary = at["np"][name]
    assert list(summary["schemes"]) == ["d=0", "d=1", "d=2"] and summary["rows"] == 5
    for d in range(3):
        hit = sum(math.log(0.5) <= r["bound"][name][d] for r in at["rows"])
        assert summary["schemes"][f"d={d}"]["n=1"]["count"] == hit


@pytest.mark.parametrize("kw, field", [
    ({"max_edits": 0}, "max_edits"), ({"beams": 0}, "beams"), ({"schemes": ()}, "schemes"),
    ({"offsets": (-1,)}, "offsets[0]"), ({"doc_ids": [1, 2]}, "doc_ids"), ({"distance": "edit"}, "distance")])
def test_bad_arguments_name_their_field(kw, field):
    args = dict(prefix_len=P, suffix_len=S, schemes=SCHEMES[:1], max_edits=1, beams=2)
    args.update(kw)
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}="):
        near_verbatim(tiny_model(vocab=8), [[1, 2, 3, 4, 5, 6]], **args)


def _split_rank(rank, world, docs):
    import axonn

    grid = axonn.init(1, 2, 1, 2)
    model = axonn.parallelize(peaked(8, 8.0), grid, mode="paired")
    return [near_verbatim(model, docs, prefix_len=P, suffix_len=S, schemes=SCHEMES, max_edits=2, beams=3,
                          batch_size=3, distance=d) for d in ("hamming", "levenshtein")]


@pytest.mark.distributed
def test_split_vocab_and_batch_equal_serial():
    """4 gloo ranks at 1,2,1,2: the vocabulary over Y (distributed top-k and scheme probabilities), the
    documents over data; every rank returns the serial search's bounds and paths."""
    from axonn.spawn import run_distributed

    docs = [w.tolist() for w in windows(8, n=5, seed=2)]
    serial = [near_verbatim(peaked(8, 8.0), docs, prefix_len=P, suffix_len=S, schemes=SCHEMES, max_edits=2,
                            beams=3, batch_size=3, distance=d) for d in ("hamming", "levenshtein")]
    for ranks in run_distributed(_split_rank, 4, docs, timeout=300):
        for got, want in zip(ranks, serial, strict=True):
            for a, b in zip(got["offsets"]["0"]["rows"], want["offsets"]["0"]["rows"], strict=True):
                for name in b["bound"]:
                    assert [x is None for x in a["bound"][name]] == [x is None for x in b["bound"][name]]
                    assert a["bound"][name] == pytest.approx(b["bound"][name], abs=1e-5), name
                    assert a["likeliest"][name]["tokens"] == b["likeliest"][name]["tokens"], name
            assert got["offsets"]["0"]["np"] == want["offsets"]["0"]["np"]


def test_pairs_search_each_target_from_its_whole_prompt():
    """Chat answers from prompts of any length: each pair's row equals near_verbatim on that pair alone
    (the prompt as the prefix); pairs sharing lengths give near_verbatim's rows and summary on them."""
    from evals.near_verbatim import near_verbatim_pairs

    model = peaked(8, 8.0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 8, (n,), generator=g).tolist() for n in (3, 2, 3, 4)]
    targets = [torch.randint(0, 8, (n,), generator=g).tolist() for n in (3, 3, 3, 4)]
    args = {"schemes": SCHEMES[1:2], "max_edits": 2, "beams": 2, "ns": [1, 10]}
    got = near_verbatim_pairs(model, prompts, targets, batch_size=1, doc_ids=list("abcd"), **args)
    rows = got["offsets"]["0"]["rows"]
    assert [r["doc"] for r in rows] == list("abcd") and (got["prefix"], got["suffix"]) == ("prompt", 4)
    for pr, t, r in zip(prompts, targets, rows):
        alone = near_verbatim(model, [pr + t], prefix_len=len(pr), suffix_len=len(t), doc_ids=[r["doc"]],
                              **args)
        assert alone["offsets"]["0"]["rows"] == [r]
    same = near_verbatim(model, [prompts[i] + targets[i] for i in (0, 2)], prefix_len=3, suffix_len=3,
                         doc_ids=["a", "c"], **args)["offsets"]["0"]
    sub = near_verbatim_pairs(model, [prompts[0], prompts[2]], [targets[0], targets[2]], doc_ids=["a", "c"],
                              **args)["offsets"]["0"]
    assert sub == same
    longer = near_verbatim_pairs(model, prompts, targets, **{**args, "max_edits": 3})["offsets"]["0"]
    assert longer["docs"] == 1 and [r["doc"] for r in longer["rows"]] == [3]  # 3-token targets left out
