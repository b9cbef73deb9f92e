"""Downstream utility through EleutherAI's lm-evaluation-harness, scored on evals' one scoring path.

`ScorerLM` is an lm-eval `LM` over a model object we hold — serial, or sharded over its grid —
whose three request types are answered by this package's scoring functions: `loglikelihood`
(multiple-choice tasks) by `continuation_scores`, `loglikelihood_rolling` (perplexity tasks) by the
same function over lm-eval's rolling windows, `generate_until` by `greedy_generate`. Tokenization,
prompts, few-shot sampling and metrics are lm-eval's own (`TemplateLM`, `simple_evaluate`), so a task
scores the same requests as lm-eval's Hugging Face backend on the same folder.

On a sharded model every rank runs `run_tasks` with the same arguments: lm-eval sees one process
(rank 0 of 1) on each, hands every rank all requests, and the scoring functions split them over the
batch shards and gather the answers, so each rank computes the same metrics (lm-eval assembles its
results dict only where LOCAL_RANK is 0; rank 0's is broadcast, so every rank returns it).
"""
from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lm_eval import simple_evaluate
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, resolve_max_length
from lm_eval.tasks import TaskManager
from tqdm.auto import tqdm

from axonn.grid import ProcessGrid
from evals.decoding import greedy_generate
from evals.perplexity import continuation_scores
from evals.scoring import Scorer
from memorize_core import fail

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF backend default for generate_until


