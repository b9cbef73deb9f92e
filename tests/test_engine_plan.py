"""The parallel plan (axonn/parallel_plan.py): built from the model's structure once, kept in the
handle, printed by the dry run, and honoured when the caller gives one.

A Llama's paired plan names q/k/v/gate/up column, o/down row, lm_head head and embed_tokens embedding;
easy mode plans every linear easy.  A caller's plan is applied as given: a Llama with its first layer
forced easy in paired mode, and a small model with names of its own (no Hugging Face class), train
like the serial model (fp64 <= 1e-10, the engine's tolerance).  Bad plans (a name that is no module,
a style that does not exist or that the module cannot take, a column without its row, a size the
grid does not divide, a mode that contradicts the plan) are one ConfigError line, and the model is
left untouched.
"""
from __future__ import annotations

import engine_cases as ec
import pytest
import torch
from torch import nn

import axonn
from axonn.spawn import run_distributed

COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
ROW = {"o_proj", "down_proj"}


def _meta_llama(tied: bool = False) -> nn.Module:
    with torch.device("meta"):
        return ec.llama(tied=tied, kv_heads=4)


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def test_paired_plan_of_a_tiny_llama_names_every_layer() -> None:
    model = _meta_llama()
    plan = axonn.plan_for(model, axonn.ProcessGrid.virtual(1, 2, 1, 1), "paired")
    assert plan.mode == "paired" and plan.pair_axes == ("x", "y")
    assert plan.modules("embedding") == ["model.embed_tokens"] and plan.modules("head") == ["lm_head"]
    assert {_leaf(n) for n in plan.modules("column")} == COLUMN
    assert {_leaf(n) for n in plan.modules("row")} == ROW
    assert len(plan.modules("column")) == 2 * 5 and len(plan.modules("row")) == 2 * 2
    assert plan.modules("easy") == []
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(plan.styles) == sorted(linears + ["model.embed_tokens"])  # nothing else is planned
    # X > Y flips the pairs (axonn.pairing.pair_axes); the styles stay
    flipped = axonn.plan_for(model, axonn.ProcessGrid.virtual(2, 1, 1, 1), "paired")
    assert flipped.pair_axes == ("y", "x") and dict(flipped.styles) == dict(plan.styles)


def test_easy_plan_is_all_easy_and_gpt2_conv1d_is_planned() -> None:
    plan = axonn.plan_for(_meta_llama(tied=True), axonn.ProcessGrid.virtual(2, 2, 1, 1), "easy")
    assert plan.mode == "easy" and plan.modules("column") == plan.modules("row") == []
    assert len(plan.modules("easy")) == 2 * 7 and plan.modules("head") == ["lm_head"]
    assert plan.summary()["pair_axes"] is None
    lines = plan.describe()
    assert lines[0] == "easy mode, no paired blocks: embedding 1, head 1, easy 14"
    assert lines[-1].startswith("easy      model.layers.0.self_attn.q_proj, ") and lines[-1].endswith("(+11)")
    gpt2 = ec.family("gpt2")
    plan = axonn.plan_for(gpt2, axonn.ProcessGrid.virtual(1, 2, 1, 1))
    assert plan.modules("embedding") == ["transformer.wte"] and plan.modules("head") == ["lm_head"]
    assert len(plan.modules("easy")) == 2 * 4  # c_attn, c_proj, c_fc, c_proj (Conv1D) per block
    with pytest.raises(axonn.ConfigError, match=r"^mode='paired': GPT2LMHeadModel has no Llama-family"):
        axonn.plan_for(gpt2, axonn.ProcessGrid.virtual(1, 2, 1, 1), "paired")


