"""The memorization callback's files, rewritten after every scored pass: passes.jsonl, report.json,
report.md (a per-pass table, then the last pass as `memorize eval`'s report.md tells it), PNGs and the
last pass's extraction.jsonl. Text files land all at once (memorization.outputs.write_files)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evals import to_jsonl
from memorization.eval.files import markdown_report
from memorization.eval.utility import headline
from memorization.experiments.injection import MASKED_COLUMNS, SPLIT_NOTE, injected_questions
from memorization.experiments.reporting import figure, json_safe, save
from memorization.outputs import write_files
from memorization.paired import paired_table
from memorization.report import markdown_table

FILES = ("passes.jsonl", "report.json", "report.md", "extraction.jsonl", "memorization-passes.png")


def flat_metrics(rec: dict[str, Any], prefix: str = "memorization") -> dict[str, float]:
    """The numbers of one pass as flat `prefix/name` keys for the Trainer's log (W&B, TensorBoard, ...)."""
    out: dict[str, float] = {f"{prefix}/pass": rec["pass"]}
    ex = rec.get("extraction")
    if ex:
        out.update({f"{prefix}/exact_match": ex["exact_match_rate"], f"{prefix}/rougeL": ex["rougeL"],
                    f"{prefix}/token_accuracy": ex["token_accuracy"]})
    for method, v in ((rec.get("mia") or {}).get("methods") or {}).items():
        out[f"{prefix}/mia_auc_{method}"] = v["auc"]
        out[f"{prefix}/mia_tpr_at_1pct_fpr_{method}"] = v["tpr_at_1pct_fpr"]
        if v.get("auc_ci"):
            out[f"{prefix}/mia_auc_{method}_low"], out[f"{prefix}/mia_auc_{method}_high"] = v["auc_ci"]
    for p in rec.get("perplexity") or []:
        out[f"{prefix}/held_out_loss"] = p["loss"]
    for d in rec.get("duplicates") or []:
        out[f"{prefix}/duplicates_x{d['count']}_exact_match"] = d["exact_match_rate"]
    for c in rec.get("canaries") or []:
        out[f"{prefix}/canaries_x{c['count']}_exposure"] = c["exposure"]
    for key, value in (rec.get("canaries_by_mask") or {}).items():
        if value is not None:
            out[f"{prefix}/canaries_{key.removeprefix('canaries_')}"] = value
    if rec.get("tasks"):
        head = headline(rec["tasks"])
        if head.get("acc") is not None:
            out[f"{prefix}/{head['task']}_acc"] = head["acc"]
    return out


def paired_canaries(records: dict[str, dict[str, Any]], reference: str) -> tuple[str, dict[str, Any]]:
    """(markdown, tests): each run's pass record against `reference`'s on the same canaries (runs that
    injected one manifest, e.g. two arms' last passes), canary by canary: exposure (all, masked,
    unmasked), extraction, kept-token exposure (injection.injected_questions, memorization.paired:
    bootstrap interval and sign-flip p, exact McNemar). Empty markdown when no run has canary scores."""
    answers = {name: {"injected": {"canaries": sorted(r.get("canary_scores") or [], key=lambda c: c["id"])}}
               for name, r in records.items()}
    table, tests, notes = paired_table(answers, [(n, reference) for n in answers if n != reference],
                                       injected_questions(), label="run",
                                       missing="score the passes with this version of the callback",
                                       title=f"Paired tests: each run − '{reference}', canary by canary")
    if table is None:
        return "\n".join(notes), {}
    return "\n".join([f"## {table['title']}", "", markdown_table(table["rows"], table["columns"]), "",
                      *notes]) + "\n", tests


def _row(rec: dict[str, Any]) -> dict[str, Any]:
    row = {"pass": rec["pass"], "step": rec["step"]}
    ex = rec.get("extraction") or {}
    row.update({"em": ex.get("exact_match_rate"), "rougeL": ex.get("rougeL")})
    for method, v in ((rec.get("mia") or {}).get("methods") or {}).items():
        ci = v.get("auc_ci")
        row[f"auc_{method}"] = f"{v['auc']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")
    row["loss"] = (rec.get("perplexity") or [{}])[0].get("loss")
    for d in rec.get("duplicates") or []:
        row[f"dup_{d['count']}"] = d["exact_match_rate"]
    for c in rec.get("canaries") or []:
        row[f"can_{c['count']}"] = c["exposure"]
    by_mask = rec.get("canaries_by_mask") or {}
    row.update({f"mask_{k}": by_mask.get(k) for k in _BY_MASK if by_mask})
    return row


_BY_MASK = {"exposure_unmasked": "exposure unmasked", "exposure_masked": "exposure masked",
            "kept_exposure_masked": "masked: exposure of kept tokens"}


