"""DP-SGD through Opacus: the Trainer's gradient hook for `trainer.dp` with `clipping: per_sample`
(memorization.config.DPConfig; docs/usage.md "DP-SGD"), and the checks and accounting both clippings
share (ghost clipping, the default: privacy_ghost.GhostPrivacy, a subclass). The engine knows nothing
of it: OpacusPrivacy implements axonn.hooks.GradientHook (draw_rows -> objective -> after_backward
-> reduce -> metrics).

What one step does (Abadi et al. 2016, as Opacus implements it):
1. Sampling: every training row joins the step's batch independently with probability
   q = batch_size / N (Poisson, Opacus' UniformWithReplacementSampler), from a generator seeded by
   (trainer.seed, step): the same rows on every rank and after a resume. The batch is padded with
   unsupervised rows to a multiple of the batch shards (z*data), and such rows have a zero gradient;
   it runs in micro-batches of at most batch_size/grad_accum rows, the last one ragged.
2. Per-sample gradients: Opacus' GradSampleHooks on the unwrapped model (its own grad samplers for
   nn.Linear and nn.Embedding, functorch for layers it has none for, e.g. LlamaRMSNorm; tied
   embeddings are summed over their two uses). Row i's loss is l_i = (sum of CE over row i's
   supervised tokens) / (their number): the trainer's token-normalised loss, taken per row, so a row's
   gradient depends on that row alone. Labels -100 (padding, chat prompts, goldfish drops) are not
   supervised, so goldfish composes: the clipped quantity is the gradient of the goldfish loss.
3. Clipping and noise: Opacus' DPOptimizer scales each row's whole gradient g_i to norm at most
   C = max_grad_norm and sums (after every micro-batch's backward, so per-row gradients never
   outlive their micro-batch), adds N(0, (sigma C)^2) per coordinate once, and the plug-in divides by
   the expected batch size B = batch_size (not the drawn size, which would leak it):
   grad = (sum_i g_i min(1, C/|g_i|) + noise) / B. With sigma = 0 and C large this is the mean over the
   batch's rows of their mean-token-CE gradients: the plain step when every row has as many
   supervised tokens (the plain step weighs rows by their token counts).
4. Accounting: the Sampled Gaussian Mechanism with (sigma, q) for `steps` steps, through Opacus'
   accountant (rdp default, prv or gdp); target_epsilon solves sigma with Opacus'
   get_noise_multiplier for the planned steps. Every step logs `epsilon` and `delta`.

Data parallel (grid 1,1,1,D): the model is not handed to the engine (nothing is split). Each rank
clips its own rows; Opacus' DistributedDPOptimizer adds the noise on rank 0 only and all-reduces
the clipped sums, so the result is the serial step's (same rows, same noise, tested). Grids that
split weights over X, Y or Z are refused for per-sample clipping: no rank sees a row's whole
gradient (ghost clipping sums each row's norm over the shards instead).

The global trainer.grad_clip still applies to the private gradient afterwards (post-processing:
no privacy cost; with AdamW it barely matters; set it to 0 to turn it off).

Noise is drawn from a generator seeded by (trainer.seed, step), so runs are reproducible; the
guarantee then holds only against someone who does not know the seed. `secure_rng` draws noise
and batches from torchcsprng (Opacus secure_mode) instead: not reproducible, no seed to keep.

Cost: Opacus keeps every parameter's per-sample gradient ([rows, *shape], fp32) and each hooked
layer's input activations until the micro-batch's rows are clipped and summed: about rows per
micro-batch x 4 bytes x params on top of a plain step, e.g. 4.3 GB for SmolLM2-135M at 8 rows
(trainer.micro_batch or grad_accum cut it; the sum of clipped rows lives across micro-batches).
"""
from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from axonn.grid import ProcessGrid
from axonn.hooks import GradientHook
from axonn.layers.per_example import unsupported
from memorization.config import RunTrainerConfig
from memorization.models import meta_model
from memorize_core import IGNORE_INDEX, fail

_SAMPLE, _NOISE = 1, 2  # salts: the batch and the noise of a step come from different streams


