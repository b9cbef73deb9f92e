"""What a run measures on its trained model, on the run's grid (evals' one scoring path; call each on
every rank): greedy extraction of every training item, extraction beyond greedy ((n, p) from one forward
per window), near-verbatim bounds, and membership inference. `finish` (memorization/train/pipeline.py)
calls them; the per-pass experiments call the first two after each scored pass."""
from __future__ import annotations

from typing import Any

import torch
from tqdm import tqdm

from axonn.grid import ProcessGrid
from data_pipelines import SecretSpace, render
from data_pipelines.chat import answer_encoder
from memorization.config import RunConfig
from memorization.eval.sections import ANSWERS_SCORED, near_pairs_report, near_report, scored_blind
from memorization.mitigations.goldfish import copy_drops, mask_is_the_documents
from memorization.train.prepare import PreparedData, mia_sets, mia_starts
from memorization.train.run_plan import run_schemes


def extraction_results(model: torch.nn.Module, cfg: RunConfig, data: PreparedData,
                       progress: bool = False, grid: ProcessGrid | None = None,
                       decode_log: Any = None) -> list[Any]:
    """Greedy extraction of every training item: prefix -> suffix of documents,
    prompt -> response of chats. Call it on every rank of `grid` (default: the model's own grid:
    the one it is sharded over, else serial; pass the run's 1,1,1,D grid to split a replica's work).
    Documents are decoded by eval.decode's decoder, reported in `decode_log` (an evals DecodeLog)."""
    from evals import extract, extract_pairs  # deferred: evals +3.2 s import (scikit-learn, rouge-score)

    e = cfg.eval
    if data.is_chat:
        prompts, responses = data.member_pairs  # eval.audit's canaries are not members
        return extract_pairs(model, prompts, responses, tokenizer=data.tokenizer,
                             batch_size=e.batch_size, doc_ids=data.member_doc_ids, progress=progress,
                             grid=grid)
    return extract(model, data.member_docs, prefix_len=e.prefix, suffix_len=e.suffix,
                   tokenizer=data.tokenizer, batch_size=e.batch_size, num_beams=e.num_beams,
                   doc_ids=data.member_doc_ids, progress=progress, grid=grid, decode=e.decode,
                   decode_log=decode_log)