def test_the_handle_keeps_the_plan_it_applied() -> None:
    grid = axonn.ProcessGrid.virtual(1, 2, 1, 1)
    want = axonn.plan_for(_meta_llama(), grid, "paired")
    model = axonn.parallelize(_meta_llama(), grid, mode="paired")
    handle = axonn.engine_of(model)
    assert handle.plan == want and handle.mode == "paired" and handle.pair_axes == ("x", "y")
    for name, style in want.styles.items():
        m = model.get_submodule(name)
        if style == "embedding":
            assert isinstance(m, axonn.ParallelEmbedding)
        else:
            assert isinstance(m, axonn.ParallelLinear) and m.style == style, name
    # a plan given is applied as given: layer 0 easy, layer 1 still paired
    layer0 = {n: "easy" for n in want.styles if n.startswith("model.layers.0.")}
    model = axonn.parallelize(_meta_llama(), grid, plan=want.override(layer0))
    assert axonn.engine_of(model).plan == want.override(layer0)
    assert model.model.layers[0].self_attn.q_proj.style == "easy"
    assert model.model.layers[1].self_attn.q_proj.style == "column"


def _one_line(fn) -> str:
    with pytest.raises(axonn.ConfigError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_a_bad_plan_is_one_line_and_touches_nothing() -> None:
    grid = axonn.ProcessGrid.virtual(1, 2, 1, 1)
    good = axonn.plan_for(_meta_llama(), grid, "paired")
    assert _one_line(lambda: axonn.ParallelPlan({"lm_head": "vocab"})).startswith(
        "plan['lm_head']='vocab': choose one of embedding, head, column, row, easy")
    assert _one_line(lambda: axonn.ParallelPlan({}, pair_axes=("x", "z"))).startswith("plan.pair_axes=")
    bad = {
        "missing": (good.override({"model.layers.9.mlp.up_proj": "easy"}),
                    "plan='model.layers.9.mlp.up_proj': LlamaForCausalLM has no such module"),
        "not a linear": (good.override({"model.norm": "easy"}),
                         "plan['model.norm']='easy': needs an nn.Linear"),
        "not an embedding": (good.override({"lm_head": "embedding"}),
                             "plan['lm_head']='embedding': needs an nn.Embedding"),
        "column without row": (good.override({"model.layers.0.mlp.down_proj": "easy"}),
                               "plan='model.layers.0.mlp': has column layers but no row layer"),
    }
    for key, (plan, start) in bad.items():
        model = _meta_llama()
        before = [type(m) for m in model.modules()]
        assert _one_line(lambda m=model, p=plan: axonn.parallelize(m, grid, plan=p)).startswith(start), key
        assert not axonn.is_parallel(model) and [type(m) for m in model.modules()] == before, key
    assert _one_line(lambda: axonn.parallelize(_meta_llama(), grid, mode="easy", plan=good)).startswith(
        "mode='easy': the plan given is paired")
    assert _one_line(lambda: axonn.parallelize(_meta_llama(), grid, plan={"lm_head": "head"})).startswith(
        "plan='dict': pass an axonn.ParallelPlan")
    # a custom model's sizes are checked per module, along the axes of each module's style
    odd = _Tiny(hidden=16, ffn=18)
    msg = _one_line(lambda: axonn.parallelize(odd, axonn.ProcessGrid.virtual(1, 4, 1, 1), plan=_TINY_PLAN))
    assert msg.startswith("grid.y=4: must divide up.out_features=18"), msg
    assert not axonn.is_parallel(odd)
    msg = _one_line(lambda: axonn.parallelize(odd, grid))
    assert msg.startswith("model='_Tiny': plan_for reads a Hugging Face PreTrainedModel"), msg


class _Tiny(nn.Module):
    """A causal-LM-shaped model with names of its own: emb -> up (column) -> gelu -> down (row) -> out."""

    def __init__(self, vocab: int = 32, hidden: int = 16, ffn: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.mix = nn.Linear(hidden, hidden, bias=False)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.out(torch.tanh(self.mix(h)))


_TINY_PLAN = axonn.ParallelPlan({"emb": "embedding", "up": "column", "down": "row", "mix": "easy",
                                 "out": "head"})


def _steps(model, grid, batches, logits_of) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for ids, labels in batches:
        opt.zero_grad(set_to_none=True)
        local_ids, local_labels = axonn.shard_batch(ids, grid), axonn.shard_batch(labels, grid)
        loss_sum, count = axonn.cross_entropy(logits_of(model, local_ids)[:, :-1], local_labels[:, 1:], grid)
        total = axonn.all_reduce_sum(count.clone(), grid)
        (loss_sum / total).backward()
        axonn.sync_gradients(model, grid)
        axonn.clip_grad_norm_(model, 0.5, grid)
        opt.step()
        losses.append((axonn.all_reduce_sum(loss_sum.detach().clone(), grid) / total).item())
    return losses


def _user_plans(rank: int, world: int) -> list[dict]:
    import copy

    hf = lambda m, ids: m(input_ids=ids).logits  # noqa: E731
    plain = lambda m, ids: m(ids)  # noqa: E731
    rows = []
    for dims in [(1, 2, 1, 2), (2, 1, 2, 1)]:
        grid = axonn.ProcessGrid(*dims)
        batches = [ec.batch(seed=s) for s in range(3)]
        serial = ec.llama(tied=True, kv_heads=4).double()
        plan = axonn.plan_for(serial, grid, "paired")
        plan = plan.override({n: "easy" for n in plan.styles if n.startswith("model.layers.0.")})
        model = axonn.parallelize(copy.deepcopy(serial), grid, plan=plan)
        styles = (model.model.layers[0].mlp.up_proj.style, model.model.layers[1].mlp.up_proj.style)
        got = _steps(model, grid, batches, hf)
        want = _steps(serial, axonn.ProcessGrid.serial(), batches, hf)
        state, ref = axonn.full_state_dict(model), serial.state_dict()
        rows.append({"what": f"llama layer 0 easy {dims}", "styles": styles, "losses": (got, want),
                     "params": max(ec.rel(v, ref[k]) for k, v in state.items())})

        torch.manual_seed(0)
        serial = _Tiny().double()
        tiny_batches = [ec.batch(vocab=32, seed=s) for s in range(3)]
        model = axonn.parallelize(copy.deepcopy(serial), grid, plan=_TINY_PLAN)
        got = _steps(model, grid, tiny_batches, plain)
        want = _steps(serial, axonn.ProcessGrid.serial(), tiny_batches, plain)
        state, ref = axonn.full_state_dict(model), serial.state_dict()
        rows.append({"what": f"own names {dims}", "styles": (model.up.style, model.down.style),
                     "losses": (got, want), "params": max(ec.rel(v, ref[k]) for k, v in state.items())})
    return rows


@pytest.mark.distributed
def test_a_plan_given_trains_like_serial() -> None:
    res = run_distributed(_user_plans, 4, timeout=300)
    for rank_rows in res:
        for r in rank_rows:
            got, want = r["losses"]
            assert all(abs(g - w) <= ec.TOL64 * abs(w) for g, w in zip(got, want)), r
            assert r["params"] <= ec.TOL64, r
            want_styles = ("easy", "column") if r["what"].startswith("llama") else ("column", "row")
            assert r["styles"] == want_styles, r


def test_the_dry_run_reports_the_plan() -> None:
    from memorization.config import load_run_config
    from memorization.train.dryrun import dry_run
    from memorization.train.dryrun_report import format_report

    cfg = load_run_config(None, ["model.name=tiny", "data.vocab_size=320", "data.block_len=16",
                                 "data.min_tokens=16", "trainer.batch_size=8", "eval.extraction=false",
                                 "parallel_mode=paired"])
    report = dry_run(cfg, world=2, grid="1,2,1,1")
    plan = report["plan"]
    layers = report["model"]["layers"]
    assert plan["mode"] == "paired" and plan["pair_axes"] == ["x", "y"]
    assert {k: v["count"] for k, v in plan["styles"].items()} == {
        "embedding": 1, "head": 1, "column": 5 * layers, "row": 2 * layers}
    rows = [f"model.layers.{i}.{leaf}" for i, leaf in ((0, "self_attn.o_proj"), (0, "mlp.down_proj"),
                                                        (1, "self_attn.o_proj"))]
    assert plan["styles"]["row"]["first"] == rows
    text = format_report(report).splitlines()
    at = next(i for i, line in enumerate(text) if line.startswith("  plan "))
    assert text[at - 1].startswith("  grid ") and text[at + len(plan["lines"])].startswith("  batch ")
    assert text[at] == f"  plan       {plan['lines'][0]}"
    assert plan["lines"][0].startswith("paired mode, paired blocks split (x in, y out): embedding 1, head 1")
