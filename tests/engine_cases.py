"""Shared pieces of the engine tests: tiny HF models, grid enumeration, and the serial-vs-grid check.

(Imported by the test_engine_* modules; test_engine_models checks the grid enumeration.)

Tolerance: for each tensor the error is max|parallel - serial| / max|serial| (relative to the
tensor's largest entry).  Asserted: logits, loss, gradients and grad norm <= 1e-5 in fp32 and
<= 1e-12 in fp64; parameter shards and state dicts bitwise equal.  Measured values are returned
so the tests can report them.
"""
from __future__ import annotations

import copy
import itertools

import torch
import torch.nn.functional as F

TOL = 1e-5     # fp32
TOL64 = 1e-12  # fp64: shows the parallel algorithm is exact, not just close
B, S = 8, 8  # batch 8 so that every Z x data <= 8 gets whole rows


def grids(world: int) -> list[tuple[int, int, int, int]]:
    """Every (x, y, z, data) of powers of two whose product is `world`."""
    pows = [1, 2, 4, 8]
    return [g for g in itertools.product(pows, repeat=4) if g[0] * g[1] * g[2] * g[3] == world]


def variants(world: int, index: int) -> list[tuple[str, bool]]:
    """(mode, tied) runs for the index-th grid: all four below 8 ranks; at 8 ranks (where every
    collective is slow on a small machine) both modes, with tied/untied alternating between grids."""
    if world < 8:
        return [("easy", True), ("easy", False), ("paired", True), ("paired", False)]
    tied = index % 2 == 0
    return [("easy", tied), ("paired", not tied)]


def kv_heads(mode: str, y: int) -> int:
    """GQA wherever the mode allows it: easy splits no heads; paired needs kv heads divisible by y."""
    return 2 if mode == "easy" else max(4, y)


def llama(tied: bool, attention_bias: bool = True, kv_heads: int = 8, pad: bool = False,
          seed: int = 0, mlp_bias: bool = False) -> torch.nn.Module:
    """A 2-layer Llama, hidden 64, 8 heads, vocab 128 (divisible by every grid axis up to 8).

    Default: attention projections with bias, MLP without, so one model covers both kinds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=tied, attention_bias=attention_bias, mlp_bias=mlp_bias,
                      pad_token_id=0 if pad else None, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def family(name: str, seed: int = 0) -> torch.nn.Module:
    """Tiny models of other families (easy mode): gpt2 (Conv1D, tied), neox (untied), qwen2, mistral."""
    import transformers as tf

    torch.manual_seed(seed)
    if name == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=8,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                            eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg).float()
    if name == "neox":
        cfg = tf.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=8, max_position_embeddings=64, tie_word_embeddings=False,
                               hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                               eos_token_id=0)
        return tf.GPTNeoXForCausalLM(cfg).float()
    if name == "qwen2":
        cfg = tf.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                             tie_word_embeddings=True)
        return tf.Qwen2ForCausalLM(cfg).float()
    if name == "mistral":
        cfg = tf.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                               tie_word_embeddings=False, sliding_window=None)
        return tf.MistralForCausalLM(cfg).float()
    raise ValueError(name)


def batch(vocab: int = 128, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, S] and labels with ~1/4 of them ignored (-100), like goldfish masking."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (B, S), generator=g)
    labels = ids.clone()
    labels[torch.rand(B, S, generator=g) < 0.25] = -100
    return ids, labels


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def serial_reference(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                     autocast: bool = False) -> dict:
    """Logits, mean loss and named gradients of the serial model."""
    model.zero_grad(set_to_none=True)
    with _autocast(autocast):
        logits = model(input_ids=ids).logits
    loss_sum = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum")
    loss = loss_sum / (labels[:, 1:] != -100).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    return {"logits": logits.detach(), "loss": loss.item(), "grads": grads, "norm": norm}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def check_grid(serial: torch.nn.Module, ref: dict, ids: torch.Tensor, labels: torch.Tensor,
               grid: object, mode: str, gather: bool = False, autocast: bool = False) -> dict:
    """One forward/backward on the grid; errors against the serial reference (see module docstring).

    Each rank compares its own pieces (logits rows/vocab slice, parameter and gradient shards) with
    the matching slices of the serial tensors, so together the ranks check everything without extra
    collectives.  With `gather`, also checks full_state_dict / full_grad_dict (collective)."""
    import axonn

    model = axonn.parallelize(copy.deepcopy(serial), grid, mode=mode)
    local_ids, local_labels = axonn.shard_batch(ids, grid), axonn.shard_batch(labels, grid)
    with _autocast(autocast):
        logits = model(input_ids=local_ids).logits
    loss_sum, count = axonn.cross_entropy(logits[:, :-1], local_labels[:, 1:], grid)
    total = axonn.all_reduce_sum(count.clone(), grid)
    (loss_sum / total).backward()
    axonn.sync_gradients(model, grid)
    loss = axonn.all_reduce_sum(loss_sum.detach().clone(), grid) / total

    shards, index = axonn.batch_shard(grid)
    n = B // shards
    ref_logits = ref["logits"][index * n:(index + 1) * n]
    if isinstance(logits, axonn.VocabShardedLogits):
        v = ref_logits.shape[-1] // grid.y
        ref_logits = ref_logits[..., grid.y_rank * v:(grid.y_rank + 1) * v]
    out = {"logits": rel(logits.detach().as_subclass(torch.Tensor), ref_logits),
           "loss": abs(loss.item() - ref["loss"]) / abs(ref["loss"])}
    worst, worst_name, params_exact = 0.0, "", True
    serial_params = dict(serial.named_parameters())
    layouts = axonn.layouts_of(model)
    for name, p in model.named_parameters():
        spec = layouts.get(name)
        want_g, want_p = ref["grads"][name], serial_params[name].detach()
        if spec is not None:
            want_g, want_p = spec.local_from_full(want_g), spec.local_from_full(want_p)
        params_exact &= torch.equal(p.detach(), want_p)
        e = rel(p.grad, want_g)
        if e > worst:
            worst, worst_name = e, name
    out.update(grad=worst, grad_name=worst_name, params_exact=params_exact)
    norm = axonn.grad_norm(model, grid)
    out["norm"] = abs(norm - ref["norm"]) / ref["norm"]
    if gather:
        full = axonn.full_state_dict(model)
        want = serial.state_dict()
        out["state_exact"] = full.keys() == want.keys() and all(torch.equal(full[k], want[k]) for k in want)
        grads = axonn.full_grad_dict(model)
        out["full_grad"] = max(rel(grads[k], g) for k, g in ref["grads"].items())
    return out
