"""The run config: one typed dataclass tree loaded from YAML with `a.b=c` overrides."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from axonn.config import TrainerConfig, apply_overrides, build, load_yaml
from data_pipelines import DedupConfig, is_chat_spec
from memorization.mitigations.goldfish import GoldfishConfig
from memorization.mitigations.peft_lora import LoraSettings
from memorization.outputs import check_name
from memorize_core import NEAR_DISTANCES, ConfigError, fail

PACKING = ("per-document", "packed")
FORMATS = ("auto", "text", "chat")
WANDB_MODES = ("offline", "online", "disabled")
# The largest target epsilon accepted: e^epsilon bounds how much likelier any output becomes with a
# row in the data; at 100 that factor is 2.7e43, a guarantee in name only (papers report 1 to 10).
MAX_EPSILON = 100.0
# Largest data.block_len / data.vocab_size: 2**24 is 16x the longest context and largest vocabulary in
# use; beyond it the BPE trainer panics and a row of ids cannot be allocated.
MAX_TOKENS = 2**24
ACCOUNTANTS = ("rdp", "prv", "gdp")  # Opacus' accountants
CLIPPINGS = ("ghost", "per_sample")  # trainer.dp.clipping


@dataclass
class DPConfig:
    """DP-SGD settings (memorization.mitigations.dp_sgd runs them through Opacus; docs/usage.md, "DP-SGD").

    Exactly one of noise_multiplier (sigma: noise std = sigma * max_grad_norm) and target_epsilon
    (sigma solved for the planned steps) is set. delta must also be below 1/N, checked where the
    number of training rows N is known.
    """

    enabled: bool = False
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    max_grad_norm: float = 1.0  # each row's gradient is clipped to this L2 norm
    accountant: str = "rdp"  # rdp, prv or gdp
    poisson_sampling: bool = True  # false: shuffled fixed-size batches (epsilon then assumes Poisson)
    secure_rng: bool = False  # Opacus secure_mode: noise from torchcsprng, not the seed
    # ghost: per-row norms from activations and output gradients, then a second backward of the
    # reweighted loss (any grid; memorization/mitigations/ghost_clipping.py); per_sample: Opacus' per-sample
    # gradients (serial or 1,1,1,D; memorization/mitigations/dp_sgd.py)
    clipping: str = "ghost"

    def validate(self, prefix: str = "trainer.dp") -> None:
        """Raise ConfigError on out-of-range values (and, if enabled, unless exactly one of sigma/epsilon)."""
        p = prefix
        if self.accountant not in ACCOUNTANTS:
            raise fail(f"{p}.accountant", self.accountant, f"choose one of {', '.join(ACCOUNTANTS)}")
        if self.noise_multiplier is not None and not 0 <= self.noise_multiplier < math.inf:
            raise fail(f"{p}.noise_multiplier", self.noise_multiplier, "must be >= 0 (0: no noise)")
        if self.target_epsilon is not None and not 0 < self.target_epsilon < math.inf:
            raise fail(f"{p}.target_epsilon", self.target_epsilon, "must be > 0, e.g. 8 (smaller: safer)")
        if self.target_epsilon is not None and self.target_epsilon > MAX_EPSILON:
            raise fail(f"{p}.target_epsilon", self.target_epsilon, f"must be <= {MAX_EPSILON:g}: beyond it "
                       f"e^epsilon (> {math.exp(MAX_EPSILON):.0e}) bounds nothing; use e.g. 8 or turn DP off")
        if not 0 < self.delta < 1:
            raise fail(f"{p}.delta", self.delta, "must be within (0, 1) and below 1/N for N rows, e.g. 1e-5")
        if self.clipping not in CLIPPINGS:
            raise fail(f"{p}.clipping", self.clipping, f"choose one of {', '.join(CLIPPINGS)} (ghost: any "
                       "grid, no per-row gradients; per_sample: Opacus, serial or data-parallel)")
        if not 0 < self.max_grad_norm < math.inf:
            raise fail(f"{p}.max_grad_norm", self.max_grad_norm, "must be a finite number > 0 (the per-row "
                       "clipping bound; an infinite one makes every step non-finite), e.g. 1.0")
        if self.enabled and (self.noise_multiplier is None) == (self.target_epsilon is None):
            both = "both" if self.noise_multiplier is not None else "neither"
            raise fail(f"{p}.noise_multiplier", self.noise_multiplier, f"{both} of noise_multiplier and "
                       "target_epsilon is set; set exactly one (e.g. trainer.dp.target_epsilon=8)")


@dataclass
class RunTrainerConfig(TrainerConfig):
    """A run's `trainer` section: the engine's TrainerConfig plus DP-SGD (`trainer.dp`), which the
    Trainer carries out only through its gradient hook (memorization.mitigations.dp_sgd.OpacusPrivacy)."""

    dp: DPConfig = field(default_factory=DPConfig)

    def validate(self, prefix: str = "trainer") -> None:
        """The engine's range checks, then DP-SGD's."""
        super().validate(prefix)
        self.dp.validate(f"{prefix}.dp")

    def check_gradient_hook(self, hook: Any) -> None:
        """Never train "with DP" without the hook that does it."""
        if self.dp.enabled and hook is None:
            raise fail("trainer.dp.enabled", True, "DP-SGD needs a privacy plug-in: pass gradient_hook="
                       "memorization.mitigations.dp_sgd.OpacusPrivacy(cfg, len(train_data)) or set it false")


@dataclass
class DataConfig:
    """Which text, which tokenizer, and how it becomes rows."""

    corpus: str = "wiki-leads"
    # text: plain documents, every token supervised; chat: prompt/response or messages JSONL (or a
    # bundled chat set), only assistant tokens supervised; auto: chat when the corpus looks like one
    format: str = "auto"
    text_field: str = "text"
    limit: int = 0  # 0 = every document
    # auto: a pretrained model's own tokenizer, else a BPE trained on the corpus; or bpe, gpt2, or a
    # local tokenizer folder (a pretrained model refuses one whose ids differ from its own)
    tokenizer: str = "auto"
    vocab_size: int = 4096  # for bpe
    block_len: int = 128
    packing: str = "per-document"  # one document per row (cut to block_len) or packed blocks
    min_tokens: int = 64  # drop documents shorter than this (extraction needs prefix + suffix)
    held_out: str = "lee-news"  # corpus for validation loss; "" = split held_out_fraction off corpus
    held_out_fraction: float = 0.0
    held_out_limit: int = 100
    # deduplicate the training documents before they become rows (data_pipelines.dedup: exact documents,
    # near documents with near_documents, repeated spans); off by default; OUT/dedup.json lists removals
    dedup: DedupConfig = field(default_factory=DedupConfig)

    def validate(self, prefix: str = "data") -> None:
        """Range checks."""
        self.dedup.validate(f"{prefix}.dedup")
        if self.dedup.enabled and (self.format == "chat"
                                   or (self.format == "auto" and is_chat_spec(self.corpus))):
            raise fail(f"{prefix}.dedup.enabled", True, "deduplication works on plain documents, not "
                       "conversations; set it false for a chat corpus")
        if self.format not in FORMATS:
            raise fail(f"{prefix}.format", self.format, f"choose one of {', '.join(FORMATS)}")
        if self.packing not in PACKING:
            raise fail(f"{prefix}.packing", self.packing, f"choose one of {', '.join(PACKING)}")
        for name in ("block_len", "vocab_size"):
            if getattr(self, name) < 2:
                raise fail(f"{prefix}.{name}", getattr(self, name), "must be >= 2")
            if getattr(self, name) > MAX_TOKENS:  # beyond: the tokenizer trainer and the allocator crash
                raise fail(f"{prefix}.{name}", getattr(self, name), f"must be <= 2**24 = {MAX_TOKENS} (the "
                           "longest contexts and largest vocabularies in use are ~1e6); pass e.g. 4096")
        for name in ("limit", "min_tokens", "held_out_limit"):
            if getattr(self, name) < 0:
                raise fail(f"{prefix}.{name}", getattr(self, name), "must be >= 0")
        if self.packing == "per-document" and self.min_tokens > self.block_len:  # each row cuts at block_len
            raise fail(f"{prefix}.min_tokens", self.min_tokens, f"must not exceed {prefix}.block_len="
                       f"{self.block_len} (per-document rows are cut there); lower it or raise block_len")
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise fail(f"{prefix}.held_out_fraction", self.held_out_fraction, "must be within [0, 1)")


@dataclass
class ModelConfig:
    """A zoo name (configs/models), smollm2-135m, or a local HF model directory."""

    name: str = "tiny"
    overrides: dict = field(default_factory=dict)  # HF config fields, e.g. {num_hidden_layers: 2}
    random_init: bool = False  # a pretrained model's architecture with fresh seeded weights (a control)
    lora: LoraSettings = field(default_factory=LoraSettings)  # train peft LoRA adapters on a frozen base


def change_words(distance: str | None) -> tuple[str, str]:
    """How reports name a near-verbatim distance's changes (eval.nv_distance): (a column's word, the
    phrase), as in "<= 2 changed" and "within d changed tokens"; None (a result from before the distance
    was recorded) is Hamming's."""
    return ("edits", "token edits") if distance == "levenshtein" else ("changed", "changed tokens")


