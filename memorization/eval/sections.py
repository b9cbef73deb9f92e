"""The sections of `memorize eval` (extraction, membership inference, perplexity) over tokenized corpora.

`memorize eval` (memorization/eval/evaluate.py) and the Hugging Face Trainer callback
(memorization/integrations/callback.py) both call these, so a pass scored in place during training
and the same checkpoint scored by `memorize eval` give the same figures with the same settings.
Each takes the command's `EvalOptions` (defined here: prefix, suffix, beams, batch size, MIA k,
bootstrap, seed, ...). `sampled_section` (extraction beyond greedy: log p_z per decoding scheme and
(n, p) summaries at several prefix offsets) is `memorize eval`'s; the flag parsers below it share with
`memorize scan`.
"""
from __future__ import annotations

import difflib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from axonn.grid import ProcessGrid
from evals import ExtractionResult, extract, summarize
from evals.blind import blind_baseline, shift_warning
from evals.mia import mia_metrics, score_both, score_rows
from evals.near_verbatim import DEFAULT_BEAMS, near_verbatim, near_verbatim_pairs
from evals.perplexity import corpus_loss
from evals.probabilistic import sampled_extraction, split_rows
from evals.sampling import DEFAULT_SCHEMES, Scheme, parse_schemes
from evals.static_decode import DecodeLog
from memorization.eval.membership import EvalCorpus
from memorize_core import NEAR_DISTANCES, ConfigError, fail

DEFAULT_NS = (1, 10, 100, 1000)
DEFAULT_P = 0.5


@dataclass
class EvalOptions:
    """What `memorize eval` was asked to do (the command line, as given)."""

    model: str
    corpus: str | None = None
    mia: bool = False
    members: str | None = None
    non_members: str | None = None
    reference: str | None = None
    mia_k: float = 0.2
    bootstrap: int = 1000
    perplexity: list[str] | None = None
    max_tokens: int | None = None
    limit: int = 0
    prefix: int = 32
    suffix: int = 32
    batch_size: int = 32
    beams: int = 1
    decode: str = "auto"  # greedy decoder: auto (compiled static cache on a GPU, serial), static or kv
    seed: int = 0
    out: str | None = None
    overwrite: bool = False
    grid: str | None = None  # X,Y,Z,D or auto (under torchrun / srun); None: one process, serial
    mode: str = "auto"  # parallel mode of the layers: easy, paired, or auto (paired for Llama-family)
    keep_gathered: bool = False  # hold the Z-gathered weights for the whole evaluation
    tasks: str | None = None  # lm-eval tasks, comma-separated (bundled offline ones, or lm-eval's own)
    num_fewshot: int | None = None  # in-context examples per task (None: each task's default)
    verbose: bool = False  # lm-eval's log on stderr instead of OUT/lm-eval.log
    sampling: str | None = None  # decoding schemes for log p_z (None: evals.sampling.DEFAULT_SCHEMES)
    offsets: str = "0"  # token offsets of the extraction prefix into each document, e.g. "0,16,32"
    np_n: str | None = None  # numbers of draws n of the (n, p) summaries, e.g. "1,10,100,1000"
    np_p: float | None = None  # probability p of the (n, p) summaries (None: 0.5)
    near_verbatim: int = 0  # with --corpus: also bound P(a sample is within D changed tokens); 0: off
    nv_beams: int = DEFAULT_BEAMS  # paths kept per number of changed tokens in that search
    nv_distance: str = "hamming"  # its changes: hamming (substitutions) or levenshtein (+ insert, delete)


def parse_sampling(text: str | None, flag: str = "--sampling") -> tuple[Scheme, ...]:
    """The decoding schemes of `text` (None: DEFAULT_SCHEMES, "": none); ConfigError naming `flag`."""
    text = DEFAULT_SCHEMES if text is None else text
    try:
        return parse_schemes(text)
    except ConfigError as e:  # evals names its field `sampling`: say which flag it came from
        raise fail(flag, text, str(e).split(": ", 1)[-1]) from None


def _ints(text: str, flag: str, low: int, example: str) -> list[int]:
    words = [w.strip() for w in str(text).split(",")]
    # ASCII digits only: int() also reads '١٠' and '1_000', a second spelling of the same number
    if not all(w.isascii() and w.isdigit() and len(w) <= 18 and int(w) >= low for w in words):
        raise fail(flag, text, f"pass a comma-separated list of integers >= {low}, e.g. {example}")
    if len(set(map(int, words))) < len(words):
        raise fail(flag, text, f"lists a value twice; e.g. {example}")
    return sorted(map(int, words))


