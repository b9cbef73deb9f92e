"""unlearning: can a fine-tune be made to forget chosen items after the fact, and does it stay forgotten?

A pretrained model is fine-tuned (`passes` passes, OUT/runs/fine-tune) on half of a corpus into which
canaries and duplicated documents were injected at several copy counts (canary-exposure's injection,
OUT/manifest.json). A seeded `forget_fraction` of the injected items (per copy count) and of the leads
seen once is then to be forgotten (OUT/forget.json); the rest is to be retained. Each method:
  retrain   the gold standard: the fine-tune again from the base model without the forget rows
  ga        gradient ascent on the forget rows
  gdiff     gradient difference: ascent on the forget rows, descent on retain rows
  npo       negative preference optimisation against the fine-tune, plus descent on retain rows
(memorization/mitigations/unlearning.py), each unlearning method starting from the fine-tune's exported
model and asked after every pass over the forget rows: verbatim extraction of the forget and the retain
leads, the forget and retain secrets' exposure and extraction, the duplicated leads', (n, p) extraction
beyond greedy of the forget documents, membership inference of the forget leads (and of the retain ones)
against the held-out half, and held-out losses. Then the relearning attack (Hu et al. 2024, "Jogging the
memory of unlearned LLMs"): each model trains `relearn.passes` passes of plain loss on an attacker's
data and the forget items are asked about again. The attacks (`relearn.attacks`, each its own run):
  leads        half of the forget leads, whole: the other forget items (the probed leads, every forget
               secret and duplicated lead) are unrelated to what it trains on
  prefixes     the first `eval.prefix` tokens of every forget lead and forget duplicated lead (the prompts
               extraction asks with, which an attacker holds), never a token of their suffixes
  near-copies  near-copies of the same documents: each word substituted with probability
               `relearn.edit_rate` by a word of the corpus (related text, not the text)
Suppressed memorization comes back; a model that never learnt the items (retrain, the control: what the
attack's own data teaches) has nothing to bring back.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from axonn.config import apply_overrides, build, to_dict
from axonn.hooks import Callback
from axonn.trainer import Trainer
from data_pipelines import ChatExample, Document, DuplicateSpec, per_document, tokenize_documents
from data_pipelines.inject import near_copy, unit_pool
from data_pipelines.packing import Blocks
from evals import extract, extract_pairs, summarize
from evals.probabilistic import sampled_extraction, sampled_pairs
from memorization.config import RunConfig
from memorization.experiments.injection import (
    InjectionConfig,
    build_corpus,
    save_manifest,
    score_injected,
    split_pairs,
)
from memorization.experiments.mitigations import Sides, arm_config, beyond_summary, lead_ids, question_sides
from memorization.experiments.pretrained import require_pretrained_split
from memorization.experiments.questions import MiaSettings, PrivacyUtility, other_domain, reference_model
from memorization.experiments.reporting import Outputs
from memorization.experiments.runner import Experiment, digest, say
from memorization.experiments.spec import Arm
from memorization.experiments.unlearning_report import outputs
from memorization.mitigations.peft_lora import LoraSettings
from memorization.mitigations.unlearning import (
    METHODS,
    UnlearnObjective,
    UnlearnSettings,
    forget_first,
    reference_logp,
    select_rows,
)
from memorization.outputs import check_name
from memorization.train import pipeline
from memorization.train.prepare import PreparedData, prepare_conversations
from memorization.train.run_plan import run_schemes
from memorize_core import IGNORE_INDEX, fail

FINE_TUNE = "fine-tune"  # OUT/runs/fine-tune: the model every unlearning method starts from
RELEARNED = "-relearned"  # attack A on method M runs in OUT/runs/M-A-relearned (leads: M-relearned)
KINDS = ("retrain",) + METHODS
REFERENCE = "retrain"  # replicates' paired differences: each method against the gold standard
ATTACKS = ("leads", "prefixes", "near-copies")


@dataclass
class Method:
    """One way to forget: a name (its run folder), retrain or an unlearning objective, and key=value
    overrides of the `unlearn` settings for it (lr=1.0e-5, passes=2, beta=0.2; none for retrain)."""

    name: str = ""
    method: str = ""
    overrides: list[str] = field(default_factory=list)


def _default_attacks() -> list[str]:
    return list(ATTACKS)


@dataclass
class Relearn:
    """The relearning attacks after unlearning: plain loss on each attack's data (ATTACKS)."""

    passes: int = 2  # 0 = no attack
    lr: float = 0.0  # 0 = base.trainer.lr (the fine-tune's)
    attacks: list[str] = field(default_factory=_default_attacks)
    edit_rate: float = 0.2  # near-copies: the probability that a word is substituted

    def validate(self, prefix: str = "relearn") -> None:
        """Passes, lr and edit rate in range, known distinct attacks."""
        prefix = f"{prefix}." if prefix else ""
        if isinstance(self.passes, bool) or not isinstance(self.passes, int) or self.passes < 0:
            raise fail(f"{prefix}passes", self.passes, "must be >= 0 (0 = no relearning attack)")
        if not self.lr >= 0:
            raise fail(f"{prefix}lr", self.lr, "must be >= 0 (0 = base.trainer.lr)")
        bad = [a for a in self.attacks if a not in ATTACKS]
        if bad or len(set(self.attacks)) != len(self.attacks) or (self.passes and not self.attacks):
            raise fail(f"{prefix}attacks", self.attacks, f"use distinct names from {', '.join(ATTACKS)} "
                       "(relearn.passes=0: no attack)")
        if not 0 < self.edit_rate < 1:
            raise fail(f"{prefix}edit_rate", self.edit_rate, "must be in (0, 1), e.g. 0.2")

    def runs(self) -> list[str]:
        """The attacks that run (none at passes 0)."""
        return list(self.attacks) if self.passes else []


