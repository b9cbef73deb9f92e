"""What every experiment shares: its output folder, its data, and sub-runs that are reused when done.

Layout of an experiment folder OUT:
    OUT/runs/<run>/     one training run (run.json, metrics.jsonl, extraction.jsonl, model/) plus
                        inputs.json (what the run was trained from) and evals.json (extra metrics)
    OUT/baseline/       evals.json of the model every run starts from, untrained (Experiment.baseline)
    OUT/report.json OUT/report.md OUT/*.png    written by the experiment at the end

A sub-run is reused when its run.json exists and its inputs.json matches the requested run (fields
the run cannot depend on aside: comparable_key), so running an experiment again resumes it; a changed
setting retrains only the runs it touches.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import AutoModelForCausalLM

import axonn
from axonn.config import to_dict
from axonn.grid import parse_grid
from data_pipelines import load_corpus, split_documents, tokenize_documents
from memorization.config import RunConfig
from memorization.models import load_sharded
from memorization.outputs import check_writable, remove_entries
from memorization.train.parallel import is_main_process
from memorization.train.pipeline import run_training
from memorization.train.prepare import PreparedData, prepare_documents
from memorization.train.run_plan import check_runs

REPORT_FILES = ("report.json", "report.md")
BASELINE = "baseline"  # OUT/baseline/evals.json: the starting model's evaluation (Experiment.baseline)


def say(msg: str) -> None:
    """One progress line on stdout from the main rank (flushed, so it interleaves with tqdm)."""
    if is_main_process():
        print(f"[experiment] {msg}", flush=True)


def run_key(cfg: RunConfig) -> dict[str, Any]:
    """The parts of a RunConfig that change what a run computes (not W&B, not progress bars)."""
    d = to_dict(cfg)
    d.pop("wandb", None)
    d.pop("name", None)
    d["trainer"].pop("progress", None)
    d["eval"].pop("batch_size", None)
    # which greedy decoder runs (static or KV cache) changes speed, not tokens: the static decode
    # checks every row by a teacher-forced forward (evals/static_decode.py)
    d["eval"].pop("decode", None)
    if not cfg.goldfish.enabled:
        d["goldfish"] = {"enabled": False}  # goldfish settings do not touch a standard-loss run
    # switches that are off do not change what a run computes (and keep keys from older runs valid)
    if not cfg.model.lora.enabled:
        d["model"].pop("lora", None)
    if not cfg.trainer.dp.enabled:
        d["trainer"].pop("dp", None)
    if not cfg.eval.secrets:
        d["eval"].pop("secrets", None)
    if cfg.data.dedup.enabled:
        d["data"]["dedup"] = cfg.data.dedup.key()
    else:
        d["data"].pop("dedup", None)
    # near-verbatim settings only where the run bounds near-copies itself (an experiment that does keys
    # them in its eval_key), as EvalConfig.near_key keys them
    for name in ("near_verbatim", "nv_beams", "nv_distance"):
        d["eval"].pop(name, None)
    if cfg.eval.extraction:
        d["eval"].update(cfg.eval.near_key())
    return d


# eval fields that change nothing while the switch that reads them is off: extraction's beyond-greedy
# settings without eval.extraction, the canaries' count without eval.audit
_INERT = {"extraction": ("sampling", "offsets", "np_ns", "np_p"), "audit": ("audit", "audit_canaries")}


def comparable_key(key: dict[str, Any]) -> dict[str, Any]:
    """A stored or requested sub-run key without the fields it cannot depend on (_INERT), so a run
    trained before such a field existed (its key lacks it) stays reusable, as does one whose key has it."""
    out = json.loads(json.dumps(key))
    ev = (out.get("run") or {}).get("eval")
    if isinstance(ev, dict):
        for switch, names in _INERT.items():
            if not ev.get(switch, False):
                for name in names:
                    ev.pop(name, None)
    return out


@dataclass
class Experiment:
    """One experiment invocation: its output folder, grid, overwrite flag and clock."""

    out: Path
    # the --grid text ("X,Y,Z,D" or "auto"), or None for each sub-run's config grid; every sub-run
    # resolves it into the grid that fits its own model (memorization.train.parallel.resolve_grid)
    grid_spec: str | None = None
    overwrite: bool = False
    prepared: bool = False  # OUT made (and cleared with overwrite): prepare_out
    started: float = field(default_factory=time.perf_counter)

    @property
    def is_main(self) -> bool:
        """True on the rank that writes files (rank 0 of a torchrun launch, or a plain process)."""
        return is_main_process()

    def open(self) -> Experiment:
        """Check OUT can be written (not a file, permission, read-only, space); write nothing yet: OUT
        is made (cleared with overwrite) once every sub-run passed its checks (`prepare_out`)."""
        check_writable("--out", self.out)
        return self

    def prepare_out(self) -> None:
        """Create OUT/runs (with overwrite, first removing what the experiment writes: runs/, its
        reports and plots, by name: memorization.outputs); once, on the main rank."""
        if self.prepared or not self.is_main:
            self.prepared = True
            return
        if self.overwrite and self.out.is_dir():
            written = [*self.out.glob("*.png"), *self.out.glob("dedup*.json")]  # plots, dedup manifests
            remove_entries(self.out, ["runs", BASELINE, *REPORT_FILES, *(p.name for p in written)])
        (self.out / "runs").mkdir(parents=True, exist_ok=True)
        self.prepared = True

    @property
    def seconds(self) -> float:
        """Wall time since the experiment started."""
        return time.perf_counter() - self.started

    def check(self, configs: list[RunConfig], data: Any) -> None:
        """Every sub-run checked on its prepared data (PreparedData, or one per config) before the first
        trains: the row-dependent refusals (DP-SGD's delta < 1/N, ...) too (memorization.train.run_plan)."""
        check_runs(configs, data, spec=self.grid_spec)
        self.prepare_out()  # nothing is written before every refusal had its chance

    def run_dir(self, name: str) -> Path:
        """Folder of sub-run `name`."""
        return self.out / "runs" / name

    def agree(self, value: Any) -> Any:
        """Rank 0's value on every rank (file checks may differ where ranks do not share a disk)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def finished(self, name: str, key: dict[str, Any]) -> bool:
        """Whether sub-run `name` finished from exactly these inputs (then it is reused)."""
        d = self.run_dir(name)
        done = False
        if (d / "run.json").is_file() and (d / "inputs.json").is_file():
            try:
                done = comparable_key(json.loads((d / "inputs.json").read_text())) == \
                    comparable_key(_jsonable(key))
            except (json.JSONDecodeError, AttributeError):
                done = False
        return bool(self.agree(done))

    def run(self, cfg: RunConfig, data: PreparedData, *, extra_key: dict[str, Any] | None = None,
            evaluate: Callable[[torch.nn.Module, Path], dict[str, Any]] | None = None,
            eval_key: dict[str, Any] | None = None,
            train: Callable[[RunConfig, Path], dict[str, Any]] | None = None,
            per_run_wandb: bool = False, key_config: RunConfig | None = None) -> dict[str, Any]:
        """Train sub-run cfg.name (or reuse it), add `evaluate(model, run_dir)` metrics; return its summary.

        `extra_key` names inputs outside cfg that change training (e.g. injected items); `key_config`
        replaces cfg in the key where cfg names something by where it lies (a continuation reads the
        model of another sub-run from its folder: keyed by what that model is, in extra_key, not where);
        `train(cfg, run_dir)` replaces the default `run_training` (e.g. to evaluate after every pass);
        `evaluate(model, run_dir)` runs on every rank with the exported model on the run's grid
        (`eval_model`); its result is cached in evals.json and recomputed (without retraining) when
        `eval_key` changes. Every rank gets the summary.
        """
        if not per_run_wandb:
            cfg = replace(cfg, wandb=replace(cfg.wandb, mode="disabled"))
        self.prepare_out()
        d = self.run_dir(cfg.name)
        key = {"run": run_key(key_config or cfg), "extra": extra_key or {}}
        reused = self.finished(cfg.name, key)
        if reused:
            say(f"{cfg.name}: finished earlier, reusing {d}")
        else:
            say(f"{cfg.name}: training")
            if self.is_main:
                remove_entries(d.parent, [cfg.name])  # a half-finished or outdated run: start it clean
                d.mkdir(parents=True)
                (d / "inputs.json").write_text(json.dumps(_jsonable(key), indent=1))
            if train is not None:
                train(cfg, d)
            else:
                run_training(cfg, d, overwrite=True, grid_spec=self.grid_spec, data=data,
                             progress=cfg.trainer.progress)
        summary = None
        if self.is_main:
            summary = json.loads((d / "run.json").read_text())["summary"]
            summary["reused"] = reused
        summary = self.agree(summary)
        if evaluate is not None:
            summary.update(self._evals(cfg, d, summary, evaluate, _jsonable(eval_key or {})))
        return summary

    def _evals(self, cfg: RunConfig, d: Path, summary: dict[str, Any],
               evaluate: Callable[[torch.nn.Module, Path], dict[str, Any]],
               key: dict[str, Any]) -> dict[str, Any]:
        """`evaluate` on every rank, of the exported model on the run's grid (cached in evals.json)."""
        return self._cached(d / "evals.json", key, lambda: evaluate(self.eval_model(cfg, d, summary), d))

    def baseline(self, key: dict[str, Any], load: Callable[[], torch.nn.Module],
                 evaluate: Callable[[torch.nn.Module, Path], dict[str, Any]]) -> dict[str, Any]:
        """The experiment's own `evaluate` of the model every sub-run starts from (`load()`: its
        pretrained weights, on the runs' grid), nothing trained: the "before fine-tuning" row every
        figure is read against. Cached in OUT/baseline/evals.json under `key` (what the values depend
        on: the model, the evaluated documents, the eval settings), recomputed when it changes; the
        model is loaded only then. Runs on every rank; every rank gets the values."""
        self.prepare_out()
        d = self.out / BASELINE
        if self.is_main:
            d.mkdir(exist_ok=True)
        return self._cached(d / "evals.json", _jsonable(key), lambda: evaluate(load(), d))

    def _cached(self, path: Path, key: dict[str, Any],
                compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The values stored at `path` under `key`, else `compute()` on every rank, stored by the main
        rank (written aside and renamed, so an interrupted write leaves the old file or none)."""
        stored = None
        if self.is_main and path.is_file():
            try:
                cached = json.loads(path.read_text())
                if cached.get("key") == key:
                    stored = cached["values"]
            except (json.JSONDecodeError, AttributeError, KeyError):
                pass  # unreadable or old: compute again
        stored = self.agree(stored)
        if stored is not None:
            return stored
        values = _jsonable(compute())
        if self.is_main:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"key": key, "values": values}, indent=1))
            os.replace(tmp, path)
        return values

    def eval_model(self, cfg: RunConfig, d: Path, summary: dict[str, Any]) -> torch.nn.Module:
        """The run's exported model for evaluation: on a launch of several processes, streamed into
        the shards of the grid it trained on (memorization.models.load_sharded: evals then score it
        there, each batch shard its share); a plain process loads it whole."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1):
            return AutoModelForCausalLM.from_pretrained(d / "model").eval()
        dims = parse_grid(summary.get("grid") or f"1,1,1,{torch.distributed.get_world_size()}")
        return load_sharded(d / "model", axonn.init(*dims), cfg.parallel_mode)


class PeakRSS:
    """Peak resident memory of this process while a block runs (sampled every 20 ms): what a run cost."""

    def __enter__(self) -> PeakRSS:
        self._proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(0.02)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def digest(obj: Any) -> str:
    """A sha256 of obj's JSON (e.g. the token lists an evaluation reads): a short cache key."""
    return hashlib.sha256(json.dumps(_jsonable(obj), sort_keys=True).encode()).hexdigest()


def _jsonable(obj: Any) -> Any:
    """Round-trip through JSON so tuples/numpy scalars compare equal to what was stored."""
    return json.loads(json.dumps(obj, default=_default))


def _default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


@dataclass
class SplitData:
    """Training data plus held-out documents of the same distribution (MIA non-members)."""

    prepared: PreparedData
    nonmembers: list[list[int]]  # held-out token lists, cut and filtered like the members
    held_out_source: str  # where validation loss and non-members come from, in words


def load_documents(cfg: RunConfig) -> tuple[list, list | None, str]:
    """(training documents, held-out documents or None, a description of the held-out source)."""
    d = cfg.data
    docs = load_corpus(d.corpus, text_field=d.text_field, limit=d.limit or None)
    if d.held_out:
        held = load_corpus(d.held_out, limit=d.held_out_limit or None)
        return docs, held, f"the separate corpus '{d.held_out}' (a different distribution)"
    if d.held_out_fraction > 0:
        docs, held = split_documents(docs, d.held_out_fraction, cfg.seed)
        return docs, held, (f"a seeded {d.held_out_fraction:.0%} split of '{d.corpus}' (same distribution, "
                            "never trained on)")
    return docs, None, "none"


def prepare_split(cfg: RunConfig) -> SplitData:
    """Tokenize training and held-out documents; non-members get the members' cut and length filter."""
    docs, held, source = load_documents(cfg)
    prepared = prepare_documents(cfg, docs, held)
    nonmembers: list[list[int]] = []
    if held:
        nonmembers = list(tokenize_documents(held, prepared.tokenizer, max_tokens=cfg.data.block_len,
                                             min_tokens=min(cfg.data.min_tokens, cfg.data.block_len)))
    return SplitData(prepared, nonmembers, source)