def parse_ns(text: str | None, flag: str = "--np-n") -> tuple[int, ...]:
    """The numbers of draws n of `text` (None: 1,10,100,1000), ascending; ConfigError naming `flag`."""
    return DEFAULT_NS if text is None else tuple(_ints(text, flag, 1, "1,10,100,1000"))


def parse_p(p: float | None, flag: str = "--np-p") -> float:
    """The probability p of an (n, p) extraction (None: 0.5); ConfigError naming `flag`."""
    if p is None:
        return DEFAULT_P
    if isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p < 1:
        raise fail(flag, p, "pass a probability in (0, 1), e.g. 0.5")
    return float(p)


def parse_offsets(text: str, flag: str = "--offsets") -> list[int]:
    """Token offsets of the extraction prefix into each document ("0,16,32"); ConfigError naming `flag`."""
    return _ints(text, flag, 0, "0,16,32")


def extraction_section(o: EvalOptions, model: Any, tok: Any, c: EvalCorpus, *,
                       grid: ProcessGrid | None = None, progress: bool = True
                       ) -> tuple[dict[str, Any], list[ExtractionResult]]:
    """Greedy (or beam) extraction of every document: report.json's `extraction` and the results."""
    t = time.perf_counter()
    log = DecodeLog()
    results = extract(model, c.seqs, prefix_len=o.prefix, suffix_len=o.suffix, tokenizer=tok,
                      batch_size=o.batch_size, num_beams=o.beams, doc_ids=c.ids, progress=progress, grid=grid,
                      decode=o.decode, decode_log=log)
    section = {"corpus": c.spec, "prefix": o.prefix, "suffix": o.suffix, "beams": o.beams,
               "loaded": c.loaded, **summarize(results), "decode": log.to_dict(),
               "seconds": time.perf_counter() - t}
    return section, results


def wants_sampled(o: EvalOptions) -> bool:
    """Whether the extraction goes beyond the greedy decode at offset 0 (a scheme, or another offset)."""
    return bool(parse_sampling(o.sampling)) or parse_offsets(o.offsets) != [0]


