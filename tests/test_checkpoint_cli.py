"""`memorize train --checkpoint-every/--resume auto` and `memorize export` end to end (serial)."""
from __future__ import annotations

import json
import shutil

import torch
from helpers import TINY
from safetensors.torch import load_file

from memorization.cli import main


def _losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_auto_and_export_match_the_uninterrupted_run(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY.replace("max_steps: 2", "max_steps: 4") + "goldfish: {enabled: true, k: 3, h: 2}\n")
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["train", str(cfg), "--out", str(a), "--checkpoint-every", "2"]) == 0
    assert sorted(p.name for p in (a / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    shutil.copytree(a, b)  # b: as if killed after step 3, before the step-4 save
    shutil.rmtree(b / "checkpoints" / "step-00000004")
    shutil.rmtree(b / "model")
    lines = (b / "metrics.jsonl").read_text().splitlines()
    (b / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    assert main(["train", str(cfg), "--out", str(b), "--resume", "auto"]) == 0
    assert _losses(b) == _losses(a) and len(_losses(a)) == 4
    # the resumed run's report draws every step (from metrics.jsonl), not only those since its resume
    assert (b / "report.png").read_bytes() == (a / "report.png").read_bytes()
    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    capsys.readouterr()
    assert main(["export", str(a / "checkpoints" / "step-00000004"), str(tmp_path / "x")]) == 0
    wx = load_file(tmp_path / "x" / "model.safetensors")
    assert sorted(wx) == sorted(wa) and all(torch.equal(wa[k], wx[k]) for k in wa)
    assert (tmp_path / "x" / "tokenizer.json").is_file()