def check_dp_grid(dp: Any, grid: ProcessGrid | Sequence[int] | None) -> None:
    """Refuse what DP-SGD's clipping cannot do on a grid: Opacus' per-sample gradients on a tensor split
    (X, Y or Z > 1), secure noise on several ranks with ghost clipping.

    `grid`: the run's ProcessGrid, or the requested X,Y,Z,D (memorization.train.parallel.requested_grid),
    None for `auto` (checked again once resolved)."""
    if not dp.enabled or not grid:
        return
    dims = tuple(grid.dims if isinstance(grid, ProcessGrid) else grid)
    x, y, z, data = dims
    text = ",".join(map(str, dims))
    if x * y * z > 1 and dp.clipping == "per_sample":
        raise fail("trainer.dp.clipping", dp.clipping, f"Opacus' per-sample gradients run serial or "
                   f"data-parallel (grid 1,1,1,D); grid {text} splits weights over X/Y/Z: use "
                   f"trainer.dp.clipping=ghost (any grid) or --grid 1,1,1,{x * y * z * data}")
    if dp.secure_rng and dp.clipping == "ghost" and x * y * z * data > 1:
        raise fail("trainer.dp.secure_rng", True, f"ghost clipping on {x * y * z * data} ranks draws seeded "
                   "noise so that copies of a parameter agree; run secure noise in one process, with "
                   "trainer.dp.clipping=per_sample at 1,1,1,D, or set it false")


def check_dp_model(dp: Any, model_config: Any) -> None:
    """Refuse a model whose parameters ghost clipping cannot see (a parameter shared other than by an
    embedding and a linear layer), on a meta copy of it."""
    if not dp.enabled or dp.clipping != "ghost" or model_config is None:
        return
    why = unsupported(meta_model(model_config))
    if why is not None:
        raise fail("trainer.dp.clipping", dp.clipping, f"ghost clipping cannot split the gradient of a "
                   f"{why}; use trainer.dp.clipping=per_sample (serial or 1,1,1,D) or untie the parameter")


def check_dp(cfg: RunTrainerConfig, rows: int | None,
             grid: ProcessGrid | Sequence[int] | None, model_config: Any = None) -> float | None:
    """Every refusal of a DP-SGD run (run_plan.check_run calls it before anything is built);
    returns the noise multiplier sigma (None when DP is off or the row count N is not known yet).

    `cfg` is the trainer config the run trains with (goldfish's token budget stretched: planned steps
    decide sigma for a target epsilon); `model_config` the HF config of the model (None: not checked)."""
    dp = cfg.dp
    if not dp.enabled:
        return None
    check_dp_grid(dp, grid)
    check_dp_model(dp, model_config)
    if cfg.activation_checkpointing and dp.clipping == "per_sample":
        raise fail("trainer.activation_checkpointing", True, "recomputed blocks run their forward twice, "
                   "which Opacus' per-sample hooks cannot follow; turn it off or use "
                   "trainer.dp.clipping=ghost")
    if dp.secure_rng and importlib.util.find_spec("torchcsprng") is None:
        raise fail("trainer.dp.secure_rng", True, _CSPRNG_FIX)
    if rows is None:
        return None
    if cfg.batch_size > rows:
        raise fail("trainer.batch_size", cfg.batch_size, f"DP-SGD samples each row with probability "
                   f"batch_size/N, so it must be <= N={rows} training rows")
    if dp.delta >= 1.0 / rows:
        raise fail("trainer.dp.delta", dp.delta, f"must be < 1/N = {1.0 / rows:.3g} for N={rows} "
                   "training rows (else leaking a whole row fits the budget); use e.g. "
                   f"{_below(0.1 / rows)}")
    return noise_multiplier(cfg, rows)


def noise_multiplier(cfg: RunTrainerConfig, rows: int) -> float:
    """sigma: trainer.dp.noise_multiplier, or the one reaching target_epsilon at delta after the planned
    steps (Opacus' binary search; ConfigError when no sigma reaches it)."""
    dp = cfg.dp
    if dp.noise_multiplier is not None:
        return dp.noise_multiplier
    rate, steps = cfg.batch_size / rows, cfg.planned_steps(rows)[1]
    try:
        return _solve_sigma(dp.target_epsilon, dp.delta, rate, steps, dp.accountant)
    except ValueError as e:
        raise fail("trainer.dp.target_epsilon", dp.target_epsilon, f"unreachable with q={rate:.3g} "
                   f"over {steps} steps ({e}); raise it, raise delta or train fewer steps") from None


