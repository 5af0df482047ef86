"""Model configuration read from a Hugging Face ``config.json`` (frozen, validated).

Supported architectures: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` (q/k/v bias) and
``Qwen3ForCausalLM`` (per-head RMSNorm on q and k, explicit ``head_dim``), and
``LlavaForConditionalGeneration`` over any of them: its ``text_config`` is the
decoder and its vision half is :attr:`ModelConfig.vision` (see
:mod:`runtime.ranks.model.vision_config`). Both the
transformers 4.x spelling (``rope_theta`` + ``rope_scaling``) and the 5.x spelling
(``rope_parameters``) of the RoPE settings are read.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from runtime.ranks.model.errors import ModelConfigError
from runtime.ranks.model.vision_config import VisionConfig, VisionConfigError, is_llava

__all__ = ["ARCHITECTURES", "ModelConfig", "RopeScaling"]


@dataclass(frozen=True)
class _ArchitectureDefaults:
    model_type: str
    attention_bias: bool | None  # None: read the config's ``attention_bias`` (default False)
    qk_norm: bool
    max_position_embeddings: int


ARCHITECTURES: dict[str, _ArchitectureDefaults] = {
    "LlamaForCausalLM": _ArchitectureDefaults("llama", None, False, 2048),
    "Qwen2ForCausalLM": _ArchitectureDefaults("qwen2", True, False, 32768),
    "Qwen3ForCausalLM": _ArchitectureDefaults("qwen3", None, True, 32768),
}
_BY_MODEL_TYPE = {d.model_type: name for name, d in ARCHITECTURES.items()}

ROPE_TYPES = ("linear", "llama3")  # besides no scaling ("default" / absent)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``linear`` divides every inverse frequency by
    ``factor``; ``llama3`` divides low frequencies, keeps high ones and interpolates
    in between (Llama 3.1)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ModelConfigError(
                f"rope_scaling.rope_type {self.rope_type!r} is not supported; "
                f"supported: none, {', '.join(ROPE_TYPES)}"
            )
        _check_positive("rope_scaling.factor", self.factor)
        if self.rope_type == "llama3":
            _check_positive("rope_scaling.low_freq_factor", self.low_freq_factor)
            _check_positive("rope_scaling.high_freq_factor", self.high_freq_factor)
            _check_positive(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
            )
            if self.high_freq_factor <= self.low_freq_factor:
                raise ModelConfigError(
                    "rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                    f"{self.high_freq_factor!r} <= {self.low_freq_factor!r}"
                )

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out.update(
                low_freq_factor=self.low_freq_factor,
                high_freq_factor=self.high_freq_factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
            )
        return out


@dataclass(frozen=True)
class ModelConfig:
    """One decoder's shape and numerics. Derived values are properties; the
    tensor-parallel split is checked by :meth:`check_tensor_parallel`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # LLaVA: the vision encoder, projector and image token; None: a text-only model.
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelConfigError(
                f"architectures: {self.architecture!r} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            _check_positive_int(name, getattr(self, name))
        _check_positive("rope_theta", self.rope_theta)
        _check_positive("rms_norm_eps", self.rms_norm_eps)
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ModelConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for token in self.eos_token_ids:
            _check_token_id("eos_token_id", token)
        if self.bos_token_id is not None:
            _check_token_id("bos_token_id", self.bos_token_id)
        if self.vision is not None and self.vision.image_token_id >= self.vocab_size:
            raise VisionConfigError(
                f"image_token_index ({self.vision.image_token_id}) is outside the text "
                f"vocabulary (text_config.vocab_size {self.vocab_size})"
            )

    @property
    def accepts_images(self) -> bool:
        """Whether the model takes images (a LLaVA directory)."""
        return self.vision is not None

    # -- derived ---------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def padded_vocab_size(self, world_size: int) -> int:
        """Vocabulary rounded up to a multiple of ``world_size`` (equal shards)."""
        return -(-self.vocab_size // world_size) * world_size

    def local_kv_heads(self, world_size: int) -> int:
        """KV heads held by one rank; ranks share (replicate) a head when there are
        fewer KV heads than ranks."""
        return max(1, self.num_key_value_heads // world_size)

    def check_tensor_parallel(self, world_size: int) -> None:
        """Raise ModelConfigError naming the field that does not split over ``world_size``."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ModelConfigError(f"tensor-parallel world size must be >= 1, got {world_size!r}")
        if self.num_attention_heads % world_size:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by the "
                f"tensor-parallel size ({world_size})"
            )
        kv = self.num_key_value_heads
        if kv >= world_size and kv % world_size:
            raise ModelConfigError(
                f"num_key_value_heads ({kv}) must be divisible by the tensor-parallel "
                f"size ({world_size})"
            )
        if kv < world_size and world_size % kv:
            raise ModelConfigError(
                f"num_key_value_heads ({kv}) is below the tensor-parallel size "
                f"({world_size}) and does not divide it, so heads cannot be replicated"
            )
        if self.intermediate_size % world_size:
            raise ModelConfigError(
                f"intermediate_size ({self.intermediate_size}) must be divisible by the "
                f"tensor-parallel size ({world_size})"
            )

    def tensor_parallel_sizes(self, limit: int = 64) -> list[int]:
        """The world sizes up to ``limit`` that :meth:`check_tensor_parallel` accepts."""
        sizes = []
        for world_size in range(1, limit + 1):
            try:
                self.check_tensor_parallel(world_size)
            except ModelConfigError:
                continue
            sizes.append(world_size)
        return sizes

    # -- Hugging Face ----------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        return cls.from_json(Path(model_dir) / "config.json")

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ModelConfigError(f"config.json not found at {path}") from None
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{path} must hold a JSON object")
        return cls.from_hf(raw)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face config dict (a LLaVA one: the decoder of
        its ``text_config`` with :attr:`vision` set)."""
        if is_llava(raw):
            return cls._from_llava(raw)
        architecture = _architecture(raw)
        defaults = ARCHITECTURES[architecture]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
        if raw.get("mlp_bias", False):
            raise ModelConfigError("mlp_bias true is not supported")
        if raw.get("use_sliding_window", False):
            raise ModelConfigError("use_sliding_window true is not supported")
        layer_types = raw.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ModelConfigError(
                f"layer_types: only 'full_attention' is supported, got {layer_types}"
            )

        heads = _required(raw, "num_attention_heads")
        hidden = _required(raw, "hidden_size")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            _check_positive_int("num_attention_heads", heads)
            if hidden % heads:
                raise ModelConfigError(
                    f"head_dim is absent and hidden_size ({hidden}) is not divisible by "
                    f"num_attention_heads ({heads})"
                )
            head_dim = hidden // heads
        rope_theta, rope_scaling = _rope(raw)
        kv_heads = raw.get("num_key_value_heads")
        attention_bias = defaults.attention_bias
        if attention_bias is None:
            attention_bias = raw.get("attention_bias", False)
        max_pos = raw.get("max_position_embeddings")
        return cls(
            architecture=architecture,
            vocab_size=_required(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size"),
            num_hidden_layers=_required(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=attention_bias,
            qk_norm=defaults.qk_norm,
            max_position_embeddings=defaults.max_position_embeddings
            if max_pos is None
            else max_pos,
            eos_token_ids=_token_ids(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
        )

    @classmethod
    def _from_llava(cls, raw: dict[str, Any]) -> ModelConfig:
        vision = VisionConfig.from_llava(raw)
        text = raw.get("text_config")
        if text is None:
            raise VisionConfigError("text_config is missing from config.json (LLaVA)")
        if not isinstance(text, dict):
            raise VisionConfigError(f"text_config must be an object, got {text!r}")
        text = {"model_type": "llama", **text}  # transformers' default text model
        if raw.get("tie_word_embeddings"):  # transformers ties if either level says so
            text["tie_word_embeddings"] = True
        try:
            return replace(cls.from_hf(text), vision=vision)
        except VisionConfigError:
            raise
        except ModelConfigError as exc:
            raise VisionConfigError(f"text_config: {exc}") from None

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that :meth:`from_hf` (and transformers) reads back
        (the decoder's only: a LLaVA config's vision half is not written)."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling.to_hf())
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if isinstance(eos, list) and len(eos) == 1:
            eos = eos[0]
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": ARCHITECTURES[self.architecture].model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
        if self.architecture != "Qwen2ForCausalLM":
            out["attention_bias"] = self.attention_bias
        return out


# -- parsing helpers -----------------------------------------------------------


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs:
        if not isinstance(archs, list) or len(archs) != 1:
            raise ModelConfigError(f"architectures must list exactly one entry, got {archs!r}")
        if archs[0] not in ARCHITECTURES:
            raise ModelConfigError(
                f"architectures: {archs[0]!r} is not supported; supported: {sorted(ARCHITECTURES)}"
            )
        return str(archs[0])
    model_type = raw.get("model_type")
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ModelConfigError(
        f"architectures is missing and model_type {model_type!r} is not one of "
        f"{sorted(_BY_MODEL_TYPE)}"
    )


def _required(raw: dict[str, Any], name: str) -> Any:
    if raw.get(name) is None:
        raise ModelConfigError(f"{name} is missing from config.json")
    return raw[name]


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from ``rope_parameters`` (5.x) or ``rope_theta``/``rope_scaling``."""
    params = raw.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = raw.get("rope_scaling")
        field = "rope_scaling"
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"{field} must be an object, got {params!r}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelConfigError(f"partial_rotary_factor {partial!r} is not supported; only 1.0")
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(
            f"rope_scaling type {rope_type!r} ({field}) is not supported; "
            f"supported: none, {', '.join(ROPE_TYPES)}"
        )
    if params.get("factor") is None:
        raise ModelConfigError(f"rope_scaling.factor is missing ({field}, type {rope_type!r})")
    if rope_type == "linear":
        return theta, RopeScaling("linear", params["factor"])
    missing = [
        k
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if params.get(k) is None
    ]
    if missing:
        raise ModelConfigError(f"rope_scaling.{missing[0]} is missing ({field}, type 'llama3')")
    return theta, RopeScaling(
        "llama3",
        params["factor"],
        params["low_freq_factor"],
        params["high_freq_factor"],
        params["original_max_position_embeddings"],
    )


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ModelConfigError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ModelConfigError(f"{name} must be finite and > 0, got {value!r}")


def _check_token_id(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelConfigError(f"{name} must be a non-negative integer, got {value!r}")