def _columns(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    cols = [("pass", "pass", "{}"), ("step", "step", "{}"), ("em", "exact match", "{:.0%}"),
            ("rougeL", "RougeL", "{:.3f}")]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    cols += [(k, f"MIA AUC {k[4:]} [95% CI]", "{}") for k in keys if k.startswith("auc_")]
    cols += [("loss", "held-out loss", "{:.3f}")]
    cols += [(k, f"EM duplicates x{k[4:]}", "{:.0%}") for k in keys if k.startswith("dup_")]
    cols += [(k, f"exposure canaries x{k[4:]}", "{:.1f}") for k in keys if k.startswith("can_")]
    cols += [(k, _BY_MASK[k[5:]], "{:.1f}") for k in keys if k.startswith("mask_")]
    return cols


def _canary_section(last: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """The last pass's canaries by copy count and, where a goldfish mask grouped them, by the mask."""
    rows = last.get("canaries")
    if not rows:
        return []
    cols = [("count", "copies", "{}"), ("canaries", "canaries", "{}"), ("exposure", "exposure", "{:.2f}"),
            ("extracted", "extracted", "{:.0%}")]
    if last.get("canaries_by_mask"):
        cols += list(MASKED_COLUMNS)
        each = last["canary_scores"]
        rows = rows + [{"count": "all", "canaries": len(each),
                        "exposure": sum(c["exposure"] for c in each) / len(each),
                        "extracted": sum(c["extracted"] for c in each) / len(each),
                        **last["canaries_by_mask"]}]
    note = f"Exposure in bits, out of {rows[0]['max_exposure']:.2f}."
    if settings.get("canary_mask"):
        note += f" Grouped by the goldfish mask: {settings['canary_mask']}."
    if last.get("canaries_by_mask"):
        note += " " + SPLIT_NOTE.replace("base.goldfish's mask", "the mask")
    return [f"## Canaries (pass {last['pass']})", "", markdown_table(rows, cols), "", note, ""]


def write_report(out: Path, records: list[dict[str, Any]], results: list[Any], settings: dict[str, Any]
                 ) -> None:
    """Write every file of the callback into `out` (main process only)."""
    records = json_safe(records)
    rows = [_row(r) for r in records]
    png = _plot(records, out)
    last = records[-1]
    sections = {k: last[k] for k in ("extraction", "mia", "perplexity", "tasks") if last.get(k)}
    eval_like = {"model": settings.get("model", "the model being trained"),
                 "max_tokens": settings["max_tokens"], "seconds": last.get("seconds", 0.0), **sections}
    md = ["# Memorization pass by pass", "", markdown_table(rows, _columns(rows)), "",
          "Pass 0 = before training; each later pass is scored in place at the end of an epoch "
          "(or every N steps) with `memorize eval`'s evaluators and settings.", "",
          f"![memorization per pass]({png.name})", "", *_canary_section(last, settings),
          f"## The last pass (pass {last['pass']})", "",
          markdown_report(eval_like).split("\n", 2)[2]]
    files = {"passes.jsonl": "".join(json.dumps(r) + "\n" for r in records),
             "report.json": json.dumps({"title": "Memorization pass by pass", "settings": settings,
                                        "passes": records}, indent=2) + "\n",
             "report.md": "\n".join(md)}
    if results:
        files["extraction.jsonl"] = to_jsonl(results)
    write_files(out, files, replace=("passes.jsonl", "report.json", "report.md", "extraction.jsonl"))


def _plot(records: list[dict[str, Any]], out: Path) -> Path:
    """Exact match (members, duplicates by copy count), MIA AUC with CIs, and held-out loss per pass."""
    out.mkdir(parents=True, exist_ok=True)
    fig, (a1, a2, a3) = figure(3, width=4.6)
    xs = [r["pass"] for r in records]
    if records[0].get("extraction"):
        a1.plot(xs, [r["extraction"]["exact_match_rate"] for r in records], "o-", label="members")
    counts = [d["count"] for d in records[0].get("duplicates") or []]
    for i, c in enumerate(counts):
        a1.plot(xs, [r["duplicates"][i]["exact_match_rate"] for r in records], "x--",
                label=f"duplicates x{c}")
    a1.set(xlabel="pass", ylabel="exact match", ylim=(-0.02, 1.02), title="Verbatim extraction")
    if a1.lines:
        a1.legend(fontsize=7)
    for method in ((records[0].get("mia") or {}).get("methods") or {}):
        vals = [r["mia"]["methods"][method] for r in records]
        line, = a2.plot(xs, [v["auc"] for v in vals], "o-", label=method)
        if all(v.get("auc_ci") for v in vals):
            a2.fill_between(xs, [v["auc_ci"][0] for v in vals], [v["auc_ci"][1] for v in vals],
                            color=line.get_color(), alpha=0.12)
    a2.axhline(0.5, color="grey", lw=0.8, ls=":")
    a2.set(xlabel="pass", ylabel="ROC AUC", ylim=(0.0, 1.02), title="Membership inference")
    if a2.lines[:-1]:
        a2.legend(fontsize=7)
    if records[0].get("perplexity"):
        a3.plot(xs, [r["perplexity"][0]["loss"] for r in records], "o-")
    a3.set(xlabel="pass", ylabel="nats / token", title="Held-out loss")
    return save(fig, out / "memorization-passes.png")
