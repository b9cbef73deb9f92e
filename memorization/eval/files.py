"""The files of `memorize eval`: the --out check and the report.md tables (written all at once at the end:
memorization.outputs.write_files)."""
from __future__ import annotations

import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

from memorization.config import change_words
from memorization.eval.utility import task_table
from memorization.outputs import check_writable
from memorization.train.run_plan import RESULT_FILES
from memorize_core import fail

# sampled.jsonl: one line per (offset, document) of the extraction beyond greedy (sections.sampled_section);
# mia.jsonl: one line per member and non-member with each attack's score (sections.mia_section)
# near_verbatim.jsonl: one line per (offset, document) of the near-verbatim bounds (near_verbatim_section)
EVAL_FILES = ("report.json", "report.md", "report.png", "extraction.jsonl", "sampled.jsonl",
              "near_verbatim.jsonl", "mia.jsonl", "lm-eval.log")


def check_eval_out(out: str, overwrite: bool) -> Path:
    """Raise unless --out can take eval results (existing results need --overwrite); create nothing."""
    path = Path(out)
    check_writable("--out", out)  # before any work: permission, read-only, not a folder, no space
    # A training run's results count too: an eval must not silently land beside them.
    taken = [n for n in dict.fromkeys(EVAL_FILES + tuple(RESULT_FILES)) if (path / n).exists()]
    if taken and not overwrite:
        raise fail("--out", out, f"already holds results ({', '.join(taken)}); choose a new folder or "
                   "pass --overwrite")
    return path


BLIND_NOTE = ("The blind baseline is a text classifier with no model (word and character n-grams, "
              "logistic regression, cross-validated): it measures how different the two sets are, not "
              "membership. Near 0.5 the sets are alike and the attacks' AUCs are about membership; when "
              "its interval lies above {threshold} the sets differ in distribution and an attack's AUC "
              "can come from that shift alone (Das et al. 2024; Duan et al. 2024).")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _ci(point: float, ci: list[float] | None) -> str:
    return f"{point:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _sampled(smp: dict[str, Any], rows_file: bool) -> list[str]:
    """report.md's extraction beyond greedy: per offset, greedy exact match and the (n, p) fractions."""
    ns = smp["ns"]
    rows = []
    for offset, at in smp["offsets"].items():
        em = "–" if at["exact_match_rate"] is None else f"{at['exact_match_rate']:.3f}"
        for name, per in (at["np"] or {"schemes": {}})["schemes"].items():
            rows.append([offset, str(at["docs"]), em, f"`{name}`",
                         *[f"{per[f'n={n}']['fraction']:.3f}" for n in ns]])
    where = ("Each response from its whole prompt (offset 0)" if smp.get("prefix") == "prompt"
             else "Per prefix offset into the document")
    return [f"### Beyond greedy: (n, p)-extractable at p = {smp['p']}",
            f"{where}: greedy exact match (one teacher-forced forward) and, per "
            "sampling scheme, the fraction of documents whose suffix n samples give at least once with "
            f"probability >= {smp['p']} (Hayes et al. 2024)"
            + ("; log p_z per document in sampled.jsonl." if rows_file else "."),
            _table(["offset", "docs", "exact match", "scheme", *[f"n={n}" for n in ns]], rows)]


def _near(nv: dict[str, Any], rows_file: bool) -> list[str]:
    """report.md's near-verbatim section: per offset, scheme and d, the (n, p) fractions of the bound."""
    ns = nv["ns"]
    rows = []
    word, phrase = change_words(nv.get("distance"))
    how = ("edit distance: tokens substituted, inserted or deleted" if nv.get("distance") == "levenshtein"
           else "Hamming distance: tokens substituted in place")
    for offset, at in nv["offsets"].items():
        for name, summary in (at["np"] or {}).items():
            for col, per in summary["schemes"].items():
                med = at["median_log10"][name][col]
                rows.append([offset, str(at["docs"]), f"`{name}`", col.replace("d=", "<= "),
                             "–" if med is None else f"{med:.1f}",
                             *[f"{per[f'n={n}']['fraction']:.3f}" for n in ns]])
    return [f"### Near-verbatim: (n, p)-extractable within d {phrase}, p = {nv['p']}",
            f"A lower bound of the probability that a sample under the scheme lies within d {phrase} "
            f"of the {nv['suffix']}-token suffix ({how}; d = 0 is the exact copy), from a beam "
            f"search kept inside that neighbourhood ({nv['beams']} paths per number of changes, the verbatim "
            "one always kept): the fractions are of documents whose bound alone passes the (n, p) test, so "
            "they can only be higher in truth"
            + ("; each document's bounds and likeliest near-copy in near_verbatim.jsonl." if rows_file
               else "."),
            _table(["offset", "docs", "scheme", phrase, "median log10 P", *[f"n={n}" for n in ns]],
                   rows), *_near_examples(nv.get("examples") or [], word)]


def _near_examples(examples: list[dict[str, Any]], word: str) -> list[str]:
    """The likeliest near-copies (not exact), the truth beside each."""
    if not examples:
        return []
    lines = [f"- `{x['doc']}` (offset {x['offset']}, `{x['scheme']}`, {x['edits']} "
             f"{word[:-1] if word == 'edits' and x['edits'] == 1 else word}, one sample "
             f"emits it with probability {math.exp(x['logp']):.2e}):\n  true: {x['suffix']!r}\n  "
             f"near: {x['text']!r}" + (f"\n  diff: {x['diff']!r}" if x.get("diff") else "") for x in examples]
    return ["Likeliest near-copies found (not exact):", "\n".join(lines)]