def attack_run(name: str, attack: str) -> str:
    """The run folder of `attack` on method `name` (the leads attack keeps the name it always had)."""
    return name + ("" if attack == "leads" else "-" + attack) + RELEARNED


def _default_methods() -> list[Method]:
    return [Method("retrain", "retrain"), Method("ga", "ga"), Method("gdiff", "gdiff"), Method("npo", "npo")]


@dataclass
class Config(InjectionConfig, MiaSettings):
    """The injected fine-tune, what to forget, the methods, and the relearning attack."""

    passes: int = 3  # the fine-tune's passes (retrain's too)
    forget_fraction: float = 0.5  # of the injected items per copy count, and of the leads seen once
    unlearn: UnlearnSettings = field(default_factory=UnlearnSettings)  # shared by the methods
    methods: list[Method] = field(default_factory=_default_methods)
    relearn: Relearn = field(default_factory=Relearn)
    baseline: bool = True  # ask the base model the same questions: the floor forgetting is read against

    def validate(self, prefix: str = "") -> None:
        """Injection and MIA checks, a pretrained base with a held-out split, valid methods and fractions."""
        super().validate(prefix)
        self.check()
        require_pretrained_split(self.base)
        if self.passes < 1:
            raise fail("passes", self.passes, "must be >= 1")
        if not 0 < self.forget_fraction < 1:
            raise fail("forget_fraction", self.forget_fraction, "must be in (0, 1): some items to "
                       "forget, some to retain")
        if self.base.data.packing != "per-document":
            raise fail("base.data.packing", self.base.data.packing, "forgetting a document needs it "
                       "in rows of its own: use per-document")
        if self.unlearn.method != UnlearnSettings.method:
            raise fail("unlearn.method", self.unlearn.method, "each entry of `methods` names its method; "
                       "set it there")
        self.unlearn.validate("unlearn")  # each method checks what it needs of it (settings())
        self.relearn.validate("relearn")
        if not self.methods:
            raise fail("methods", self.methods, "give at least one, e.g. [{name: npo, method: npo}]")
        names = [m.name for m in self.methods]
        for i, m in enumerate(self.methods):
            check_name(f"methods[{i}].name", m.name)
            if m.name == FINE_TUNE or m.name.endswith(RELEARNED):
                raise fail(f"methods[{i}].name", m.name, f"is the name of another run folder ({FINE_TUNE}, "
                           f"*{RELEARNED}); rename the method")
            if m.method not in KINDS:
                raise fail(f"methods[{i}].method", m.method, f"choose one of {', '.join(KINDS)}")
            if m.method == "retrain" and m.overrides:
                raise fail(f"methods[{i}].overrides", m.overrides, "retrain is the fine-tune "
                           "without the forget rows: it takes no unlearning settings")
            settings(self, m, f"methods[{i}].overrides")
        if len(set(names)) != len(names):
            raise fail("methods", names, "method names must be distinct")
        runs: dict[str, str] = {}  # attack folders (every one ends in -relearned: no method's name)
        for i, m in enumerate(self.methods):
            for attack in self.relearn.runs():
                run = attack_run(m.name, attack)
                if run in runs:
                    raise fail(f"methods[{i}].name", m.name, f"its attack run {run} is another run's "
                               f"({runs[run]}); rename the method")
                runs[run] = f"the {attack} attack on {m.name}"