class ScorerLM(TemplateLM):
    """An lm-eval language model backed by `model` on `grid` (serial when None)."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, grid: ProcessGrid | None = None,
                 batch_size: int = 16, max_length: int | None = None) -> None:
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self.grid = Scorer(model, grid).grid
        self._batch_size = batch_size
        self._max_length = max_length or resolve_max_length(getattr(model, "config", None), tokenizer)
        self.tokens_scored = 0

    # -- what TemplateLM needs ---------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        """End of text: the tokenizer's EOS (as lm-eval's HF backend)."""
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is conditioned on: BOS, else EOS (as lm-eval's HF backend)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Context length in tokens: longer inputs are cut from the left."""
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        """Key of lm-eval's request cache."""
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of `string`: the tokenizer's own special-token rule unless told (HF backend's rule)."""
        kw = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **kw)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **_: Any) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy?) per ((context, continuation), ctx ids, cont ids)."""
        pairs = []
        for _, ctx, cont in requests:
            if len(cont) > self.max_length:
                raise fail("continuation", len(cont), f"is longer than the model's context of "
                           f"{self.max_length} tokens; lm-eval cannot score it")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]  # cut the context from the left
            pairs.append((whole[:-len(cont)], list(cont)))
        with self._progress(len(pairs), "loglikelihood", disable_tqdm) as step:
            return continuation_scores(self.model, pairs, self._batch_size, grid=self.grid, progress=step)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole documents in disjoint windows of the context length (lm-eval's)."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores):
            totals[i] += logp
        return totals

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations cut at the first stop sequence (or EOS), grouped by context length."""
        eos = self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        results: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        prepared = []
        for i, (context, gen_kwargs) in enumerate(req.args for req in requests):
            kw = dict(gen_kwargs or {})
            if kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0:
                raise fail("gen_kwargs", kw, "sampling is not supported; this adapter decodes greedily "
                           "(set do_sample: false / temperature: 0 in the task)")
            until = handle_stop_sequences(kw.get("until"), eos=eos)
            new = int(kw.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            room = self.max_length - new
            if room < 1:
                raise fail("max_gen_toks", new, f"leaves no room for a context in {self.max_length} tokens")
            ids = self.tok_encode(context)[-room:]
            prepared.append((ids, until))
            groups.setdefault((len(ids), new), []).append(i)
        with self._progress(len(requests), "generate_until", disable_tqdm) as step:
            for (_, new), idx in groups.items():
                for b in range(0, len(idx), self._batch_size):
                    chunk = idx[b:b + self._batch_size]
                    prefixes = torch.tensor([prepared[i][0] for i in chunk], dtype=torch.long)
                    out = greedy_generate(self.model, prefixes, new, grid=self.grid)
                    for i, row in zip(chunk, out.tolist()):
                        results[i] = self._cut(row, prepared[i][1])
                    step(len(chunk), len(chunk) * (prefixes.shape[1] + new))
        return [r if r is not None else "" for r in results]

    def _cut(self, tokens: list[int], until: Sequence[str]) -> str:
        """Decoded text before EOS and before the first stop sequence."""
        if self.eot_token_id in tokens:
            tokens = tokens[:tokens.index(self.eot_token_id)]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text

    def _progress(self, total: int, what: str, disable: bool) -> Any:
        return _Progress(total, what, disable or self.grid.rank != 0, self)


class _Progress:
    """tqdm over scored requests with tokens/s, on the main rank only."""

    def __init__(self, total: int, what: str, disable: bool, lm: ScorerLM) -> None:
        self.bar = tqdm(total=total, desc=what, unit="req", disable=disable, leave=False)
        self.lm, self.start, self.tokens = lm, time.perf_counter(), 0

    def __enter__(self):
        return self.step

    def step(self, requests: int, tokens: int) -> None:
        self.tokens += tokens
        self.lm.tokens_scored += tokens
        self.bar.update(requests)
        self.bar.set_postfix(tok_s=f"{self.tokens / max(time.perf_counter() - self.start, 1e-9):.0f}")

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()


def task_manager(include_path: str | None = None, defaults: bool = True) -> TaskManager:
    """lm-eval's task index: the YAMLs under `include_path`, plus (`defaults`) lm-eval's own ~15k
    tasks, whose index takes 15-35 s to build on 2 cores (so leave them out when no task needs them)."""
    return TaskManager(include_path=include_path, include_defaults=defaults)


def run_tasks(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[str], *, num_fewshot: int | None = None,
              limit: int | None = None, include_path: str | None = None, manager: TaskManager | None = None,
              batch_size: int = 16, grid: ProcessGrid | None = None, seed: int = 1234) -> dict[str, Any]:
    """Run lm-eval `tasks` on `model`; returns {tasks: {name: {metric: value, metric_stderr: ...,
    n: docs, alias}}, groups: {...}, n_shot, versions, limit, num_fewshot, seconds, tokens}.

    The global random/numpy/torch generators are left as they were (lm-eval reseeds them), so an
    evaluation between training passes does not change the training that follows.
    """
    start = time.perf_counter()
    lm = ScorerLM(model, tokenizer, grid=grid, batch_size=batch_size)
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        out = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit or None,
                              task_manager=manager or task_manager(include_path), log_samples=False,
                              bootstrap_iters=1000, random_seed=seed, numpy_random_seed=seed,
                              torch_random_seed=seed, fewshot_random_seed=seed, verbosity="ERROR")
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
    if lm.grid.distributed:  # lm-eval builds the results dict where LOCAL_RANK is 0 only: share rank 0's
        box = [out]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    groups = set(out.get("groups", {}))
    rows = {name: _metrics(res, out.get("n-samples", {}).get(name))
            for name, res in out["results"].items() if name not in groups}
    return {"tasks": rows,
            "groups": {name: {**_metrics(res, None), "n": _group_n(name, rows, out.get("group_subtasks", {}))}
                       for name, res in out.get("groups", {}).items()},
            "n_shot": out.get("n-shot", {}), "versions": out.get("versions", {}),
            "num_fewshot": num_fewshot, "limit": limit or None, "seed": seed,
            "tokens": lm.tokens_scored, "seconds": time.perf_counter() - start}


def _group_n(name: str, rows: dict[str, Any], subtasks: dict[str, list[str]]) -> int:
    """Documents scored under a group: its tasks' n, through nested groups."""
    return sum(rows[t].get("n", 0) if t in rows else _group_n(t, rows, subtasks)
               for t in subtasks.get(name, []))


def _metrics(res: dict[str, Any], samples: dict[str, int] | None) -> dict[str, Any]:
    """lm-eval's 'acc,none' / 'acc_stderr,none' keys as {acc, acc_stderr}; n = documents scored."""
    row: dict[str, Any] = {"alias": str(res.get("alias", "")).strip(" -")}
    for key, value in res.items():
        if "," not in key or isinstance(value, str):
            continue
        metric, filt = key.split(",", 1)
        name = metric if filt == "none" else f"{metric}[{filt}]"
        row[name] = None if value is None else float(value)
    if samples:
        row["n"] = int(samples.get("effective", samples.get("original", 0)))
    return row
