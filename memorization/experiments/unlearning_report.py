"""The unlearning experiment's report: forget vs retain after unlearning, per pass, under relearning."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from memorization.experiments.beyond_greedy import NP_NOTE
from memorization.experiments.mitigations import BASELINE_ROW, BEYOND_INDEX, PZ_FLOOR, beyond_table
from memorization.experiments.questions import format_acc, format_auc, task_label
from memorization.experiments.reporting import Outputs, Table, figure, save
from memorization.paired import Question, align, paired_table, per_document
from memorization.train.prepare import is_chat_data

FINE_TUNED = "fine-tuned"  # the row of the model before any method (OUT/runs/fine-tune)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _auc(v: dict[str, Any], group: str, method: str) -> float | None:
    return ((v.get("mia") or {}).get(group, {}).get(method) or {}).get("auc")


def flat(v: dict[str, Any], method: str) -> dict[str, Any]:
    """One model's answers as table cells: forget vs retain for every question."""
    c, d = v["canaries"], v["duplicates"]
    return {"em_forget": v["leads"]["forget"]["exact_match_rate"],
            "em_retain": v["leads"]["retain"]["exact_match_rate"],
            "em_relearned": v["leads"]["relearned"]["exact_match_rate"],
            # MUSE's VerbMem: ROUGE-L of the greedy continuation against the true suffix
            "rl_forget": v["leads"]["forget"]["rougeL"], "rl_retain": v["leads"]["retain"]["rougeL"],
            "rl_relearned": v["leads"]["relearned"]["rougeL"],
            "rl_dup_forget": _mean([x["rougeL"] for x in d["forget"]]),
            "dup_forget": _mean([float(x["exact_match"]) for x in d["forget"]]),
            "dup_retain": _mean([float(x["exact_match"]) for x in d["retain"]]),
            "exp_forget": _mean([x["exposure"] for x in c["forget"]]),
            "exp_retain": _mean([x["exposure"] for x in c["retain"]]),
            "ext_forget": _mean([float(x["extracted"]) for x in c["forget"]]),
            "ext_retain": _mean([float(x["extracted"]) for x in c["retain"]]),
            "auc_forget": format_auc(v["mia"]["forget"].get(method)),
            "auc_forget_value": _auc(v, "forget", method),
            "auc_retain": format_auc(v["mia"]["retain"].get(method)),
            "val": v["val_loss"], "other": v["other_val_loss"], "ds": format_acc(v.get("downstream"))}


def _stage(m: dict[str, Any]) -> str:
    """What a method's model is before the attack."""
    return "retrained" if m["method"] == "retrain" else "unlearned"


def _settings_words(m: dict[str, Any]) -> str:
    """A method's settings in words (each may override the shared `unlearn` block)."""
    s = m["settings"]
    words = f"{m['name']} lr {s['lr']:g}, {s['passes']} passes, {s['forget_batch']} forget rows"
    if m["method"] != "ga":
        words += f" + {s['retain_batch']} retain rows (weight {s['retain_weight']:g})"
    return words + (f" per step, beta {s['beta']:g}" if m["method"] == "npo" else " per step")


def _final(m: dict[str, Any]) -> dict[str, Any]:
    """A method's answers after it ran (its last pass; retrain's trained model)."""
    return m["passes"][-1]