@dataclass
class EvalConfig:
    """What the run measures on its trained model, on its grid: extraction of every training
    document, and membership inference (training documents vs the held-out ones)."""

    extraction: bool = True
    prefix: int = 32
    suffix: int = 32
    batch_size: int = 32
    num_beams: int = 1
    mia: bool = False  # members = training documents, non-members = data.held_out's (or the split's)
    mia_docs: int = 1000  # documents of each side (the first ones; 0 = all)
    mia_k: float = 0.2  # Min-K% fraction
    bootstrap: int = 1000  # resamples for 95% CIs of AUC and TPR@1%FPR (0 = none)
    # extraction beyond greedy (evals/probabilistic.py): p_z of each decoding scheme from one forward
    # per window, the (n, p)-extractable fraction for each n at probability np_p, at each prefix offset
    # into the documents ("" = greedy only)
    sampling: str = "t=1.0;t=0.7,top_k=40;top_p=0.9"
    offsets: list = field(default_factory=lambda: [0])
    np_ns: list = field(default_factory=lambda: [1, 10, 100, 1000])
    np_p: float = 0.5
    # near-verbatim extraction (evals/near_verbatim.py): a lower bound of each scheme's probability of
    # a sample within d changes of the suffix, d = 0..near_verbatim (0 = off), from a beam search keeping
    # nv_beams paths per number of changes; changes counted by nv_distance: hamming (tokens substituted
    # in place) or levenshtein (substituted, inserted or deleted: a copy shifted by a dropped word is near)
    near_verbatim: int = 0
    nv_beams: int = 8
    nv_distance: str = "hamming"
    # the one-run privacy audit (memorization/eval/dp_audit.py): m random canaries, each trained on with
    # probability 1/2, and an epsilon lower bound at 95% from how well their losses tell which
    audit: bool = False
    audit_canaries: int = 64
    # the secrets of a chat set whose records carry one (private-records): each record's exposure over
    # its secret space estimated from this many sampled secrets (0 = off), for the trained records and
    # the held-out ones, each scored as the answer to its own prompt (memorization/eval/exposure.py)
    secrets: int = 0
    # the greedy decoder of the extraction (evals/static_decode.py): auto = the compiled static-cache
    # decode, every row checked by a teacher-forced forward, on a GPU for a model split over no tensor
    # dimension; the KV-cache decoder otherwise. static or kv force one.
    decode: str = "auto"

    def validate(self, prefix: str = "eval") -> None:
        """Range checks."""
        for name in ("prefix", "suffix", "batch_size", "num_beams"):
            if getattr(self, name) < 1:
                raise fail(f"{prefix}.{name}", getattr(self, name), "must be >= 1")
        if self.decode not in ("auto", "static", "kv"):
            raise fail(f"{prefix}.decode", self.decode, "choose auto, static or kv")
        if self.decode == "static" and self.num_beams > 1:
            raise fail(f"{prefix}.decode", self.decode, f"the static decode is greedy; with num_beams="
                       f"{self.num_beams} use auto or kv")
        if self.mia_docs < 0:
            raise fail(f"{prefix}.mia_docs", self.mia_docs, "must be >= 0 (0 = every document)")
        if not 0 < self.mia_k <= 1:
            raise fail(f"{prefix}.mia_k", self.mia_k, "pass a fraction in (0, 1], e.g. 0.2")
        if self.bootstrap < 0:
            raise fail(f"{prefix}.bootstrap", self.bootstrap, "must be >= 0 (0 = no intervals)")
        # eval.sampling's schemes are parsed by the run's plan (evals.sampling: torch, not at config load)
        if not isinstance(self.sampling, str):
            raise fail(f"{prefix}.sampling", self.sampling,
                       'a string such as "t=1.0;t=0.7,top_k=40;top_p=0.9"')
        if not self.offsets or any(isinstance(o, bool) or not isinstance(o, int) or o < 0
                                   for o in self.offsets):
            raise fail(f"{prefix}.offsets", self.offsets, "a list of token offsets >= 0, e.g. [0, 16, 32]")
        if not self.np_ns or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.np_ns):
            raise fail(f"{prefix}.np_ns", self.np_ns, "a list of sample counts >= 1, e.g. [1, 10, 100, 1000]")
        if isinstance(self.np_p, bool) or not isinstance(self.np_p, (int, float)) or not 0 < self.np_p < 1:
            raise fail(f"{prefix}.np_p", self.np_p, "a probability in (0, 1), e.g. 0.5")
        if isinstance(self.near_verbatim, bool) or not isinstance(self.near_verbatim, int) or not (
                0 <= self.near_verbatim < self.suffix):
            raise fail(f"{prefix}.near_verbatim", self.near_verbatim, f"the largest number of changed suffix "
                       f"tokens to count: an integer in [0, eval.suffix={self.suffix}) (0 = off), e.g. 3")
        if isinstance(self.nv_beams, bool) or not isinstance(self.nv_beams, int) or self.nv_beams < 1:
            raise fail(f"{prefix}.nv_beams", self.nv_beams, "paths kept per number of changed tokens, >= 1, "
                       "e.g. 8")
        if self.nv_distance not in NEAR_DISTANCES:
            raise fail(f"{prefix}.nv_distance", self.nv_distance, "choose hamming (tokens substituted in "
                       "place) or levenshtein (substituted, inserted or deleted)")
        if isinstance(self.secrets, bool) or not isinstance(self.secrets, int) or self.secrets < 0:
            raise fail(f"{prefix}.secrets", self.secrets, "the number of sampled secrets each record's "
                       "exposure is estimated from, >= 0 (0 = off), e.g. 1000")
        if self.audit and not 4 <= self.audit_canaries <= 100_000:
            raise fail(f"{prefix}.audit_canaries", self.audit_canaries, "must be within [4, 100000] (the "
                       "audit guesses on the highest and lowest scores of m canaries), e.g. 64")

    def near_args(self, window: bool = True) -> dict[str, Any]:
        """evals.near_verbatim.near_verbatim's window, search and (n, p) settings from these fields;
        `window` False: without the window (near_verbatim_pairs: each answer from its whole prompt)."""
        win = {"prefix_len": self.prefix, "suffix_len": self.suffix} if window else {}
        return {**win, "max_edits": self.near_verbatim, "beams": self.nv_beams, "distance": self.nv_distance,
                "ns": self.np_ns, "p": self.np_p, "batch_size": self.batch_size}

    def near_key(self) -> dict[str, Any]:
        """The near-verbatim settings a run's key or an experiment's eval_key holds: none while off, and
        the distance only where it is not the default (results from before it existed stay valid)."""
        if not self.near_verbatim:
            return {}
        return {"near_verbatim": self.near_verbatim, "nv_beams": self.nv_beams,
                **({"nv_distance": self.nv_distance} if self.nv_distance != "hamming" else {})}