@functools.lru_cache(maxsize=32)
def _solve_sigma(epsilon: float, delta: float, rate: float, steps: int, accountant: str) -> float:
    """Opacus' binary search for sigma (~4 s on SmolLM2's schedule), once per setting: the run's
    check and the privacy plug-in ask for the same one."""
    from opacus.accountants.utils import get_noise_multiplier  # deferred: opacus +1.9 s, DP runs only

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=rate,
                                          steps=steps, accountant=accountant))


_CSPRNG_FIX = ("needs torchcsprng (Opacus secure_mode); install it or set it false for seeded, "
               "reproducible noise")


def _secure_generator() -> Any:
    import torchcsprng  # type: ignore[import-not-found]  # deferred: optional, secure_rng runs only

    return torchcsprng.create_random_device_generator("/dev/urandom")


def _seed(seed: int, step: int, salt: int) -> int:
    return (seed * 1_000_003 + step * 4 + salt) % (2 ** 63)


class OpacusPrivacy(GradientHook):
    """The Trainer's gradient hook for DP-SGD: Poisson batches (draw_rows), each row's mean CE as the
    objective, Opacus per-sample clipping after every backward, noise and the sum over ranks in place
    of the engine's gradient sync (reduce), epsilon and delta per step (metrics).

    Its settings were checked by `check_dp` (memorization.train.run_plan.check_run: delta against N, the grid,
    the budget) before anything was built; pass it to Trainer(gradient_hook=...).
    """

    token_losses = True  # the objective is per row: it needs each token's CE

    def __init__(self, cfg: RunTrainerConfig, rows: int, *, grid: ProcessGrid | None = None,
                 sigma: float | None = None):
        # the run's plan (memorization.train.run_plan.plan_run) refused every bad setting and solved sigma
        dp = cfg.dp
        self.cfg, self.dp, self.rows = cfg, dp, rows
        self.batch_size = cfg.batch_size
        self.sample_rate = cfg.batch_size / rows
        self.planned_steps = cfg.planned_steps(rows)[1]
        self.noise_multiplier = noise_multiplier(cfg, rows) if sigma is None else sigma
        self._secure = _secure_generator() if dp.secure_rng else None
        self._optimizer: Any = None
        self._rdp_step: Any = None
        self._eps_cache: dict[int, float] = {}

    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, grid: ProcessGrid) -> None:
        """Opacus' per-sample gradient hooks on `model`; its clipping and noise on `optimizer`'s params."""
        # deferred: opacus +1.9 s, DP runs only
        from opacus.grad_sample import GradSampleHooks  # deferred
        from opacus.optimizers import DistributedDPOptimizer, DPOptimizer  # deferred

        # the embedding's input (token ids) needs no gradient; torch says so on every backward
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed")
        # loss_reduction="sum": the trainer backpropagates sum_i l_i, so the captured per-sample
        # gradients are the gradients of each l_i, unscaled; the division by B happens in reduce.
        self._hooks = GradSampleHooks(model, batch_first=True, loss_reduction="sum", strict=True)
        distributed = grid.data > 1  # gradients summed over data-parallel replicas
        cls = DistributedDPOptimizer if distributed else DPOptimizer
        self._optimizer = cls(optimizer, noise_multiplier=self.noise_multiplier,
                              max_grad_norm=self.dp.max_grad_norm, expected_batch_size=self.batch_size,
                              loss_reduction="sum", generator=self._secure, secure_mode=self.dp.secure_rng)
        self._distributed = distributed

    # -- one step ----------------------------------------------------------------------------
    def draw_rows(self, step: int, n: int) -> torch.Tensor | None:
        """Row indices (of `n`) of step `step`'s Poisson batch (None without poisson_sampling)."""
        if not self.dp.poisson_sampling:
            return None
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler  # deferred: opacus +1.9 s

        gen = self._secure or torch.Generator().manual_seed(_seed(self.cfg.seed, step, _SAMPLE))
        sampler = UniformWithReplacementSampler(num_samples=n, sample_rate=self.sample_rate, generator=gen,
                                                steps=1)
        return torch.tensor(next(iter(sampler)), dtype=torch.long)

    def objective(self, loss_sum: torch.Tensor, denom: int, token_losses: torch.Tensor | None,
                  targets: torch.Tensor) -> torch.Tensor:
        """Sum over rows of each row's mean CE over its own supervised tokens: a row's gradient depends
        on that row alone (what per-sample clipping bounds)."""
        count = (targets != IGNORE_INDEX).sum(1).clamp(min=1)
        return (token_losses.view(targets.shape).sum(1) / count).sum()

    def after_backward(self) -> None:
        """After a micro-batch's backward: clip each of its rows' gradients to C and add them to the sum."""
        opt = self._optimizer
        opt.clip_and_accumulate()  # p.summed_grad += sum_i g_i min(1, C / |g_i|)
        for p in opt.params:
            p.grad_sample = None  # per-row gradients live for one micro-batch only (memory)

    def reduce(self, step: int) -> bool:
        """p.grad = (sum over ranks of clipped per-row gradients + N(0, (sigma C)^2)) / batch_size, in
        place of the engine's gradient sync (True)."""
        opt = self._optimizer
        if self._secure is None:
            device = opt.params[0].device if opt.params else torch.device("cpu")
            opt.generator = torch.Generator(device).manual_seed(_seed(self.cfg.seed, step, _NOISE))
        opt.add_noise()  # p.grad = summed_grad + noise (only rank 0 adds it when distributed)
        if self._distributed:
            opt.reduce_gradients()  # sum the clipped sums (and rank 0's noise) over the data ranks
        for p in opt.params:
            p.grad /= self.batch_size  # the expected batch size: the drawn size would leak
            p.summed_grad = None
        return True

    # -- accounting --------------------------------------------------------------------------
    def epsilon(self, steps: int) -> float:
        """Epsilon spent at `delta` after `steps` steps, from Opacus' accountant (inf without noise)."""
        if steps <= 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        if steps not in self._eps_cache:
            self._eps_cache = {steps: self._epsilon(steps)}  # a step's value is read twice at most
        return self._eps_cache[steps]

    def _epsilon(self, steps: int) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if self.dp.accountant == "rdp":
                # RDP composes linearly over identical steps: Opacus' per-step RDP, computed once,
                # times `steps` is what RDPAccountant computes for history [(sigma, q, steps)].
                from opacus.accountants import RDPAccountant  # deferred: opacus +1.9 s, DP runs only
                from opacus.accountants.analysis import rdp  # deferred: opacus +1.9 s, DP runs only

                orders = RDPAccountant.DEFAULT_ALPHAS
                if self._rdp_step is None:
                    self._rdp_step = rdp.compute_rdp(q=self.sample_rate, steps=1, orders=orders,
                                                     noise_multiplier=self.noise_multiplier)
                eps, _ = rdp.get_privacy_spent(orders=orders, rdp=self._rdp_step * steps, delta=self.dp.delta)
                return float(eps)
            from opacus.accountants import create_accountant  # deferred: opacus +1.9 s, DP runs only

            accountant = create_accountant(mechanism=self.dp.accountant)
            accountant.history = [(self.noise_multiplier, self.sample_rate, steps)]
            return float(accountant.get_epsilon(delta=self.dp.delta))

    def metrics(self, steps: int) -> dict[str, Any]:
        """Per-step metrics: epsilon and delta spent so far."""
        return {"epsilon": self.epsilon(steps), "delta": self.dp.delta}

    def summary(self, steps: int) -> dict[str, Any]:
        """What run.json records about the guarantee and its settings."""
        return {"epsilon": self.epsilon(steps), "delta": self.dp.delta,
                "noise_multiplier": self.noise_multiplier, "max_grad_norm": self.dp.max_grad_norm,
                "sample_rate": self.sample_rate, "accountant": self.dp.accountant,
                "poisson_sampling": self.dp.poisson_sampling, "clipping": self.dp.clipping}


def _below(x: float) -> str:
    """A round delta below x (a power of ten)."""
    return f"{10 ** math.floor(math.log10(x) - 1e-12):.0e}"


__all__ = ["OpacusPrivacy", "check_dp", "check_dp_grid", "check_dp_model", "noise_multiplier"]