def sampled_section(o: EvalOptions, model: Any, c: EvalCorpus, *, grid: ProcessGrid | None = None
                    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Extraction beyond greedy (evals.probabilistic.sampled_extraction, one forward per window): per
    --offsets offset, the greedy exact-match rate and the (n, p) summary per --sampling scheme; and one
    row per scored (offset, document) with its log p_z per scheme (-inf as None). Call on every rank."""
    t = time.perf_counter()
    got = sampled_extraction(model, c.seqs, prefix_len=o.prefix, suffix_len=o.suffix,
                             schemes=parse_sampling(o.sampling), offsets=parse_offsets(o.offsets),
                             ns=parse_ns(o.np_n), p=parse_p(o.np_p), batch_size=o.batch_size, doc_ids=c.ids,
                             grid=grid)
    got, rows = split_rows(got)
    section = {**got, "ns": list(parse_ns(o.np_n)), "p": parse_p(o.np_p), "seconds": time.perf_counter() - t}
    return section, rows


def near_verbatim_section(o: EvalOptions, model: Any, tok: Any, c: EvalCorpus, *,
                          grid: ProcessGrid | None = None, progress: bool = True
                          ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Near-verbatim extraction (evals.near_verbatim): per --offsets offset and --sampling scheme, the (n, p)
    summary of each document's lower bound of P(a sample lies within d changed tokens of the suffix) for
    d = 0..--near-verbatim; and one row per scored (offset, document) with its bounds and the likeliest
    path found (its changes, log-prob and text). Call on every rank."""
    t = time.perf_counter()
    got, rows = near_report(model, c.seqs, c.ids, tok, prefix_len=o.prefix, suffix_len=o.suffix,
                            schemes=parse_sampling(o.sampling), max_edits=o.near_verbatim, beams=o.nv_beams,
                            distance=o.nv_distance,
                            offsets=parse_offsets(o.offsets), ns=parse_ns(o.np_n), p=parse_p(o.np_p),
                            batch_size=o.batch_size, grid=grid, progress=progress)
    section = {**got, "ns": list(parse_ns(o.np_n)), "p": parse_p(o.np_p), "seconds": time.perf_counter() - t}
    return section, rows


def check_near_verbatim(o: Any) -> None:
    """--near-verbatim D, --nv-beams W and --nv-distance of `memorize eval` and `memorize scan` (options `o`
    with near_verbatim, nv_beams, nv_distance, suffix, sampling): D changed tokens fewer than the suffix,
    a scheme to sample with; the other two only with D."""
    d, w = o.near_verbatim, o.nv_beams
    if o.nv_distance not in NEAR_DISTANCES:
        raise fail("--nv-distance", o.nv_distance, "choose hamming or levenshtein")
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
        raise fail("--near-verbatim", d, "pass the largest number of changed suffix tokens to count, e.g. 3 "
                   "(0 = off)")
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise fail("--nv-beams", w, "pass the paths kept per number of changed tokens, >= 1, e.g. 8")
    if not d:
        if w != DEFAULT_BEAMS:
            raise fail("--nv-beams", w, "only applies with --near-verbatim D")
        if o.nv_distance != "hamming":
            raise fail("--nv-distance", o.nv_distance, "only applies with --near-verbatim D")
        return
    if d >= o.suffix:
        raise fail("--near-verbatim", d, f"must be below --suffix {o.suffix}: with every token changed "
                   "any continuation counts")
    if not parse_sampling(o.sampling):
        raise fail("--near-verbatim", d, "needs a sampling scheme to bound (greedy emits one continuation: "
                   "its token accuracy is in the extraction table); drop --sampling '' or name one, e.g. "
                   "--sampling t=1.0")


def near_report(model: Any, seqs: Sequence[Sequence[int]], ids: Sequence[Any], tok: Any, *, prefix_len: int,
                suffix_len: int, **kw: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """evals.near_verbatim.near_verbatim of `seqs` (`kw`: its other keywords) as (the summary with the
    likeliest near-copies as `examples`, the rows of near_verbatim.jsonl with the true suffix and each
    likeliest path spelled out); what memorize eval and a training run report. Call on every rank."""
    got, rows = split_rows(near_verbatim(model, seqs, prefix_len=prefix_len, suffix_len=suffix_len,
                                         doc_ids=ids, **kw))
    by_id = dict(zip(ids, seqs))
    _spell(rows, tok, lambda r: by_id[r["doc"]][int(r["offset"]) + prefix_len:][:suffix_len])
    return {**got, "examples": _examples(rows)}, rows


def near_pairs_report(model: Any, prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]],
                      ids: Sequence[Any], tok: Any, **kw: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """near_report for chat data: evals.near_verbatim.near_verbatim_pairs, each answer from its prompt (`kw`:
    its other keywords), as (the summary with `examples`, the rows spelled out). Call on every rank."""
    got, rows = split_rows(near_verbatim_pairs(model, prompts, targets, doc_ids=ids, **kw))
    by_id = dict(zip(ids, targets))
    _spell(rows, tok, lambda r: by_id[r["doc"]])
    return {**got, "examples": _examples(rows)}, rows


def _spell(rows: list[dict[str, Any]], tok: Any, truth_of: Callable[[dict[str, Any]], Sequence[int]]) -> None:
    """Add each row's true suffix as text (`suffix`, its ids from `truth_of(row)`), its likeliest paths'
    (`text`) and what they change (`diff`)."""
    for r in rows:
        truth = [int(t) for t in truth_of(r)]
        r["suffix"] = tok.decode(truth)
        for path in r["likeliest"].values():
            path["text"] = tok.decode(path["tokens"])
            path["diff"] = marked_diff(tok, truth, path["tokens"])


def marked_diff(tok: Any, truth: Sequence[int], ids: Sequence[int]) -> str:
    """`ids` as text with what differs from `truth` marked, [-removed-] and {+added+} (token spans
    aligned by difflib, each side decoded on its own), as `git diff --word-diff` shows a change."""
    out = []
    matcher = difflib.SequenceMatcher(None, list(truth), list(ids), autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            out.append(tok.decode(list(ids[j1:j2])))
            continue
        if i2 > i1:
            out.append(f"[-{tok.decode(list(truth[i1:i2]))}-]")
        if j2 > j1:
            out.append(f"{{+{tok.decode(list(ids[j1:j2]))}+}}")
    return "".join(out)


def _examples(rows: Sequence[dict[str, Any]], k: int = 3) -> list[dict[str, Any]]:
    """The k likeliest near-copies that are not the exact suffix, one per window (its likeliest scheme):
    each with its document, offset, scheme, changed tokens, log-prob, the true suffix and the near-copy."""
    best: dict[tuple[Any, int], dict[str, Any]] = {}
    for r in rows:
        for name, path in r["likeliest"].items():
            key = (r["doc"], r["offset"])
            if not path["edits"] or path["logp"] is None:
                continue
            if key not in best or path["logp"] > best[key]["logp"]:
                best[key] = {"doc": r["doc"], "offset": r["offset"], "scheme": name, "edits": path["edits"],
                             "logp": path["logp"], "suffix": r["suffix"], "text": path["text"],
                             "diff": path["diff"]}
    return sorted(best.values(), key=lambda x: -x["logp"])[:k]


def perplexity_section(o: EvalOptions, model: Any, c: EvalCorpus, *, grid: ProcessGrid | None = None
                       ) -> dict[str, Any]:
    """Token-weighted held-out loss and perplexity: one entry of report.json's `perplexity`."""
    t = time.perf_counter()
    res = corpus_loss(model, c.seqs, batch_size=o.batch_size, grid=grid, progress=f"perplexity {c.spec}")
    return {"corpus": c.spec, "loaded": c.loaded, **res, "seconds": time.perf_counter() - t}


def mia_section(o: EvalOptions, model: Any, tok: Any, ref: Any,
                sets: tuple[EvalCorpus, EvalCorpus, str, int], progress: bool = True,
                grid: ProcessGrid | None = None, starts: tuple[list[int], list[int]] | None = None
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The report's `mia` (every attack's AUC/TPR (+ CIs) and the blind baseline beside them) and one row
    per scored document: its id, whether it is a member, and each attack's score (higher = member).
    `starts`: the members' and non-members' first scored tokens (conversations: each answer given its
    prompt, evals.mia.score_sequences), or None for every token."""
    t = time.perf_counter()
    m, n, source, cut = sets
    scores = score_both(model, m.seqs, n.seqs, tokenizer=tok, ref_model=ref, k=o.mia_k,
                        batch_size=o.batch_size, grid=grid, progress=progress, starts=starts)
    methods = mia_metrics(*scores, bootstrap=o.bootstrap, seed=o.seed)
    blind = scored_blind(tok, m.seqs, n.seqs, starts, bootstrap=o.bootstrap, seed=o.seed)
    counts = {"members": len(m.seqs), "non_members": len(n.seqs), "members_loaded": m.loaded,
              "non_members_loaded": n.loaded, "member_tokens": sum(map(len, m.seqs)),
              "non_member_tokens": sum(map(len, n.seqs))}
    rows = score_rows(m.ids, n.ids, *scores)
    section = {"members": m.spec, "non_members": n.spec, "source": source, "max_tokens": cut,
               "reference": o.reference,
               "k": o.mia_k, "bootstrap": o.bootstrap, "seed": o.seed, "counts": counts, "methods": methods,
               "blind": blind, "warning": shift_warning(blind, f"`{m.spec}`", f"`{n.spec}`"),
               "seconds": time.perf_counter() - t}
    if starts:
        section["scored"] = ANSWERS_SCORED
    return section, rows


ANSWERS_SCORED = "each conversation's answer given its prompt (the tokens training supervises)"


def scored_blind(tok: Any, members: Sequence[Sequence[int]], nonmembers: Sequence[Sequence[int]],
                 starts: tuple[list[int], list[int]] | None, *, bootstrap: int, seed: int) -> dict[str, Any]:
    """The blind baseline (evals.blind, no model) on the texts the attacks scored: each sequence as cut, or
    from its start (`starts`: a conversation's answer)."""
    first = starts or ([0] * len(members), [0] * len(nonmembers))
    return blind_baseline([tok.decode(s[f:]) for s, f in zip(members, first[0])],
                          [tok.decode(s[f:]) for s, f in zip(nonmembers, first[1])], bootstrap=bootstrap,
                          seed=seed)