def sampled_results(model: torch.nn.Module, cfg: RunConfig, data: PreparedData,
                    grid: ProcessGrid | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """Extraction beyond greedy of every training document (evals.probabilistic): per eval.offsets, the
    greedy exact-match rate and the (n, p)-extractable fractions of each eval.sampling scheme, from one
    forward per window; and each window's log p_z per scheme (the rows of sampled.jsonl). Chat data: each
    response's p_z from its prompt (evals.probabilistic.sampled_pairs, offset 0). None when there is
    nothing beyond the greedy decode at offset 0 to measure. Call it on every rank of `grid`."""
    from evals.probabilistic import sampled_extraction, sampled_pairs, split_rows  # deferred: evals +3.2 s

    e = cfg.eval
    schemes = run_schemes(cfg)
    if not schemes and (data.is_chat or list(e.offsets) == [0]):
        return None
    if data.is_chat:
        prompts, responses = data.member_pairs
        return split_rows(sampled_pairs(model, prompts, responses, schemes=schemes, ns=e.np_ns, p=e.np_p,
                                        batch_size=e.batch_size, doc_ids=data.member_doc_ids, grid=grid))
    got = sampled_extraction(model, data.member_docs, prefix_len=e.prefix, suffix_len=e.suffix,
                             schemes=schemes, offsets=e.offsets, ns=e.np_ns, p=e.np_p,
                             batch_size=e.batch_size, doc_ids=data.member_doc_ids, grid=grid)
    return split_rows(got)


def near_results(model: torch.nn.Module, cfg: RunConfig, data: PreparedData,
                 grid: ProcessGrid | None = None, progress: bool = False
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """Near-verbatim extraction of every training document (evals.near_verbatim), per eval.offsets and
    eval.sampling scheme: the (n, p) summary of the bound at each d <= eval.near_verbatim and the rows of
    near_verbatim.jsonl (the likeliest path's text decoded); on chat data each response from its prompt.
    None with eval.near_verbatim 0. Call it on every rank of `grid`."""
    e = cfg.eval
    if not e.near_verbatim:
        return None
    if data.is_chat:
        return near_pairs_report(model, *data.member_pairs, data.member_doc_ids, data.tokenizer,
                                 schemes=run_schemes(cfg), **e.near_args(window=False), grid=grid)
    return near_report(model, data.member_docs, data.member_doc_ids, data.tokenizer, schemes=run_schemes(cfg),
                       **e.near_args(), offsets=e.offsets, grid=grid, progress=progress)


def membership(model: torch.nn.Module, cfg: RunConfig, data: PreparedData,
               grid: ProcessGrid | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Membership inference of the trained model (every rank, on `grid`): the first eval.mia_docs
    training documents vs as many held-out ones, each cut to data.block_len; AUC, TPR@1%FPR and
    bootstrap CIs per method (loss, zlib, min-k, min-k++), and one row per document with its id, whether
    it is a member and each method's score (mia.jsonl)."""
    from evals.blind import shift_warning  # deferred: evals +3.2 s import
    from evals.mia import mia_metrics, score_both, score_rows  # deferred: as above (scikit-learn, rouge)

    e = cfg.eval
    members, nonmembers = mia_sets(cfg, data)
    starts = mia_starts(data, len(members), len(nonmembers))  # chat data: the answers given their prompts
    scores = score_both(model, members, nonmembers, tokenizer=data.tokenizer, k=e.mia_k,
                        batch_size=e.batch_size, grid=grid, progress=cfg.trainer.progress, starts=starts)
    methods = mia_metrics(*scores, bootstrap=e.bootstrap, seed=cfg.seed)
    # the texts alone (what the attacks score), beside them: far from 0.5 when data.held_out is another
    # distribution
    blind = scored_blind(data.tokenizer, members, nonmembers, starts, bootstrap=e.bootstrap, seed=cfg.seed)
    held = cfg.data.held_out or f"{cfg.data.corpus} (held-out split)"
    ids = [str(i) for i in data.member_doc_ids[:len(members)]]
    held_ids = [str(i) for i in (data.held_out_doc_ids or [])[:len(nonmembers)]]
    rows = score_rows(ids, held_ids, *scores)
    out = {"members": len(members), "non_members": len(nonmembers), "k": e.mia_k, "methods": methods,
           "blind": blind, "warning": shift_warning(blind, cfg.data.corpus, held)}
    if starts:
        out["scored"] = ANSWERS_SCORED
    return out, rows


def secret_results(model: torch.nn.Module, cfg: RunConfig, data: PreparedData,
                   progress: bool = False) -> dict[str, Any] | None:
    """eval.secrets: each record's secret scored as the answer to its own prompt (memorization/eval/
    exposure.py, in the chat template): exposure estimated from eval.secrets sampled secrets of its space,
    and whether it beats all of them (extracted), for the trained records and the held-out ones; every
    rank, on the model's grid. None when off."""
    from memorization.eval.exposure import canary_scores  # deferred: evals +3.2 s import

    if not cfg.eval.secrets or not data.secrets:
        return None
    tok, rows = data.tokenizer, []
    # records grouped by the secret tokens the run's goldfish mask drops in their rows (its settings, in a
    # standard-loss run too, so two runs group the records alike), where every copy drops the same ones
    grouped = mask_is_the_documents(cfg.goldfish.strategy, False)
    for r in tqdm(data.secrets, desc="secrets", unit="record", disable=not progress):
        # the record's ids as it trained (checked against its whole rendering), its secret from `start`
        encode = answer_encoder(tok, r["prompt"], check=[render(r["template"], r["secret"])])
        dropped = copy_drops(cfg.goldfish, False, len(encode([""])[0]))  # None where not `grouped`
        scores = canary_scores(model, tok, r["template"], SecretSpace(**r["space"]), [r["secret"]],
                               candidates=cfg.eval.secrets, seed=cfg.seed, encode=encode, dropped=dropped)
        c = scores["canaries"][0]
        rows.append({"id": r["id"], "member": r["member"], "exposure": c["exposure"],
                     "extracted": c["extracted"], "logppl_bits": c["logppl_bits"],
                     "secret_tokens_dropped": c.get("secret_tokens_dropped")})

    def group(mine: list[dict[str, Any]]) -> dict[str, Any]:
        return {"records": len(mine),
                "exposure_mean": sum(x["exposure"] for x in mine) / len(mine) if mine else None,
                "extracted": sum(x["extracted"] for x in mine)}

    def side(member: bool) -> dict[str, Any]:
        mine = [x for x in rows if x["member"] == member]
        by_mask = {name: group([x for x in mine if bool(x["secret_tokens_dropped"]) == masked])
                   for name, masked in (("masked", True), ("unmasked", False))} if grouped else {}
        return {**group(mine), **by_mask}
    return {"candidates": cfg.eval.secrets, "space_size": scores["space_size"],
            "max_exposure": scores["max_exposure"], "members": side(True), "non_members": side(False),
            "mask": {"strategy": cfg.goldfish.strategy, "k": cfg.goldfish.k, "h": cfg.goldfish.h,
                     "applied": cfg.goldfish.enabled} if grouped else None,
            "rows": rows}