def markdown_report(report: dict[str, Any], figure: str | None = None,
                    row_files: Collection[str] = ()) -> str:
    """report.md: the extraction summary, the MIA table with intervals, perplexity and downstream tasks;
    `figure` (report.png's name) is shown after them; `row_files` are the per-document files written
    beside it (sampled.jsonl, near_verbatim.jsonl, mia.jsonl), named where their section is."""
    # the cut is said where documents were scored with it (a tasks-only report has none; MIA says its own)
    docs = [k for k in ("extraction", "perplexity") if report.get(k)]
    cut = f"Documents cut to their first {report['max_tokens']} tokens; " if docs else ""
    parts = [f"# memorize eval: `{report['model']}`", f"{cut}{report['seconds']:.1f} s in all."]
    ex = report.get("extraction")
    if ex:
        how = "Greedy" if ex["beams"] == 1 else f"Beam search ({ex['beams']} beams)"
        dec = ex.get("decode") or {}
        if dec.get("path") == "static":
            how += (f" (compiled static-cache decode, each row checked by a teacher-forced forward: "
                    f"{dec['verified']} of {dec['rows']} passed, {dec['redecoded']} decoded again)")
        chat = ex["prefix"] is None  # conversations: the prompt is the prefix
        of = (f"each prompt, scored on the first {ex['suffix']} tokens of its response" if chat
              else f"a {ex['prefix']}-token prefix, scored on the next {ex['suffix']} tokens")
        parts += [f"## Extraction: `{ex['corpus']}`", f"{how} continuation of {of}.",
                  _table(["docs", "exact match", "token accuracy", "LCP (tokens)", "RougeL"],
                         [[str(ex["docs"]), f"{ex['exact_match_rate']:.3f}", f"{ex['token_accuracy']:.3f}",
                           f"{ex['lcp_mean']:.2f}", f"{ex['rougeL']:.3f}"]])]
        if report.get("sampled"):
            parts += _sampled(report["sampled"], "sampled.jsonl" in row_files)
        if report.get("near_verbatim"):
            parts += _near(report["near_verbatim"], "near_verbatim.jsonl" in row_files)
    mia = report.get("mia")
    if mia:
        c = mia["counts"]
        level = " [95% CI]" if mia["bootstrap"] else ""
        note = (f"95% percentile intervals from {mia['bootstrap']} stratified bootstrap resamples "
                f"(seed {mia['seed']})." if mia["bootstrap"] else "No bootstrap intervals (--bootstrap 0).")
        methods = dict(mia["methods"])
        if mia.get("blind"):
            methods["blind baseline (no model)"] = mia["blind"]
        rows = [[m, _ci(v["auc"], v.get("auc_ci")), _ci(v["tpr_at_1pct_fpr"], v.get("tpr_at_1pct_fpr_ci")),
                 f"{v['tpr_at_0.1pct_fpr']:.3f}"] for m, v in methods.items()]
        title = (f"## Membership inference: `{mia['members']}` ({c['members']}) vs "
                 f"`{mia['non_members']}` ({c['non_members']})")
        cut = f" Documents cut to {mia['max_tokens']} tokens." if mia.get("max_tokens") else ""
        if mia.get("scored"):
            cut += f" Scored: {mia['scored']}; the blind baseline reads the same tokens."
        parts += [title,
                  f"Higher score = member; Min-K% k = {mia['k']}"
                  + (f"; reference model `{mia['reference']}`." if mia["reference"] else ".")
                  + cut + " " + note
                  + (" Each document's scores are in mia.jsonl." if "mia.jsonl" in row_files else ""),
                  _table(["method", f"AUC{level}", f"TPR@1%FPR{level}", "TPR@0.1%FPR"], rows)]
        if mia.get("blind"):
            parts.append(BLIND_NOTE.format(threshold=mia["blind"]["threshold"]))
        if mia.get("warning"):
            parts.append(f"**{mia['warning']}**")
    ppl = report.get("perplexity")
    if ppl:
        parts += ["## Utility: held-out perplexity",
                  "Token-weighted mean next-token cross-entropy over every token after a document's first.",
                  _table(["corpus", "docs", "scored tokens", "loss (nats/token)", "perplexity"],
                         [[f"`{p['corpus']}`", str(p["docs"]), str(p["scored_tokens"]), f"{p['loss']:.4f}",
                           f"{p['perplexity']:.2f}"] for p in ppl])]
    tasks = report.get("tasks")
    if tasks:
        shots = ("each task's default shots" if tasks["num_fewshot"] is None
                 else f"{tasks['num_fewshot']}-shot")
        limit = f"the first {tasks['limit']} documents of each task" if tasks["limit"] else "every document"
        parts += ["## Utility: downstream tasks (lm-evaluation-harness)",
                  f"{shots}, {limit}, seed {tasks['seed']}; metric ± lm-eval's standard error; "
                  f"{tasks['tokens']:,} tokens scored in {tasks['seconds']:.1f} s.",
                  "\n".join(task_table(tasks))]
    if figure:
        parts.append(f"![extraction, beyond greedy and membership inference]({figure})")
    return "\n\n".join(parts) + "\n"
