"""report.md and report.png of one training run (`memorize train`, and each sub-run of an experiment).

What the run wrote into run.json and metrics.jsonl, told for a reader: what was trained and how long,
the losses, then the trained model's evaluation as `memorize eval`'s report.md tells it (extraction,
beyond greedy, membership inference), the privacy audit and the goldfish coverage. report.png: the
training loss per step (and the loss on the tokens goldfish dropped), the extraction's matched-length
histogram, and each attack's AUC with its 95% interval. Written by the main rank at the end of the run,
both files at once (memorization.outputs.write_files)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data_pipelines import is_chat_spec
from memorization.config import RunConfig
from memorization.eval.files import markdown_report
from memorization.eval.plots import best_effort, extraction_panel, near_panel, panels_png, sampled_panel
from memorization.outputs import write_files

REPORT_FILES = ("report.md", "report.png")


def _fmt(v: Any, spec: str) -> str:
    return "–" if v is None or v != v else format(v, spec)  # None and NaN: not measured


def _eval_like(summary: dict[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """The summary's evaluation in the shape of `memorize eval`'s report (its markdown tells it)."""
    e, d = cfg.eval, cfg.data
    out: dict[str, Any] = {"model": cfg.model.name, "max_tokens": d.block_len, "seconds": 0.0}
    if summary.get("docs") and summary.get("exact_match_rate") is not None:
        prefix = None if is_chat_spec(d.corpus) else e.prefix  # conversations: the prompt is the prefix
        out["extraction"] = {"corpus": d.corpus, "prefix": prefix, "suffix": e.suffix, "beams": e.num_beams,
                             **{k: summary[k] for k in ("docs", "exact_match_rate", "token_accuracy",
                                                        "lcp_mean", "rougeL")},
                             "decode": summary.get("extraction_decode")}
        if summary.get("sampled"):
            out["sampled"] = {**summary["sampled"], "ns": list(e.np_ns), "p": e.np_p}
        if summary.get("near_verbatim"):
            out["near_verbatim"] = {**summary["near_verbatim"], "ns": list(e.np_ns), "p": e.np_p}
    mia = summary.get("mia")
    if mia:
        held = d.held_out or f"{d.corpus} (held-out split)"
        out["mia"] = {"members": d.corpus, "non_members": held, "reference": None, "k": mia["k"],
                      "bootstrap": e.bootstrap, "seed": cfg.seed, "max_tokens": d.block_len,
                      "counts": {"members": mia["members"], "non_members": mia["non_members"]},
                      "methods": mia["methods"], "blind": mia.get("blind"), "warning": mia.get("warning")}
        if mia.get("scored"):
            out["mia"]["scored"] = mia["scored"]
    return out


def markdown(summary: dict[str, Any], cfg: RunConfig, figure: str | None,
             row_files: Sequence[str] = ()) -> str:
    """report.md of the run; `row_files` are the per-document files written beside it (named where their
    section is)."""
    s = summary
    loss = s["loss"] if s["loss"] != "goldfish" else (
        f"goldfish ({s['goldfish_strategy']}, k={s['goldfish_k']}, h={s['goldfish_h']})")
    params, trainable = _fmt(s.get("params"), ","), _fmt(s.get("trainable_params"), ",")
    trained = (f"`{s['model']}` ({params} parameters, {trainable} trained), {loss} loss, {s['steps']} steps "
               f"({s['epochs']} passes over {cfg.data.corpus}, {s['tokens']:,} tokens) in "
               f"{s['train_seconds']} s")
    trained += (f" on grid {s['grid']}." if s.get("grid") else ".")
    if s.get("epsilon") is not None:
        trained += f" DP-SGD: epsilon {s['epsilon']:.2f} at delta {s.get('delta', 0):.1e} (the accountant's)."
    head = ["| final training loss | held-out loss |", "|---|---|",
            f"| {_fmt(s.get('final_train_loss'), '.4f')} | {_fmt(s.get('val_loss'), '.4f')} |"]
    parts = [f"# memorize train: `{s['name']}`", trained, "\n".join(head)]
    evaluated = _eval_like(s, cfg)
    if len(evaluated) > 3:  # a section beyond model, max_tokens and seconds
        # markdown_report's title and timing lines are eval's; its sections are the run's
        parts.append(markdown_report(evaluated, row_files=row_files).split("\n\n", 2)[2].rstrip("\n"))
    audit = s.get("audit")
    if audit:
        nominal = (f"; the accountant's epsilon is {s['epsilon']:.2f}" if s.get("epsilon") is not None
                   else "; the run has no DP-SGD, so no epsilon to honour")
        parts += ["## Privacy audit (one run)",
                  f"{audit['m']} audit canaries"
                  + (f" (each the answer to {audit['prompt']!r}, scored by its answer tokens)"
                     if audit.get("prompt") else "")
                  + f", {audit['included']} of them trained on. Guessing from their "
                  f"losses which were, the audit guessed {audit['guesses']} and was right {audit['correct']} "
                  f"times: epsilon >= **{audit['eps_lower_bound']:.2f}** at {audit['confidence']:.0%} "
                  f"confidence{nominal}."]
    sec = s.get("secrets")
    if sec:
        m, n = sec["members"], sec["non_members"]

        def said(g: dict[str, Any], who: str) -> str:
            if not g["records"]:
                return f"no {who} records"
            return (f"{g['records']} {who} records: exposure {g['exposure_mean']:.2f} bits on average, "
                    f"{g['extracted']} extracted")
        parts += ["## Secrets of the records (eval.secrets)",
                  f"Each record's secret scored as the answer to its own prompt, ranked among "
                  f"{sec['candidates']:,} sampled secrets of its space (|R| = {sec['space_size']:,}, at most "
                  f"{sec['max_exposure']:.2f} bits; extracted = it beats all of them). {said(m, 'trained')}; "
                  f"{said(n, 'held-out')} (never trained: what the model gives without having seen them)."]
        mask = sec.get("mask")
        if mask and mask["applied"]:  # goldfish trained the run: which secrets it never showed a token of
            parts.append(
                f"Grouped by the goldfish mask ({mask['strategy']}, k={mask['k']}, h={mask['h']}; it depends "
                "on the tokens only, so a standard-loss run with these settings groups the records alike): "
                f"trained, {said(m['masked'], 'masked')} (a secret token never trained) and "
                f"{said(m['unmasked'], 'unmasked')} (every secret token trained).")
    cov = s.get("goldfish_coverage")
    if cov:
        parts += ["## Goldfish coverage of the near-duplicate clusters",
                  f"{cov['clusters']} clusters of training documents that share repeated 13-token spans: the "
                  f"union of a cluster's copies supervises {cov['coverage']:.1%} of its original's tokens "
                  f"({cov['suffix_coverage']:.1%} of the extraction suffix); "
                  f"{cov['clusters_fully_covered']} clusters have every token supervised by some copy."]
        parts += [f"- warning: {w}" for w in cov.get("warnings") or []]
    if figure:
        parts.append(f"![training loss, extraction and membership inference]({figure})")
    return "\n\n".join(parts) + "\n"


def _loss(ax: Any, history: Sequence[dict[str, Any]], val_loss: float | None) -> None:
    steps = [m["step"] for m in history]
    ax.plot(steps, [m["loss"] for m in history], label="supervised tokens")
    dropped = [(m["step"], m["dropped_loss"]) for m in history if m.get("dropped_loss") is not None]
    if dropped:
        ax.plot(*zip(*dropped), linestyle="--", alpha=0.8, label="tokens goldfish dropped")
    if val_loss is not None and val_loss == val_loss and steps:
        ax.plot([steps[-1]], [val_loss], "ks", label="held-out (end)")
    ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="loss (nats/token)")
    ax.set_title("Training loss", fontsize=10)
    ax.legend(fontsize=7)


def _auc(ax: Any, mia: dict[str, Any]) -> None:
    methods = dict(mia["methods"])
    if mia.get("blind"):  # the sets' distribution shift, without the model
        methods["blind (no model)"] = mia["blind"]
    names = list(methods)
    aucs = [methods[m]["auc"] for m in names]
    cis = [methods[m].get("auc_ci") for m in names]
    err = None
    if all(cis):
        err = [[a - c[0] for a, c in zip(aucs, cis)], [c[1] - a for a, c in zip(aucs, cis)]]
    colours = ["grey" if m.startswith("blind") else "tab:purple" for m in names]
    ax.bar(range(len(names)), aucs, yerr=err, capsize=3, color=colours)
    ax.axhline(0.5, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=7)
    ax.set(ylim=(0, 1.02), ylabel="ROC AUC (95% CI)")
    ax.set_title(f"Membership inference: {mia['members']} vs {mia['non_members']}", fontsize=10)


def png(summary: dict[str, Any], history: Sequence[dict[str, Any]], results: Sequence[Any] | None,
        sampled_rows: Sequence[dict[str, Any]] | None, cfg: RunConfig,
        near_rows: Sequence[dict[str, Any]] | None = None) -> bytes:
    """report.png of the run: the loss panel, and the extraction, beyond-greedy, near-verbatim and MIA
    panels where they ran."""
    panels = [lambda ax: _loss(ax, history, summary.get("val_loss"))]
    if results:
        ex = {"suffix": cfg.eval.suffix, "beams": cfg.eval.num_beams}
        panels.append(lambda ax: extraction_panel(ax, ex, results))
    if sampled_rows:
        smp = {"ns": list(cfg.eval.np_ns), "p": cfg.eval.np_p}
        panels.append(lambda ax: sampled_panel(ax, smp, sampled_rows))
    if near_rows and summary.get("near_verbatim"):
        nv = {**summary["near_verbatim"], "ns": list(cfg.eval.np_ns), "p": cfg.eval.np_p}
        panels.append(lambda ax: near_panel(ax, nv, near_rows))
    if summary.get("mia"):
        panels.append(lambda ax: _auc(ax, summary["mia"]))
    return panels_png(panels)


def write_run_report(out: Path, summary: dict[str, Any], history: Sequence[dict[str, Any]],
                     results: Sequence[Any] | None, sampled_rows: Sequence[dict[str, Any]] | None,
                     cfg: RunConfig, *, row_files: Sequence[str] = (),
                     near_rows: Sequence[dict[str, Any]] | None = None) -> None:
    """report.md and report.png into the run's folder (main rank only); `row_files`: the per-document
    files the run wrote beside them; `near_rows`: near_verbatim.jsonl's rows (its panel)."""
    image = best_effort(png, summary, history, results, sampled_rows, cfg, near_rows)
    files = {"report.md": markdown(summary, cfg, "report.png" if image else None, row_files)}
    if image is not None:
        files["report.png"] = image
    write_files(out, files, replace=REPORT_FILES)