def settings(cfg: Config, m: Method, where: str = "overrides") -> UnlearnSettings:
    """Method `m`'s unlearning settings: the shared `unlearn` block with its overrides, checked."""
    try:
        s = build(UnlearnSettings, apply_overrides({**to_dict(cfg.unlearn), "method": m.method
                                                    if m.method in METHODS else "npo"}, list(m.overrides)))
        s.check_method("")
    except ValueError as e:  # ConfigError (an unknown key, a bad value): say which method it came from
        raise fail(where, list(m.overrides), str(e).rstrip(".")) from None
    return s


@dataclass
class ForgetSplit:
    """What is forgotten: injected items (all their copies) and leads seen once; half of the forget leads
    are the relearning attack's data, the other half are asked about (the `probe` leads)."""

    canaries: list[str]  # manifest ids
    duplicates: list[str]
    relearn: list[int]  # indices into the members (the leads seen once)
    probe: list[int]
    retain: list[int]
    rows: list[int]  # training rows to forget

    def record(self, manifest: Any, member_ids: list[str]) -> dict[str, Any]:
        """forget.json: the ids of everything forgotten and retained."""
        items = {it.id: it for it in manifest.items}
        kept = [i for i in items if items[i].kind in ("canary", "duplicate")
                and i not in self.canaries and i not in self.duplicates]
        return {"forget": {"canaries": self.canaries, "duplicates": self.duplicates,
                           "leads_relearned": [member_ids[i] for i in self.relearn],
                           "leads_probed": [member_ids[i] for i in self.probe]},
                "retain": {"items": kept, "leads": [member_ids[i] for i in self.retain]},
                "rows": len(self.rows)}


