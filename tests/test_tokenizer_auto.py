"""data.tokenizer=auto: a pretrained model brings its own tokenizer; a mismatched one is refused."""
from __future__ import annotations

import pytest
import torch

from data_pipelines import load_tokenizer
from memorization.cli import main
from memorization.models import build_model, check_tokenizer, run_tokenizer
from memorize_core import ConfigError

CFG = """
name: t
data: {{corpus: wiki-leads, limit: 12, block_len: 48, min_tokens: 40, held_out: "", tokenizer: {tok},
       vocab_size: 300}}
model: {{name: {model}}}
trainer: {{batch_size: 4, max_steps: 1, progress: false}}
eval: {{extraction: false}}
wandb: {{mode: disabled}}
"""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny 'pretrained' HF folder: seeded weights plus its own corpus BPE tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from data_pipelines import load_corpus, load_tokenizer

    texts = [d.text for d in load_corpus("lee-news", limit=40)]
    tok = load_tokenizer("bpe", texts=texts, vocab_size=320, cache_dir=tmp_path_factory.mktemp("c"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4))
    out = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _write(tmp_path, tok, model):
    p = tmp_path / "c.yaml"
    p.write_text(CFG.format(tok=tok, model=model))
    return p


def test_auto_on_zoo_shape_is_the_corpus_bpe(cache_dir):
    texts = ["alpha beta gamma delta"] * 20
    auto = run_tokenizer("auto", "tiny", texts=texts, vocab_size=300)
    bpe = run_tokenizer("bpe", "tiny", texts=texts, vocab_size=300)
    assert auto.get_vocab() == bpe.get_vocab()


def test_auto_on_pretrained_dir_is_its_own_tokenizer(pretrained, cache_dir):
    tok = run_tokenizer("auto", str(pretrained), texts=["anything else entirely"] * 5, vocab_size=300)
    from transformers import AutoTokenizer

    assert tok.get_vocab() == AutoTokenizer.from_pretrained(pretrained).get_vocab()
    check_tokenizer(tok, str(pretrained))  # its own tokenizer passes
    assert run_tokenizer(str(pretrained), str(pretrained), texts=[], vocab_size=300) is not None


def test_explicit_other_tokenizer_is_refused(pretrained, cache_dir):
    with pytest.raises(ConfigError, match=r"data\.tokenizer='gpt2'.*data\.tokenizer=auto"):
        run_tokenizer("gpt2", str(pretrained), texts=[], vocab_size=300)
    # same size, other ids: a BPE trained on other text with the model's vocabulary size
    other = [d for d in ("the cat sat on the mat " * 50, "x y z " * 40)]
    with pytest.raises(ConfigError, match=r"data\.tokenizer='bpe': a corpus BPE never matches"):
        run_tokenizer("bpe", str(pretrained), texts=other, vocab_size=300)  # refused before training
    with pytest.raises(ConfigError, match="does not match the tokenizer"):
        check_tokenizer(load_tokenizer("bpe", texts=other, vocab_size=300), str(pretrained), spec="bpe")


def test_cli_refuses_mismatch_before_writing(pretrained, tmp_path, cache_dir, capsys):
    out = tmp_path / "out"
    code = main(["train", str(_write(tmp_path, "gpt2", pretrained)), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: data.tokenizer='gpt2'") and "auto" in err, err
    assert not out.exists()


def test_cli_auto_trains_pretrained_on_its_own_ids(pretrained, tmp_path, cache_dir, capsys):
    out = tmp_path / "out"
    assert main(["train", str(_write(tmp_path, "auto", pretrained)), "--out", str(out)]) == 0
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out / "model")
    assert saved.get_vocab() == AutoTokenizer.from_pretrained(pretrained).get_vocab()


@pytest.mark.parametrize("overrides,needle", [
    ("{hidden_size: -1}", "model.overrides"),
    ("{num_attention_heads: 0}", "model.overrides"),
])
def test_bad_overrides_are_one_line_errors(tmp_path, cache_dir, capsys, overrides, needle):
    out = tmp_path / "out"
    code = main(["train", str(_write(tmp_path, "auto", "tiny")), "--out", str(out),
                 f"model.overrides={overrides}"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith(f"error: {needle}"), err
    assert not out.exists()


def test_bad_overrides_on_pretrained_are_one_line_errors(pretrained, tmp_path, cache_dir, capsys):
    out = tmp_path / "out"
    code = main(["train", str(_write(tmp_path, "auto", pretrained)), "--out", str(out),
                 "model.overrides={hidden_size: 64}"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: model.overrides") and "weight shapes" in err, err
    assert not out.exists()


def test_random_init_control_keeps_architecture_not_weights(pretrained):
    a = build_model(str(pretrained))
    b = build_model(str(pretrained), random_init=True, seed=3)
    c = build_model(str(pretrained), random_init=True, seed=3)
    assert a.config.to_dict()["hidden_size"] == b.config.hidden_size
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert wa.shape == wb.shape and not torch.equal(wa, wb) and torch.equal(wb, wc)