@dataclass
class WandbConfig:
    """Weights & Biases: offline by default (no network needed; `wandb sync` uploads later)."""

    mode: str = "offline"
    project: str = "memorize"
    entity: str = ""
    group: str = ""
    tags: list[str] = field(default_factory=list)

    def validate(self, prefix: str = "wandb") -> None:
        """Mode check."""
        if self.mode not in WANDB_MODES:
            raise fail(f"{prefix}.mode", self.mode, f"choose one of {', '.join(WANDB_MODES)}")


@dataclass
class RunConfig:
    """Everything one training run needs."""

    name: str = "run"
    seed: int = 0
    grid: str = "1,1,1,1"  # X,Y,Z,DATA tensor/data parallel grid, or "auto"
    parallel_mode: str = "easy"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    goldfish: GoldfishConfig = field(default_factory=GoldfishConfig)
    trainer: RunTrainerConfig = field(default_factory=RunTrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self, prefix: str = "") -> None:
        """Cross-section checks."""
        check_name("name", self.name)  # the default OUT is runs/NAME; experiments' run folders too
        if not 0 <= self.seed < 2**63:  # torch.manual_seed takes a 64-bit integer
            raise fail("seed", self.seed, "must be within [0, 2**63); pass e.g. 0")
        if self.parallel_mode not in ("easy", "paired"):
            raise fail("parallel_mode", self.parallel_mode, "choose easy or paired")
        if self.eval.extraction and self.eval.prefix + self.eval.suffix > self.data.block_len:
            raise fail("eval.prefix+eval.suffix", self.eval.prefix + self.eval.suffix,
                       f"must fit in data.block_len={self.data.block_len}; shorten them or raise block_len")
        if self.eval.mia and not (self.data.held_out or self.data.held_out_fraction > 0):
            raise fail("eval.mia", True, "needs non-members: set data.held_out (a corpus the model never "
                       "sees) or data.held_out_fraction (a held-out split of data.corpus, the fair choice)")
        chat = self.data.format == "chat" or (self.data.format == "auto" and is_chat_spec(self.data.corpus))
        if self.eval.mia and chat and self.data.held_out and not is_chat_spec(self.data.held_out):
            raise fail("eval.mia", True, f"on chat data scores answers given their prompts, and "
                       f"data.held_out={self.data.held_out!r} holds plain documents; name a chat set as "
                       "data.held_out, or set data.held_out='' and data.held_out_fraction=0.5 (a held-out "
                       "split of the conversations, the fair choice)")


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a RunConfig from YAML (or defaults when path is None) and apply overrides."""
    data = load_yaml(path) if path is not None else {}
    data = apply_overrides(data, overrides or [])
    return build(RunConfig, data)


__all__ = ["RunConfig", "DataConfig", "ModelConfig", "EvalConfig", "WandbConfig", "RunTrainerConfig",
           "DPConfig", "ConfigError", "load_run_config"]