def forget_split(cfg: Config, data: PreparedData, manifest: Any) -> tuple[ForgetSplit, list[str]]:
    """The seeded forget set (forget_fraction of each copy count's canaries and duplicated leads, and of
    the leads seen once) and the member leads' ids, in the order of members_and_nonmembers."""
    rng = random.Random(cfg.base.seed * 7_919 + 1)
    frac = cfg.forget_fraction

    def pick(ids: list[str]) -> list[str]:
        ids = sorted(ids)
        rng.shuffle(ids)
        return sorted(ids[:max(1, round(frac * len(ids)))]) if ids else []

    canaries, dups = [], []
    for n in cfg.counts:
        canaries += pick([it.id for it in manifest.of_kind("canary") if it.count == n])
        dups += pick([it.id for it in manifest.of_kind("duplicate") if it.count == n])
    member_ids = lead_ids(data, manifest)
    order = list(range(len(member_ids)))
    rng.shuffle(order)
    n_forget = round(frac * len(order))
    if n_forget < 4 or len(order) - n_forget < 2:
        raise fail("forget_fraction", frac, f"forgets {n_forget} of {len(order)} leads seen once: it "
                   "needs >= 4 (half relearned, half probed) and >= 2 retained; use more documents "
                   "(base.data.limit)")
    forget = order[:n_forget]
    relearn, probe = sorted(forget[:n_forget // 2]), sorted(forget[n_forget // 2:])
    gone = {cid for it in manifest.items if it.id in set(canaries) | set(dups) for cid in it.copy_ids}
    gone |= {member_ids[i] for i in forget}
    split = ForgetSplit(canaries, dups, relearn, probe, sorted(order[n_forget:]), rows_of(data, gone))
    return split, member_ids


def rows_of(data: PreparedData, doc_ids: set[str]) -> list[int]:
    """The training rows of the documents `doc_ids` (per-document rows: a row's first token names it)."""
    return [r for r, d in enumerate(data.train.doc_ids[:, 0].tolist()) if data.train_doc_ids[d] in doc_ids]


def subset(data: PreparedData, rows: list[int]) -> PreparedData:
    """`data` trained on the rows `rows` only (retrain's corpus, the relearning attack's)."""
    docs = data.train.doc_ids[:, 0].tolist()
    pairs = {} if not data.is_chat else {"prompts": [data.prompts[docs[r]] for r in rows],
                                         "responses": [data.responses[docs[r]] for r in rows]}
    return replace(data, train=select_rows(data.train, rows),
                   train_docs=[data.train_docs[docs[r]] for r in rows],
                   train_doc_ids=[data.train_doc_ids[docs[r]] for r in rows], audit=None, **pairs)


def unlearn_config(cfg: Config, m: Method, s: UnlearnSettings, model_dir: str | Path | None,
                   steps: int = 0) -> RunConfig:
    """Method m's run: the fine-tune's exported model (`model_dir`; None: the base model, the same shape,
    for the checks made before it exists) trained `steps` steps (0: `passes` epochs, the dry run's
    stand-in) of s's objective at a constant learning rate; the questions are asked by the experiment."""
    b = cfg.base
    model = _from(b, model_dir)
    return replace(
        b, name=m.name, model=model, data=replace(b.data, min_tokens=1),
        goldfish=replace(b.goldfish, enabled=False),
        trainer=replace(b.trainer, epochs=s.passes, max_steps=steps, lr=s.lr, warmup_steps=0,
                        min_lr_ratio=1.0,
                        batch_size=s.rows_per_step(), grad_accum=1, micro_batch=0,
                        dp=replace(b.trainer.dp, enabled=False)),
        eval=replace(b.eval, extraction=False, audit=False, mia=False))


def _from(b: RunConfig, model_dir: str | Path | None) -> Any:
    """The base model settings pointed at `model_dir` (an earlier sub-run's export; None: the base model),
    full weights: no LoRA, no random init."""
    return replace(b.model, lora=LoraSettings(), random_init=False,
                   **({"name": str(model_dir), "overrides": {}} if model_dir is not None else {}))


def relearn_config(cfg: Config, name: str, model_dir: str | Path | None, attack: str = "leads") -> RunConfig:
    """`attack` on method `name`: its model trained `relearn.passes` passes of plain loss."""
    b, r = cfg.base, cfg.relearn
    model = _from(b, model_dir)
    return replace(b, name=attack_run(name, attack), model=model, data=replace(b.data, min_tokens=1),
                   goldfish=replace(b.goldfish, enabled=False),
                   trainer=replace(b.trainer, epochs=r.passes, max_steps=0, lr=r.lr or b.trainer.lr,
                                   dp=replace(b.trainer.dp, enabled=False)),
                   eval=replace(b.eval, extraction=False, audit=False, mia=False))


def forget_documents(split: ForgetSplit, manifest: Any, member_ids: list[str]) -> list[str]:
    """The ids of the documents the related-text attacks are made of: every forget lead, and one copy of
    each forget duplicated lead (its copies are exact)."""
    first = {it.id: it.copy_ids[0] for it in manifest.items}
    return [member_ids[i] for i in sorted(split.relearn + split.probe)] + [first[d] for d in split.duplicates]


def prefix_rows(data: PreparedData, doc_ids: list[str], prefix: int) -> PreparedData:
    """The rows of `doc_ids` cut to their first `prefix` tokens (the rest padding, never a label): what an
    attacker who holds extraction's prompts trains on."""
    rows = rows_of(data, set(doc_ids))
    part = subset(data, rows)
    t = part.train
    cut = torch.arange(t.input_ids.shape[1]) >= prefix
    pad = int(data.tokenizer.eos_token_id)  # per-document rows pad with EOS (prepare)
    train = Blocks(t.input_ids.masked_fill(cut, pad), t.doc_ids.masked_fill(cut, -1),
                   t.labels.masked_fill(cut, IGNORE_INDEX), num_docs=t.num_docs, eos_id=t.eos_id,
                   positions=None if t.positions is None else t.positions.masked_fill(cut, -1))
    return replace(part, train=train, train_docs=[d[:prefix] for d in part.train_docs])


def prompt_rows(data: PreparedData, doc_ids: list[str], block_len: int) -> PreparedData:
    """Chat data's prefixes attack: the prompts of the conversations `doc_ids` (everything before the
    answer, as extraction asks), trained on as plain text (every token supervised), never an answer token."""
    row = {i: j for j, i in enumerate(data.train_doc_ids)}
    prompts = [data.prompts[row[i]] for i in doc_ids]
    rows = per_document(prompts, block_len, int(data.tokenizer.eos_token_id))
    return replace(data, train=rows, train_docs=prompts, train_doc_ids=[f"{i}~prompt" for i in doc_ids],
                   prompts=None, responses=None, audit=None, secrets=None)


def _answer(ex: ChatExample) -> str:
    return next(m["content"] for m in reversed(ex.messages) if m["role"] == "assistant")


def near_copy_chats(cfg: Config, data: PreparedData, injected: list[ChatExample], doc_ids: list[str],
                    corpus_ids: set[str]) -> PreparedData:
    """Chat data's near-copies attack: the conversations `doc_ids` with their answer's words substituted
    (relearn.edit_rate, drawn from the answers of `corpus_ids`), prompts unchanged, rendered and supervised
    as the fine-tune's rows are."""
    spec = DuplicateSpec(counts=[1], edit_rate=cfg.relearn.edit_rate, edit_unit="word",
                         edit_kinds=["substitute"])
    pool = unit_pool([Document(ex.id, _answer(ex), ex.source) for ex in injected if ex.id in corpus_ids],
                     spec, data.tokenizer)
    by_id = {ex.id: ex for ex in injected}
    copies = []
    for i in doc_ids:
        ex = by_id[i]
        last = max(j for j, m in enumerate(ex.messages) if m["role"] == "assistant")
        text = near_copy(ex.messages[last]["content"], spec, pool, (cfg.base.seed, i, "relearn"))[0]
        messages = [dict(m, content=text) if j == last else m for j, m in enumerate(ex.messages)]
        copies.append(ChatExample(f"{i}~near", messages, ex.source))
    b = cfg.base
    plain = replace(b, eval=replace(b.eval, audit=False, secrets=0))
    return replace(prepare_conversations(plain, copies, None, data.tokenizer), held_out=data.held_out)


def near_copy_rows(cfg: Config, data: PreparedData, injected: list[Document], doc_ids: list[str],
                   corpus_ids: set[str]) -> PreparedData:
    """Near-copies of the documents `doc_ids` (seeded word substitutions at relearn.edit_rate, drawn from
    the words of the documents `corpus_ids`: never a canary's), one row each as the corpus' rows are made."""
    spec = DuplicateSpec(counts=[1], edit_rate=cfg.relearn.edit_rate, edit_unit="word",
                         edit_kinds=["substitute"])
    pool = unit_pool([d for d in injected if d.id in corpus_ids], spec, data.tokenizer)
    text = {d.id: d.text for d in injected}
    copies = [near_copy(text[i], spec, pool, (cfg.base.seed, i, "relearn"))[0] for i in doc_ids]
    tokens = tokenize_documents(copies, data.tokenizer, max_tokens=cfg.base.data.block_len)  # drops none
    rows = per_document(list(tokens), cfg.base.data.block_len, int(data.tokenizer.eos_token_id))
    return replace(data, train=rows, train_docs=list(tokens), train_doc_ids=[f"{i}~near" for i in doc_ids],
                   audit=None)


def attack_data(cfg: Config, data: PreparedData, injected: list[Document], manifest: Any,
                split: ForgetSplit, member_ids: list[str]) -> dict[str, tuple[PreparedData, Any]]:
    """Per attack that runs, (its training data, what keys it): the leads attack by its rows' indices (as
    it always was), the others by their tokens and labels."""
    out: dict[str, tuple[PreparedData, Any]] = {}
    docs = forget_documents(split, manifest, member_ids)
    # the pool of substitutes: the leads and the duplicated leads' copies (no canary, no audit canary)
    corpus = set(member_ids) | {cid for it in manifest.of_kind("duplicate") for cid in it.copy_ids}
    for attack in cfg.relearn.runs():
        if attack == "leads":
            rows = rows_of(data, {member_ids[i] for i in split.relearn})
            out[attack] = (subset(data, rows), rows)
            continue
        if data.is_chat:  # the prompts as text, or near-copies of the answers
            part = (prompt_rows(data, docs, cfg.base.data.block_len) if attack == "prefixes"
                    else near_copy_chats(cfg, data, injected, docs, corpus))
        else:
            part = (prefix_rows(data, docs, cfg.base.eval.prefix) if attack == "prefixes"
                    else near_copy_rows(cfg, data, injected, docs, corpus))
        out[attack] = (part, {"attack": attack, "ids": part.train.input_ids.tolist(),
                              "labels": part.train.labels.tolist()})
    return out


def _fine_tune_config(cfg: Config, name: str = FINE_TUNE) -> RunConfig:
    return arm_config(cfg, Arm(name, "none"))


def run_configs(cfg: Config) -> list[RunConfig]:
    """Every sub-run in training order: the fine-tune, then per method its run and its relearning attack
    (unlearning and the attack with the base model's name: theirs exist once the run before has run)."""
    out = [_fine_tune_config(cfg)]
    for m in cfg.methods:
        out.append(_fine_tune_config(cfg, m.name) if m.method == "retrain"
                   else unlearn_config(cfg, m, settings(cfg, m), None))
        out += [relearn_config(cfg, m.name, None, attack) for attack in cfg.relearn.runs()]
    return out


class Questions:
    """What every model is asked, split into forget and retain (and the relearned leads), on every rank."""

    def __init__(self, cfg: Config, data: PreparedData, manifest: Any, dup_tokens: dict[str, Any],
                 sides: Sides, member_ids: list[str], split: ForgetSplit, reference: Any):
        """`sides`: question_sides' members (the leads seen once, or on chat data the conversations, with
        their prompts and answers) and non-members."""
        self.cfg, self.data, self.manifest, self.split = cfg, data, manifest, split
        self.dup_tokens = dup_tokens
        tok, b = data.tokenizer, cfg.base
        members, nonmembers = sides.members, sides.nonmembers
        groups = {"forget": split.probe, "retain": split.retain, "relearned": split.relearn}
        self.leads = {g: [members[i] for i in idx] for g, idx in groups.items()}
        self.lead_ids = {g: [member_ids[i] for i in idx] for g, idx in groups.items()}
        # chat data: each group's (prompts, answers), and where its conversations' answers start
        prompts, answers = sides.pairs or ([], [])
        self.pairs = None if sides.pairs is None else {
            g: ([prompts[i] for i in idx], [answers[i] for i in idx]) for g, idx in groups.items()}
        starts = {g: None if sides.starts is None else ([sides.starts[0][i] for i in idx], sides.starts[1])
                  for g, idx in groups.items()}
        other = other_domain(cfg, tok, b.data.block_len)
        self.mia = {"forget": PrivacyUtility(cfg, tok, self.leads["forget"], nonmembers, other, reference,
                                             seed=b.seed, starts=starts["forget"]),
                    "retain": PrivacyUtility(cfg, tok, self.leads["retain"], nonmembers, [], reference,
                                             seed=b.seed, starts=starts["retain"])}
        self.schemes = run_schemes(b)
        dups = [dup_tokens[i] for i in split.duplicates]
        if self.pairs is None:
            self.forget_docs = self.leads["forget"] + dups
        else:  # (prompts, answers) of the probed forget conversations and the forget duplicated ones
            forget_prompts, forget_answers = self.pairs["forget"]
            dup_prompts, dup_answers = split_pairs(dups)
            self.forget_docs = (forget_prompts + dup_prompts, forget_answers + dup_answers)
        self.key = {"mia": cfg.mia_methods, "k": cfg.mia_k, "bootstrap": cfg.bootstrap,
                    "schemes": b.eval.sampling, "np": [b.eval.np_ns, b.eval.np_p],
                    "candidates": cfg.canaries.candidates,
                    "other": [cfg.other_held_out, cfg.other_held_out_limit],
                    "downstream": [cfg.downstream, cfg.downstream_limit, cfg.downstream_fewshot],
                    "asked": digest([self.leads, nonmembers, other, split.canaries, split.duplicates]),
                    "per_document": 1}  # what paired tests read: a run asked without it is asked again
        if self.pairs is not None:  # chat data's questions: prompt -> answer, membership on the answers
            self.key["chat"] = digest([self.pairs, starts])
        self.nonmember_ids = [f"nonmember-{i}" for i in range(len(nonmembers))]  # fixed by `asked`

    def __call__(self, model: Any, downstream: bool = False) -> dict[str, Any]:
        """Every answer of `model`, each metric for the forget and the retain items."""
        e, tok = self.cfg.base.eval, self.data.tokenizer
        leads, rouge = {}, {}
        for g, docs in self.leads.items():
            got = (extract_pairs(model, *self.pairs[g], tokenizer=tok, batch_size=e.batch_size,
                                 doc_ids=self.lead_ids[g]) if self.pairs is not None else
                   extract(model, docs, prefix_len=e.prefix, suffix_len=e.suffix, tokenizer=tok,
                           batch_size=e.batch_size, decode=e.decode, doc_ids=self.lead_ids[g]))
            scores = summarize(got)
            leads[g] = {**{k: scores[k] for k in ("docs", "exact_match_rate", "rougeL")},
                        "ids": sorted(str(r.doc) for r in got),  # which leads were asked, which came back
                        "extracted": sorted(str(r.doc) for r in got if r.exact_match)}
            rouge[g] = {str(r.doc): float(r.rougeL) for r in got}
        inj = score_injected(model, self.cfg, tok, self.manifest, self.dup_tokens)
        forget = set(self.split.canaries) | set(self.split.duplicates)
        canaries = {g: [{k: c[k] for k in ("id", "count", "exposure", "extracted")} for c in inj["canaries"]
                        if (c["id"] in forget) == (g == "forget")] for g in ("forget", "retain")}
        dups = {g: [{k: d[k] for k in ("id", "count", "exact_match", "rougeL")} for d in inj["duplicates"]
                    if (d["id"] in forget) == (g == "forget")] for g in ("forget", "retain")}
        sampled = None
        if self.schemes and self.pairs is not None:  # chat data: each forget answer from its prompt
            sampled = beyond_summary(sampled_pairs(model, *self.forget_docs, schemes=self.schemes, ns=e.np_ns,
                                                   p=e.np_p, batch_size=e.batch_size))
        elif self.schemes:
            sampled = beyond_summary(sampled_extraction(
                model, self.forget_docs, prefix_len=e.prefix, suffix_len=e.suffix, schemes=self.schemes,
                offsets=[0], ns=e.np_ns, p=e.np_p, batch_size=e.batch_size))
        privacy = {g: q(model, downstream=downstream and g == "forget", per_document=True)
                   for g, q in self.mia.items()}
        return {"leads": leads, "canaries": canaries, "duplicates": dups, "max_exposure": inj["max_exposure"],
                "sampled": sampled, "mia": {g: p["mia"] for g, p in privacy.items()},
                "val_loss": privacy["forget"]["val_loss"],
                "other_val_loss": privacy["forget"]["other_val_loss"],
                "downstream": privacy["forget"].get("downstream"),
                "per_document": self.per_document(privacy, rouge)}

    def per_document(self, privacy: dict[str, Any], rouge: dict[str, dict[str, float]]) -> dict[str, Any]:
        """Each item's own answer keyed by its id, what the report's paired tests pair two models by: the
        leads' ROUGE-L, each MIA method's score of the forget and retain leads and of the non-members
        (the same for both groups), each non-member's mean token NLL."""
        def keyed(ids: list[str], values: list[float]) -> dict[str, float]:
            return dict(zip(ids, values, strict=True))

        scores = {g: p["per_document"] for g, p in privacy.items()}
        return {"rougeL": rouge,
                "members": {g: {m: keyed(self.lead_ids[g], v) for m, v in scores[g]["members"].items()}
                            for g in scores},
                "nonmembers": {m: keyed(self.nonmember_ids, v)
                               for m, v in scores["forget"]["nonmembers"].items()},
                "nonmember_nll": keyed(self.nonmember_ids, scores["forget"]["nonmember_nll"])}

    def baseline(self, exp: Experiment, reference: Any) -> dict[str, Any]:
        """The base model's answers, cached in OUT/baseline under the model, the inputs and `key`."""
        b = self.cfg.base
        injected = [[it.id, it.text, it.count, it.secret] for it in self.manifest.items]
        return exp.baseline({"model": b.model.name, "overrides": b.model.overrides, "seed": b.seed,
                             "eval": self.key, "prefix": b.eval.prefix, "suffix": b.eval.suffix,
                             "injected": digest(injected)},
                            lambda r=reference: r, lambda model, _d: self(model))


class EveryPass(Callback):
    """Trainer callback: ask after every `per_pass` steps (a pass over the forget rows)."""

    def __init__(self, ask: Questions, per_pass: int, last: int):
        self.ask, self.per_pass, self.last, self.records = ask, per_pass, last, []

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        """After a whole pass: the answers of the model as it is now (a collective on a grid)."""
        step = trainer.state.step
        if step % self.per_pass:
            return
        model = trainer.model
        model.eval()
        values = self.ask(model, downstream=step == self.last)  # the tasks after the last pass only
        model.train()
        self.records.append({"pass": step // self.per_pass, "step": step, **values})
        trainer.log({"unlearn_pass": step // self.per_pass,
                     "forget_exposure": _mean([c["exposure"] for c in values["canaries"]["forget"]])})


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run(cfg: Config, exp: Experiment) -> Outputs | None:
    """Fine-tune on the injected corpus, make each method forget the forget set, attack, ask throughout."""
    data, manifest, dup_tokens, injected = build_corpus(cfg, exp)
    b = cfg.base
    sides = question_sides(cfg, data, manifest)  # chat data: conversations, asked prompt -> answer
    split, member_ids = forget_split(cfg, data, manifest)
    forget_set = set(split.rows)
    retained = subset(data, [r for r in range(len(data.train)) if r not in forget_set])
    attacks = attack_data(cfg, data, injected, manifest, split, member_ids)
    unlearn_rows, n_forget = forget_first(data.train, split.rows)
    unlearn_data = replace(data, train=unlearn_rows, audit=None)
    plans = {m.name: settings(cfg, m) for m in cfg.methods if m.method != "retrain"}
    steps = {name: s.passes * s.steps_per_pass(n_forget) for name, s in plans.items()}
    configs, datasets = [_fine_tune_config(cfg)], [data]
    for m in cfg.methods:
        configs.append(_fine_tune_config(cfg, m.name) if m.method == "retrain"
                       else unlearn_config(cfg, m, plans[m.name], None, steps[m.name]))
        datasets.append(retained if m.method == "retrain" else unlearn_data)
        for attack, (part, _) in attacks.items():
            configs.append(relearn_config(cfg, m.name, None, attack))
            datasets.append(part)
    exp.check(configs, datasets)
    save_manifest(manifest, exp)
    if exp.is_main:
        (exp.out / "forget.json").write_text(json.dumps(split.record(manifest, member_ids), indent=1))
    reference = reference_model(b, exp.grid_spec)
    ask = Questions(cfg, data, manifest, dup_tokens, sides, member_ids, split, reference)
    baseline = None
    if cfg.baseline:
        say("base model: its evaluation before fine-tuning")
        baseline = ask.baseline(exp, reference)
    del reference
    key = cfg.injection_key()

    def evaluate(model: Any, run_dir: Path) -> dict[str, Any]:
        return ask(model, downstream=True)  # a finished model: the downstream tasks too, when named

    tuned = exp.run(_fine_tune_config(cfg), data, extra_key=key, evaluate=evaluate, eval_key=ask.key,
                    per_run_wandb=cfg.per_run_wandb)
    before = answers(tuned)
    methods = []
    for m in cfg.methods:
        if m.method == "retrain":
            summary = exp.run(_fine_tune_config(cfg, m.name), retained, evaluate=evaluate, eval_key=ask.key,
                              extra_key={**key, "forget": digest(split.rows)},
                              per_run_wandb=cfg.per_run_wandb)
            passes = [{"pass": None, "step": summary.get("steps"), **answers(summary)}]
            s = None
        else:
            s = plans[m.name]
            summary = _unlearn(cfg, exp, m, s, steps[m.name], unlearn_data, n_forget, ask, tuned)
            passes = summary.get("after_pass", [])
            # per-item answers are paired at the last pass only (the model as left): not kept for the others
            passes = [{k: v for k, v in p.items() if k != "per_document"} for p in passes[:-1]] + passes[-1:]
        attacked = {}
        for attack, (part, rows) in attacks.items():  # each from the method's model, as it was left
            rc = relearn_config(cfg, m.name, exp.run_dir(m.name) / "model", attack)
            after = exp.run(rc, part, evaluate=evaluate, eval_key=ask.key, per_run_wandb=cfg.per_run_wandb,
                            extra_key={"from": digest(_identity(summary)), "rows": digest(rows)},
                            key_config=relearn_config(cfg, m.name, None, attack))
            attacked[attack] = {"steps": after.get("steps"), "rows": len(part.train), **answers(after)}
        if exp.is_main:
            methods.append({"name": m.name, "method": m.method, "overrides": list(m.overrides),
                            "settings": None if s is None else to_dict(s), "steps": summary.get("steps"),
                            "passes": passes, "attacks": attacked, "reused": summary.get("reused", False)})
    if not exp.is_main:
        return None
    return outputs(cfg, methods, before, baseline, split, n_forget, len(data.train), exp.out)


ANSWERS = ("leads", "canaries", "duplicates", "max_exposure", "sampled", "mia", "val_loss", "other_val_loss",
           "downstream", "per_document")  # what Questions returns


def answers(summary: dict[str, Any]) -> dict[str, Any]:
    """The questions' answers in a sub-run's summary (Experiment.run merges them into it)."""
    return {k: summary.get(k) for k in ANSWERS}


def _identity(summary: dict[str, Any]) -> dict[str, Any]:
    """What a finished training run is, for the key of a run that continues it: its summary without the
    answers, its own or those taken after each pass (they change with the questions, the training does
    not), or the flag saying it was reused."""
    return {k: v for k, v in summary.items() if k not in ("reused", "after_pass") and k not in ANSWERS}


def _unlearn(cfg: Config, exp: Experiment, m: Method, s: UnlearnSettings, steps: int, data: PreparedData,
             n_forget: int, ask: Questions, tuned: dict[str, Any]) -> dict[str, Any]:
    """Method m's run from the fine-tune's exported model, asked after every pass over the forget rows."""
    rc = unlearn_config(cfg, m, s, exp.run_dir(FINE_TUNE) / "model", steps)

    def train(rc: RunConfig, run_dir: Path) -> dict[str, Any]:
        hook = UnlearnObjective(s, data.train, n_forget, seed=cfg.base.seed)
        probe = EveryPass(ask, hook.per_pass, steps)
        with pipeline.start_run(rc, run_dir, data, overwrite=True, grid_spec=exp.grid_spec,
                                progress=rc.trainer.progress, callbacks=[probe], gradient_hook=hook) as run:
            if s.method == "npo":  # the reference: the fine-tune, as this run starts from it
                t = run.trainer
                hook.set_reference(reference_logp(t.model, data.train, n_forget, grid=t.grid))
            pipeline.train(run)
            return pipeline.finish(run, extra={"after_pass": probe.records})

    # keyed by the fine-tune it starts from (its summary), the forget rows, the settings and the questions;
    # by the base model's name, not the folder it reads the fine-tune from
    key = {"fine_tune": digest(_identity(tuned)), "forget": digest(data.train.input_ids[:n_forget].tolist()),
           "settings": s.identity(), "questions": ask.key}
    return exp.run(rc, data, train=train, extra_key=key, per_run_wandb=cfg.per_run_wandb,
                   key_config=unlearn_config(cfg, m, s, None, steps))


__all__ = ["ATTACKS", "Config", "Method", "Relearn", "attack_data", "forget_split", "run"]