def _stages(m: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(attack, stage, answers): the method's model as it was left (attack ""), then after each relearning
    attack. The attack is what replicates pair a method with retrain within."""
    return [("", _stage(m), _final(m))] + [(a, f"+ {a} attack", v) for a, v in m["attacks"].items()]


MARKERS = {"leads": "x", "prefixes": "+", "near-copies": "^"}  # the plot's mark of each attack
ATTACK_WORDS = {
    "leads": "half the forget leads, whole ('relearned'; the probed leads, secrets and duplicated leads are "
             "unrelated to them)",
    "prefixes": "the first {prefix} tokens of every forget lead and forget duplicated lead (extraction's "
                "prompts), never a suffix token",
    "near-copies": "near-copies of every forget lead and forget duplicated lead, each word substituted with "
                   "probability {rate:g} by a corpus word",
}

CHAT_ATTACK_WORDS = {  # on chat data (the leads attack's words are ATTACK_WORDS' with conversations)
    "prefixes": "the prompts of every forget conversation and forget duplicated conversation (extraction's "
                "prompts) trained as plain text, never an answer token",
    "near-copies": "every forget conversation and forget duplicated conversation with each word of its "
                   "answer substituted with probability {rate:g} by a word of the corpus' answers",
}


def _conversations(text: str) -> str:
    """What chat data calls the corpus items the report's words call leads (the attack keeps its name)."""
    return re.sub(r"\blead(s?)\b(?! attack)", r"conversation\1", text)


def outputs(cfg: Any, methods: list[dict[str, Any]], before: dict[str, Any], baseline: dict[str, Any] | None,
            split: Any, n_forget: int, n_rows: int, out: Path) -> Outputs:
    """Tables, notes and the plot of the unlearning experiment (on chat data the items are conversations,
    asked prompt -> answer)."""
    chat = is_chat_data(cfg.base)
    mia = cfg.mia_methods[0]
    gold = next((m for m in methods if m["method"] == "retrain"), None)
    gold_auc = _auc(_final(gold), "forget", mia) if gold else None
    rows = []
    for name, kind, steps, v in ([(BASELINE_ROW, "not fine-tuned", None, baseline)] if baseline else []) + \
            [(FINE_TUNED, "before unlearning", None, before)] + \
            [(m["name"], m["method"], m["steps"], _final(m)) for m in methods]:
        r = {"name": name, "method": kind, "steps": steps, **flat(v, mia)}
        r["privleak"] = ((r["auc_forget_value"] - gold_auc) / gold_auc
                         if gold_auc and r["auc_forget_value"] is not None and name != BASELINE_ROW else None)
        rows.append(r)
    cols = [("name", "model", "{}"), ("method", "method", "{}"), ("steps", "steps", "{}"),
            ("em_forget", "EM forget leads", "{:.0%}"), ("rl_forget", "ROUGE-L forget leads", "{:.2f}"),
            ("em_retain", "EM retain leads", "{:.0%}"), ("rl_retain", "ROUGE-L retain leads", "{:.2f}"),
            ("dup_forget", "EM forget dup.", "{:.0%}"), ("dup_retain", "EM retain dup.", "{:.0%}"),
            ("exp_forget", "forget exposure", "{:.2f}"), ("exp_retain", "retain exposure", "{:.2f}"),
            ("ext_forget", "forget secrets extracted", "{:.0%}"),
            ("ext_retain", "retain secrets extracted", "{:.0%}"),
            ("auc_forget", f"MIA AUC {mia} forget [95% CI]", "{}")]
    cols += [("privleak", "PrivLeak vs retrain", "{:+.0%}")] if gold else []
    cols += [("auc_retain", f"MIA AUC {mia} retain", "{}"), ("val", "held-out loss", "{:.3f}")]
    cols += [("other", f"{cfg.other_held_out} loss", "{:.3f}")] if cfg.other_held_out else []
    cols += [("ds", f"{task_label(cfg)} ± SE", "{}")] if cfg.downstream else []
    per_pass = [{"name": m["name"], "pass": p["pass"], "step": p["step"], **flat(p, mia)}
                for m in methods if m["method"] != "retrain"
                for p in [{"pass": 0, "step": 0, **before}] + m["passes"]]
    pcols = (("name", "method", "{}"), ("pass", "passes", "{}"), ("step", "steps", "{}"),
             ("em_forget", "EM forget leads", "{:.0%}"), ("rl_forget", "ROUGE-L forget leads", "{:.2f}"),
             ("dup_forget", "EM forget dup.", "{:.0%}"),
             ("exp_forget", "forget exposure", "{:.2f}"), ("exp_retain", "retain exposure", "{:.2f}"),
             ("auc_forget", f"MIA AUC {mia} forget", "{}"), ("em_retain", "EM retain leads", "{:.0%}"),
             ("val", "held-out loss", "{:.3f}"))
    tables = [Table("Forget and retain after unlearning", rows, tuple(cols)),
              Table("After each pass over the forget rows", per_pass, pcols, ("name", "pass"))]
    attack = [{"name": m["name"], "stage": stage, "attack": a, **flat(v, mia)}
              for m in methods if m["attacks"] for a, stage, v in _stages(m)]
    if attack:
        tables.append(Table("Relearning attacks: what comes back", attack, (
            ("name", "method", "{}"), ("stage", "model", "{}"),
            ("em_forget", "EM forget leads", "{:.0%}"), ("rl_forget", "ROUGE-L forget leads", "{:.2f}"),
            ("dup_forget", "EM forget dup.", "{:.0%}"), ("rl_dup_forget", "ROUGE-L forget dup.", "{:.2f}"),
            ("exp_forget", "forget exposure", "{:.2f}"), ("ext_forget", "forget secrets extracted", "{:.0%}"),
            ("auc_forget", f"MIA AUC {mia} forget", "{}"),
            ("rl_relearned", "ROUGE-L relearned leads", "{:.2f}"),
            ("exp_retain", "retain exposure", "{:.2f}"), ("val", "held-out loss", "{:.3f}")),
            ("name", "attack")))
    by_count = []
    stages = [(FINE_TUNED, "", "", before)] + [(m["name"], a, stage, v) for m in methods
                                               for a, stage, v in _stages(m)]
    for name, a, stage, v in stages:
        for n in cfg.counts:
            f = [c for c in v["canaries"]["forget"] if c["count"] == n]
            r = [c for c in v["canaries"]["retain"] if c["count"] == n]
            by_count.append({"name": name, "stage": stage, "attack": a, "copies": n, "n_forget": len(f),
                             "exp_forget": _mean([c["exposure"] for c in f]),
                             "ext_forget": _mean([float(c["extracted"]) for c in f]),
                             "exp_retain": _mean([c["exposure"] for c in r])})
    tables.append(Table("Secrets by copy count", by_count, (
        ("name", "model", "{}"), ("stage", "stage", "{}"), ("copies", "copies", "{}"),
        ("n_forget", "forget secrets", "{}"), ("exp_forget", "forget exposure", "{:.2f}"),
        ("ext_forget", "forget extracted", "{:.0%}"), ("exp_retain", "retain exposure", "{:.2f}")),
        ("name", "attack", "copies")))
    records = [{"name": FINE_TUNED, "sampled": {"forget": before["sampled"]}}] if before.get("sampled") \
        else []
    for m in methods:
        for _, stage, v in _stages(m):
            if v.get("sampled"):
                records.append({"name": f"{m['name']} ({stage})", "sampled": {"forget": v["sampled"]}})
    b, c = cfg.base, cfg.canaries
    notes = [
        f"Fine-tune: {b.model.name} on {n_rows} rows of {b.data.corpus} with canaries ({c.per_count} per "
        f"copy count {cfg.counts}) and duplicated leads ({cfg.duplicates.per_count} per count) injected, "
        f"{cfg.passes} passes at lr {b.trainer.lr}.",
        f"Forget set (forget.json): {len(split.canaries)} canaries and {len(split.duplicates)} duplicated "
        f"leads (every copy), {len(split.relearn) + len(split.probe)} leads seen once: {n_forget} rows. "
        f"'forget' figures: the {len(split.probe)} probed forget leads (the other {len(split.relearn)}, "
        "'relearned', are the leads attack's data), every forget secret and duplicated lead; 'retain' the "
        f"other injected items and {len(split.retain)} retained leads.",
        "Methods: retrain = the fine-tune from the base model without the forget rows (the model unlearning "
        "should match); ga = gradient ascent; gdiff = ga + CE on retain rows; npo = negative preference "
        "optimisation against the fine-tune + CE on retain rows (memorization/mitigations/unlearning.py), "
        "at a constant lr: " + "; ".join(_settings_words(m) for m in methods if m["settings"]) + ".",
        (f"EM: the greedy answer (its first {b.eval.suffix} tokens) from each conversation's prompt; "
         "ROUGE-L: of that answer against the true one" if chat else
         f"EM: greedy {b.eval.suffix}-token suffix from the {b.eval.prefix}-token prefix; ROUGE-L: of that "
         "continuation against the true suffix") +
        ", the mean over documents (MUSE's VerbMem). Exposure in bits "
        "over the secret space; 'extracted' = the canary beats every never-inserted secret. MIA: the forget "
        "(or retain) leads vs the held-out leads" + (" (each answer scored given its prompt)" if chat else "")
        + "; PrivLeak = (AUC - retrain's AUC) / retrain's AUC (MUSE): "
        "0 is retrain's, > 0 the forget leads still stand out, < 0 they stand out by being unlearnt.",
    ]
    if attack:
        r = cfg.relearn
        said = []
        for a in r.attacks:
            done = [m["attacks"][a] for m in methods if a in m["attacks"]]
            steps = "/".join(map(str, sorted({d["steps"] for d in done} - {None})))
            words = CHAT_ATTACK_WORDS.get(a, ATTACK_WORDS[a]) if chat else ATTACK_WORDS[a]
            said.append(f"{a}: {done[0]['rows']} rows, " + words.format(
                prefix=b.eval.prefix, rate=r.edit_rate) + f" ({steps} steps)")
        notes.append(
            f"Relearning attacks (Hu et al. 2024): each model, retrain's included, trains {r.passes} passes "
            f"of plain loss at lr {r.lr or b.trainer.lr} in batches of {b.trainer.batch_size} rows (a pass "
            "drops its last partial batch, as every run here does) on the attack's rows, and is asked again. "
            + "; ".join(said) + ". What comes back beyond retrain's figure after the same attack (what the "
            "attack's own rows teach) was suppressed, not removed.")
    if baseline:
        notes.append(f"'{BASELINE_ROW}': the pretrained weights before fine-tuning "
                     "(OUT/baseline/evals.json).")
    beyond_rows, beyond_cols = beyond_table(records)
    if beyond_rows:
        tables.append(Table("Beyond greedy: the forget documents", beyond_rows, beyond_cols, BEYOND_INDEX))
        np_note = NP_NOTE.replace(" (after {passes} passes)", "")  # asked of models at several stages
        notes.append(np_note + " Forget documents: the probed leads and the "
                     f"forget duplicated leads. 'p_z >= {PZ_FLOOR:g}': the share whose suffix the scheme "
                     "emits at least once in a thousand draws.")
    paired, tests, paired_notes = _paired(methods, before, b.seed, list(cfg.mia_methods),
                                          cfg.bootstrap or 1000)
    tables += [Table(**paired, per_seed=True)] if paired else []
    notes += paired_notes
    plots = [_plot(methods, before, baseline, mia, out / "unlearning.png")]
    if chat:
        notes = [_conversations(n) for n in notes]
        tables = [replace(t, columns=tuple((k, _conversations(title), f) for k, title, f in t.columns))
                  for t in tables]
    return Outputs(title="Unlearning: forgetting chosen items after fine-tuning, and whether they stay gone",
                   kind=cfg.kind, runs=methods, tables=tables, notes=notes, plots=plots,
                   extra={"methods": methods, "fine_tuned": before, "baseline": baseline,
                          "paired_tests": tests,
                          "forget": {"canaries": split.canaries, "duplicates": split.duplicates,
                                     "rows": n_forget}})


def paired_questions(methods: list[str]) -> list[Question]:
    """What the paired tests ask: forget items first (verbatim, secrets, membership of the forget leads by
    every MIA method, as MUSE's PrivLeak compares it with retrain), then what must stay (retain leads and
    secrets, held-out NLL)."""
    def auc(m: str) -> Any:
        def get(answers: dict[str, Any]) -> Any:
            pos, neg = per_document(f"mia_forget_{m}")(answers), per_document(f"mia_nonmembers_{m}")(answers)
            return None if pos is None or neg is None else (pos, neg)
        return get

    def q(key: str, title: str, kind: str, fmt: str) -> Question:
        return Question(key, title, kind, per_document(key), fmt)

    return [q("em_forget", "EM forget leads", "binary", "{:+.0%}"),
            q("rl_forget", "ROUGE-L forget leads", "number", "{:+.3f}"),
            q("dup_forget", "EM forget dup.", "binary", "{:+.0%}"),
            q("exp_forget", "forget exposure", "number", "{:+.2f}"),
            *(Question(f"auc_forget_{m}", f"MIA AUC {m} forget", "auc", auc(m)) for m in methods),
            q("em_retain", "EM retain leads", "binary", "{:+.0%}"),
            q("rl_retain", "ROUGE-L retain leads", "number", "{:+.3f}"),
            q("exp_retain", "retain exposure", "number", "{:+.2f}"),
            q("nll", "held-out NLL", "number", "{:+.3f}")]


def by_id(v: dict[str, Any]) -> dict[str, dict[str, float]]:
    """One model's per-item answers keyed by item id: each lead's exact match (from the ids asked and the
    ids extracted) and ROUGE-L, each duplicated lead's exact match, each secret's exposure, each MIA score
    of the forget leads and the non-members, each non-member's NLL (only what the answers kept: those
    taken before per-item scores were stored have the exact matches and the exposures)."""
    out: dict[str, dict[str, float]] = {}
    per = v.get("per_document") or {}
    for g in ("forget", "retain"):
        lead = v["leads"][g]
        if "ids" in lead and "extracted" in lead:
            hit = set(lead["extracted"])
            out[f"em_{g}"] = {i: float(i in hit) for i in lead["ids"]}
        out[f"exp_{g}"] = {c["id"]: float(c["exposure"]) for c in v["canaries"][g]}
        if g in (per.get("rougeL") or {}):
            out[f"rl_{g}"] = per["rougeL"][g]
    out["dup_forget"] = {d["id"]: float(d["exact_match"]) for d in v["duplicates"]["forget"]}
    for m, scores in ((per.get("members") or {}).get("forget") or {}).items():
        out[f"mia_forget_{m}"] = scores
    for m, scores in (per.get("nonmembers") or {}).items():
        out[f"mia_nonmembers_{m}"] = scores
    if "nonmember_nll" in per:
        out["nll"] = per["nonmember_nll"]
    return out


def _paired(methods: list[dict[str, Any]], before: dict[str, Any], seed: int, mia: list[str],
            resamples: int = 1000) -> tuple[dict[str, Any] | None, dict[str, Any], list[str]]:
    """Each model against retrain at the same stage (the fine-tune and every method as left, then after each
    attack against retrain after that attack), item by item (memorization.paired)."""
    gold = next((m for m in methods if m["method"] == "retrain"), None)
    if gold is None:
        return None, {}, []
    ref = {a: (f"{gold['name']}" + (f" + {a} attack" if a else ""), v) for a, _, v in _stages(gold)}
    rows = [(FINE_TUNED, before, "")] + [(m["name"] + (f" + {a} attack" if a else ""), v, a)
                                        for m in methods if m is not gold
                                        for a, _, v in _stages(m) if a in ref]
    answers, aligned, pairs = {}, {}, []
    for name, v, a in rows:
        answers[name], aligned[name] = align(by_id(v), by_id(ref[a][1]))
        pairs.append((name, ref[a][0]))
    return paired_table(answers, pairs, paired_questions(mia), label="model", resamples=resamples, seed=seed,
                        aligned=aligned,
                        missing="rerun the methods: their answers are taken while unlearning")


def _plot(methods: list[dict[str, Any]], before: dict[str, Any], baseline: dict[str, Any] | None, mia: str,
          path: Path) -> Path:
    """Against passes over the forget rows: exposure (forget, retain), the leads' ROUGE-L (forget, retain),
    the duplicated leads' EM (forget, retain), forget MIA AUC, held-out loss; retrain as a flat line, each
    relearning attack's model one pass further (x leads, + prefixes, ^ near-copies)."""
    fig, axes = figure(5, width=4.0)
    end = max([len(m["passes"]) for m in methods if m["method"] != "retrain"], default=0)  # the last pass
    panels = [lambda v: flat(v, mia)["exp_forget"], lambda v: flat(v, mia)["rl_forget"],
              lambda v: flat(v, mia)["dup_forget"], lambda v: flat(v, mia)["auc_forget_value"],
              lambda v: v["val_loss"]]
    retain = [lambda v: flat(v, mia)["exp_retain"], lambda v: flat(v, mia)["rl_retain"],
              lambda v: flat(v, mia)["dup_retain"], None, None]
    for i, m in enumerate(methods):
        color = f"C{i % 10}"
        tags = [" (forget)" if keep is not None else "" for keep in retain]  # where retain is drawn too
        if m["method"] == "retrain":
            v = _final(m)
            for ax, get, tag in zip(axes, panels, tags):
                if get(v) is not None:
                    ax.axhline(get(v), color=color, linestyle="--", label=f"{m['name']}{tag}")
                for a, after in m["attacks"].items():
                    if get(after) is not None:
                        ax.plot([end + 1], [get(after)], color=color, marker=MARKERS[a], linestyle="")
            continue
        stages = [before] + [p for p in m["passes"]]
        xs = list(range(len(stages)))
        for ax, get, keep, tag in zip(axes, panels, retain, tags):
            ax.plot(xs, [get(v) for v in stages], marker="o", color=color, label=f"{m['name']}{tag}")
            if keep is not None:
                ax.plot(xs, [keep(v) for v in stages], marker=".", linestyle=":", color=color,
                        label=f"{m['name']} (retain)")
            for a, after in m["attacks"].items():
                if get(after) is not None:
                    ax.plot([xs[-1], xs[-1] + 1], [get(stages[-1]), get(after)], color=color,
                            linestyle="-.", marker=MARKERS[a])
    for a in dict.fromkeys(a for m in methods for a in m["attacks"]):  # what each mark is
        axes[0].plot([], [], color="gray", marker=MARKERS[a], linestyle="", label=f"after the {a} attack")
    if baseline:
        axes[0].axhline(_mean([c["exposure"] for c in baseline["canaries"]["forget"]]), color="gray",
                        linestyle=":", label=BASELINE_ROW)
    titles = ("canary exposure (bits)", "leads: ROUGE-L of the continuation", "duplicated leads: greedy EM",
              f"MIA AUC ({mia}), forget leads", "held-out loss")
    for ax, title in zip(axes, titles):
        ax.set(xlabel="passes over the forget rows (then: after each attack)", title=title)
        ax.legend(fontsize=6)
    return save(fig, path)
