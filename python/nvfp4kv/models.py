"""KV-cache geometry of a few well-known models, for ``nvfp4kv plan`` and ``nvfp4kv demo``.

Every number below is copied from the model's Hugging Face ``config.json``:
``num_hidden_layers`` -> ``layers``, ``num_key_value_heads`` -> ``kv_heads``, and ``head_dim``
(or ``hidden_size / num_attention_heads`` where the config has no ``head_dim``) -> ``head_size``.
Only the attention geometry is kept; the KV cache does not depend on anything else.

The planner assumes every layer keeps a full-attention cache. Models with sliding-window layers
(Gemma 2 alternates 4096-token windows with global layers) need less in engines that allocate
sliding-window layers separately, so the planner's numbers are a lower bound for them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MODEL", "MODELS", "ModelGeometry", "custom_geometry", "get_model"]


@dataclass(frozen=True)
class ModelGeometry:
    """Attention geometry of a model (what sizes its KV cache).

    Attributes
    ----------
    name : str
        Preset name (lower case, as typed on the command line).
    hf_id : str
        Hugging Face repository the numbers come from ("" for a custom geometry).
    layers : int
        Decoder layers with a KV cache (``num_hidden_layers``).
    kv_heads : int
        KV heads per layer (``num_key_value_heads``).
    head_size : int
        Head size ``D`` (``head_dim``).
    note : str
        Anything the planner's assumption (full attention in every layer) gets wrong.
    """

    name: str
    hf_id: str
    layers: int
    kv_heads: int
    head_size: int
    note: str = ""


_SLIDING = "alternates sliding-window (4096) and global layers; planner assumes all global"

# Sources: config.json of each hf_id (num_hidden_layers, num_key_value_heads, head_dim).
MODELS: dict[str, ModelGeometry] = {
    m.name: m
    for m in (
        ModelGeometry("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 8, 128),
        ModelGeometry("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 8, 128),
        ModelGeometry("qwen2.5-7b", "Qwen/Qwen2.5-7B", 28, 4, 128),
        ModelGeometry("qwen2.5-72b", "Qwen/Qwen2.5-72B", 80, 8, 128),
        ModelGeometry("qwen3-8b", "Qwen/Qwen3-8B", 36, 8, 128),
        ModelGeometry("qwen3-32b", "Qwen/Qwen3-32B", 64, 8, 128),
        ModelGeometry("mistral-7b", "mistralai/Mistral-7B-v0.3", 32, 8, 128),
        ModelGeometry("gemma-2-9b", "google/gemma-2-9b", 42, 8, 256, _SLIDING),
        ModelGeometry("gemma-2-27b", "google/gemma-2-27b", 46, 16, 128, _SLIDING),
        ModelGeometry("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 32, 8, 128),
    )
}

#: The model ``nvfp4kv demo`` uses and ``nvfp4kv plan`` defaults to.
DEFAULT_MODEL = "llama-3.1-8b"


def get_model(name: str) -> ModelGeometry:
    """Preset by name (case-insensitive).

    Raises
    ------
    KeyError
        With the list of known names, if ``name`` is not a preset.
    """
    key = name.strip().lower()
    if key not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


def custom_geometry(
    base: ModelGeometry | None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_size: int | None = None,
) -> ModelGeometry:
    """``base`` with any of its three numbers replaced (all three are needed without a base)."""
    if base is None:
        missing = [
            n
            for n, v in (("--layers", layers), ("--kv-heads", kv_heads), ("--head-size", head_size))
            if v is None
        ]
        if missing:
            raise ValueError(f"without --model, give {', '.join(missing)}")
        return ModelGeometry("custom", "", layers, kv_heads, head_size)
    geometry = (base.layers if layers is None else layers, base.kv_heads if kv_heads is None else kv_heads,
                base.head_size if head_size is None else head_size)
    if geometry == (base.layers, base.kv_heads, base.head_size):  # overrides equal to the preset's (review)
        return base
    return ModelGeometry(f"{base.name} (modified)", base.hf_id, *geometry, base.note)
