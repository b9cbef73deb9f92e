"""Model shapes the planner understands: the zoo YAMLs, a GPT-style family, Llama 3.x, HF configs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import yaml

from memorize_core import ConfigError, fail

# Located from this file rather than `axonn.__file__` so it also works while `axonn` is a
# namespace package: axonn/plan/shapes.py -> parents[2] is the repository root.
ZOO_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"

# GPT-style family in the spirit of the AxoNN paper's weak-scaling models: head_dim 128, FFN 4H,
# vocab 51,200, tied embeddings, learned positions (2048), biases. (hidden, layers) are our own
# choice so that 12*L*H^2 + V*H lands near the nominal size; docs/planning.md lists the counts.
# They are planned in paired mode (qkv, fc1 as column layers; o, fc2 as row layers).
GPT_FAMILY: dict[str, tuple[int, int]] = {
    "gpt-5b": (4096, 24),
    "gpt-10b": (5120, 32),
    "gpt-20b": (7168, 32),
    "gpt-40b": (9216, 38),
    "gpt-80b": (12288, 42),
    "gpt-160b": (12288, 84),
    "gpt-320b": (16384, 96),
}

# Llama 3.x shapes (hidden, layers, heads, kv heads, ffn, vocab, tied): used when the zoo folder is
# not shipped next to the package (e.g. an installed wheel).
LLAMA_BUILTIN: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "llama-1b": (2048, 16, 32, 8, 8192, 128256, True),
    "llama-3b": (3072, 28, 24, 8, 8192, 128256, True),
    "llama-8b": (4096, 32, 32, 8, 14336, 128256, False),
    "llama-70b": (8192, 80, 64, 8, 28672, 128256, False),
    "llama-405b": (16384, 126, 128, 8, 53248, 128256, False),
    # the pretrained model `memorize` fine-tunes by name (memorization.models.SMOLLM2): its config.json
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152, True),
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that the cost model needs."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    gated_mlp: bool = True  # Llama SwiGLU (gate, up, down) vs GPT (fc1, fc2)
    fused_qkv: bool = False  # GPT-style one [3H, H] projection vs Llama's q, k, v
    positions: int = 0  # learned position embeddings (GPT); 0 for RoPE models
    bias: bool = False  # biases on every Linear (GPT)
    pairable: bool = True  # the engine can run it in paired mode (Llama-family module names)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection output."""
        return self.kv_heads * self.head_dim

    def block_linears(self) -> list[tuple[str, int, int, bool]]:
        """(name, out, in, transposed) for the Linears of one block, in execution order.

        Paired mode: the first Linear of each pair splits `in` over X and `out` over Y; the second
        is transposed (in over Y, out over X), so the residual stream stays [tokens, H/X].
        """
        h, f = self.hidden, self.ffn
        if self.fused_qkv:
            attn = [("qkv_proj", h + 2 * self.kv_dim, h, False)]
        else:
            attn = [("q_proj", h, h, False), ("k_proj", self.kv_dim, h, False),
                    ("v_proj", self.kv_dim, h, False)]
        attn.append(("o_proj", h, h, True))
        if self.gated_mlp:
            mlp = [("gate_proj", f, h, False), ("up_proj", f, h, False), ("down_proj", h, f, True)]
        else:
            mlp = [("fc1", f, h, False), ("fc2", h, f, True)]
        return attn + mlp

    def norm_params(self) -> int:
        """All norm parameters: two per block and a final one (RMSNorm weight or LayerNorm w+b)."""
        return (2 * self.layers + 1) * self.hidden * (1 if self.gated_mlp else 2)

    @property
    def params(self) -> int:
        """Total trainable parameters."""
        mats = self.layers * sum(o * i for _, o, i, _ in self.block_linears())
        biases = self.layers * sum(o for _, o, _, _ in self.block_linears()) if self.bias else 0
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return mats + biases + emb + self.positions * self.hidden + self.norm_params()

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul (the N of 6*N*tokens): blocks + LM head."""
        mats = sum(o * i for _, o, i, _ in self.block_linears())
        return self.layers * mats + self.vocab * self.hidden


def gpt_shape(name: str) -> ModelShape:
    """A member of the GPT-style family (see GPT_FAMILY)."""
    hidden, layers = GPT_FAMILY[name]
    return ModelShape(name=name, hidden=hidden, layers=layers, heads=hidden // 128,
                      kv_heads=hidden // 128, ffn=4 * hidden, vocab=51200, tied=True,
                      gated_mlp=False, fused_qkv=True, positions=2048, bias=True)


def shape_from_config(cfg: dict, name: str = "custom") -> ModelShape:
    """Build a ModelShape from an HF-style config mapping (Llama/Mistral/Qwen or GPT-2 keys)."""
    try:
        if "n_embd" in cfg:  # GPT-2 family keys
            h = int(cfg["n_embd"])
            heads = int(cfg["n_head"])
            return ModelShape(name=name, hidden=h, layers=int(cfg["n_layer"]), heads=heads,
                              kv_heads=heads, ffn=int(cfg.get("n_inner") or 4 * h),
                              vocab=int(cfg["vocab_size"]), tied=True, gated_mlp=False,
                              fused_qkv=True, positions=int(cfg.get("n_positions", 1024)),
                              bias=True, pairable=False)
        heads = int(cfg["num_attention_heads"])
        return ModelShape(
            name=name, hidden=int(cfg["hidden_size"]), layers=int(cfg["num_hidden_layers"]),
            heads=heads, kv_heads=int(cfg.get("num_key_value_heads") or heads),
            ffn=int(cfg["intermediate_size"]), vocab=int(cfg["vocab_size"]),
            tied=bool(cfg.get("tie_word_embeddings", False)))
    except KeyError as e:
        raise fail("model", name, f"config lacks {e.args[0]!r}; pass a Llama- or GPT-2-style "
                   "HF config (hidden_size, num_hidden_layers, num_attention_heads, ...)") from None
    except (TypeError, ValueError):
        raise fail("model", name, "config sizes must be integers") from None


def zoo_names() -> list[str]:
    """Model names in configs/models (empty if the folder is not shipped)."""
    return sorted(p.stem for p in ZOO_DIR.glob("*.yaml")) if ZOO_DIR.is_dir() else []


def model_choices() -> list[str]:
    """Every name `--model` accepts (paths to configs are accepted too)."""
    return sorted(set(zoo_names()) | set(LLAMA_BUILTIN) | set(GPT_FAMILY))


def _read_config_file(path: Path) -> dict:
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError):
        raise fail("model", str(path), "could not parse the file; pass a valid config.json or "
                   "YAML") from None
    if not isinstance(data, dict):
        raise fail("model", str(path), "the config must be a mapping of keys to values")
    return data


def load_shape(model: Any) -> ModelShape:
    """Resolve a zoo/GPT/Llama name, a config path, a config dict or a HF config object."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, dict):
        return shape_from_config(model)
    if hasattr(model, "to_dict") and not isinstance(model, (str, Path)):
        return shape_from_config(model.to_dict(), getattr(model, "model_type", "custom"))
    if not isinstance(model, (str, Path)):
        raise fail("model", model, "pass a model name, a config path or a config mapping")
    key = str(model)
    if key in GPT_FAMILY:
        return gpt_shape(key)
    zoo = ZOO_DIR / f"{key}.yaml"
    if "/" not in key and zoo.is_file():
        return shape_from_config(_read_config_file(zoo), key)
    if key in LLAMA_BUILTIN:
        h, L, nh, kv, f, v, tied = LLAMA_BUILTIN[key]
        return ModelShape(key, h, L, nh, kv, f, v, tied)
    path = Path(key)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        return shape_from_config(_read_config_file(path), path.stem)
    raise ConfigError(f"model={key!r}: unknown model; choose one of {', '.join(model_choices())} "
                      "or pass a path to an HF config.json / YAML")
