"""The goldfish collator (memorization/integrations/collator.py) applies exactly GoldfishTransform's masks to
what HF / TRL collators produce: padded, padding-free, packed, and with completion-only masking."""
from __future__ import annotations

import pytest
import torch

from data_pipelines.chat import ChatTokens, chat_blocks
from data_pipelines.packing import pack, per_document
from memorization.integrations.collator import GoldfishCollator, goldfish_batch
from memorization.mitigations.goldfish import STRATEGIES, GoldfishConfig, GoldfishTransform
from memorize_core import IGNORE_INDEX, ConfigError

trl_sft = pytest.importorskip("trl.trainer.sft_trainer")
TrlCollator = trl_sft.DataCollatorForLanguageModeling


def _docs(n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 60, (n,), generator=g).tolist()
    return [torch.randint(3, 50, (k,), generator=g).tolist() for k in lengths]


def _cfg(strategy):
    return GoldfishConfig(enabled=True, strategy=strategy, k=3, h=4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_padded_batches_get_the_transforms_masks(strategy):
    docs = _docs()
    want = GoldfishTransform(_cfg(strategy), seed=1)(per_document(docs, 64, 0)[:])
    col = GoldfishCollator(TrlCollator(pad_token_id=0, pad_to_multiple_of=64), _cfg(strategy), seed=1)
    assert torch.equal(col([{"input_ids": d} for d in docs])["labels"], want)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_packed_rows_with_positions_get_the_transforms_masks(strategy):
    blocks = pack(_docs(seed=1), 32, 1)  # documents cut at row boundaries continue in the next row
    want = GoldfishTransform(_cfg(strategy), seed=1)(blocks[:])
    batch = {"input_ids": blocks.input_ids, "labels": blocks.labels,
             "position_ids": blocks.positions.clamp(min=0), "attention_mask": (blocks.doc_ids >= 0).long()}
    assert torch.equal(GoldfishTransform(_cfg(strategy), seed=1)(goldfish_batch(batch)), want)


@pytest.mark.parametrize("strategy", ["hash", "static"])
def test_padding_free_batches_mask_each_document_as_if_alone(strategy):
    """TRL's padding-free batch is one row of documents with restarting position_ids; the document-aware
    strategies give every document the mask it gets padded alone (TRL already drops each first label)."""
    docs = _docs(seed=2)
    alone = GoldfishTransform(_cfg(strategy), seed=1)(per_document(docs, 64, 0)[:])
    col = GoldfishCollator(TrlCollator(pad_token_id=0, padding_free=True), _cfg(strategy), seed=1)
    flat = col([{"input_ids": d} for d in docs])["labels"][0].split([len(d) for d in docs])
    for i, (got, d) in enumerate(zip(flat, docs)):
        assert torch.equal(got[1:], alone[i, 1:len(d)]), i


def _chats(prompt_lens, seed=3):
    g = torch.Generator().manual_seed(seed)
    response = torch.randint(3, 50, (30,), generator=g).tolist()
    out = []
    for n in prompt_lens:
        prompt = torch.randint(50, 90, (n,), generator=g).tolist()
        out.append(ChatTokens(prompt + response, n, [(n, n + 30)]))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_completion_only_labels_get_the_chat_blocks_masks(strategy):
    """Prompts masked by TRL stay masked, goldfish drops only supervised labels, and the masks equal what
    `memorize train` applies to the same conversations (chat_blocks: offsets from the response start)."""
    chats = _chats([5, 11, 17, 2])
    blocks = chat_blocks(chats, 64, 0)
    want = GoldfishTransform(_cfg(strategy), seed=1)(blocks[:])
    examples = [{"input_ids": c.ids, "labels": [IGNORE_INDEX] * c.prompt_len + c.ids[c.prompt_len:]}
                for c in chats]
    inner = TrlCollator(pad_token_id=0, pad_to_multiple_of=64)
    got = GoldfishCollator(inner, _cfg(strategy), seed=1)(examples)
    assert torch.equal(got["labels"], want)
    before = TrlCollator(pad_token_id=0, pad_to_multiple_of=64)(examples)["labels"]
    assert ((got["labels"] == IGNORE_INDEX) | (got["labels"] == before)).all()
    assert not ((before == IGNORE_INDEX) & (got["labels"] != IGNORE_INDEX)).any()  # no prompt supervised
    if strategy in ("hash", "static"):  # the same response gets the same mask under every prompt
        masks = [got["labels"][i, c.prompt_len:c.prompt_len + 30] == IGNORE_INDEX
                 for i, c in enumerate(chats)]
        assert all(torch.equal(m, masks[0]) for m in masks) and masks[0].any()


def test_bad_input_is_one_line_naming_field_value_and_fix():
    with pytest.raises(ConfigError, match=r"^labels=None: the wrapped collator returned no labels"):
        GoldfishCollator(lambda ex: {"input_ids": torch.ones(1, 4, dtype=torch.long)})([{}])
    with pytest.raises(ConfigError, match=r"^goldfish.strategy='hashh': choose one of hash, static"):
        GoldfishCollator(TrlCollator(pad_token_id=0), strategy="hashh")
    with pytest.raises(ConfigError, match=r"^goldfish.kk=4: unknown setting"):
        GoldfishCollator(TrlCollator(pad_token_id=0), kk=4)
    with pytest.raises(ConfigError, match=r"^goldfish.k=1: k must be an integer >= 2"):
        GoldfishCollator(TrlCollator(pad_token_id=0), k=1)


def test_a_missing_optional_package_is_one_line(monkeypatch):
    from memorization.integrations.extras import require

    monkeypatch.setitem(__import__("sys").modules, "trl", None)  # import trl -> ImportError
    with pytest.raises(ConfigError, match=r"^trl='not installed': install the optional extra: pip install "
                                          r"-c constraints.txt -e '\.\[trl\]'"):
        require("trl")
    monkeypatch.setitem(__import__("sys").modules, "peft", None)
    with pytest.raises(ConfigError, match=r"^peft='not installed'"):
        require("peft")


def _example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_exit_2_with_one_line(monkeypatch, capsys, tmp_path):
    sft = _example("sft_chat_goldfish")
    monkeypatch.setitem(__import__("sys").modules, "trl", None)
    assert sft.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: trl='not installed': install the optional extra")
    plain = _example("trainer_wiki_duplicates")
    assert plain.main(["--model", "tiny", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --model='tiny': not a pretrained model; pass smollm2-135m or " \
                                      "a folder\n"
    for example in (plain, sft):
        assert example.main(["--canaries", "0", "--out", str(tmp_path)]) == 2
        assert capsys.readouterr().err == "error: --canaries=0: pass at least 1 (canaries per copy count)\n"
    assert not any(tmp_path.iterdir())  # nothing half-written
