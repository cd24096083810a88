"""Pretrained Llama-family checkpoints into the NNX decoder: Hugging Face folders and GGUF files.

  model, config, tokenizer = load_pretrained("SmolLM2-135M-Instruct.Q4_1.gguf", attention="pisa")

Architectures: Llama (2, 3, 3.1 / 3.2 with the "llama3" RoPE scaling), SmolLM2 (a Llama), Qwen2 /
Qwen2.5 (q, k, v biases) and Qwen3 (q / k RMSNorm). What each needs is a `ModelConfig` field
(full RoPE, its base and scaling, tied embeddings, biases, q / k norm, the exact vocabulary);
anything else (sliding windows, partial rotary factors, YaRN, MoE, MLP biases, another activation)
is refused in one line naming the field, before a tensor is read.

The loader follows the Flax ecosystem's (bonsai, tunix): the abstract model from `nnx.eval_shape`,
one rule from each of our parameters to the checkpoint tensor it comes from and how it is laid out
(`_RULES`), each tensor read alone (from its safetensors file, or a GGUF tensor dequantized by the
`gguf` package) and placed with its sharding from `pisa_jax.models.sharding` by
`jax.make_array_from_callback`: one host copy of one tensor at a time, never a copy per device.

GGUF stores the q and k projections of "llama" models permuted for llama.cpp's interleaved RoPE
(pairs (2j, 2j + 1) of a head); Hugging Face and this decoder rotate pairs (j, j + D/2). The
permutation is undone here (`_unpermute`); "qwen2" and "qwen3" GGUFs use the rotate-half layout
and are read as they are. Llama 3.1 / 3.2 GGUFs carry their "llama3" RoPE scaling as per-frequency
divisors (`rope_freqs.weight`) and no scaling metadata: the scaling whose frequencies equal them is
recovered (`rope_fields_from_freq_factors`), so that the model exports as the Hugging Face config
it came from. The tokenizer is the model's own through the `tokenizers` package: a
folder's tokenizer.json, or a GGUF's byte-level BPE vocabulary and merges with the pre-tokenizer its
`tokenizer.ggml.pre` names, or its SentencePiece pieces, scores and types (byte fallback, BOS, the
leading space) encoding as llama.cpp does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pisa_jax import _checks
from pisa_jax.models.config import (
    ATTENTION_KINDS,
    COMPUTE_DTYPES,
    PARAM_DTYPES,
    REMAT_POLICIES,
    SPARSE_ATTENTION_KINDS,
    ModelConfig,
    check_architecture,
)

# Hugging Face `model_type`s and GGUF `general.architecture`s that load.
MODEL_TYPES = ("llama", "qwen2", "qwen3")
# The fields a checkpoint fixes; `load_pretrained`'s options set any other ModelConfig field.
ARCHITECTURE_FIELDS = (
    "vocab_size", "vocab_pad_multiple", "num_layers", "d_model", "mlp_dim", "num_heads",
    "num_kv_heads", "head_dim", "norm_eps", "tie_embeddings", "qkv_bias", "out_bias", "qk_norm",
    "param_dtype",
)
# Tensors a checkpoint may hold that no parameter needs: RoPE's precomputed tables.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# config.json's record of a sparse attention (`export_config`): the decoder's attention fields,
# which transformers ignores and `load_pretrained` restores.
PISA_ATTENTION_KEY = "pisa_attention"
PISA_ATTENTION_FIELDS = ("attention", "block_size", "top_k", "branching", "beam",
                         "summary_dtype")


class UnsupportedModelError(ValueError):
  """The file is not a model this loader supports; the message names the field, in one line."""


def _first_line(error: BaseException) -> str:
  """An underlying library's error as one short line."""
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0][:200] if text else ''}"


@dataclasses.dataclass
class Pretrained:
  """A checkpoint read up to its tensors: the decoder's config, the context it was trained for,
  its tokenizer (a `tokenizers.Tokenizer`) and a reader of its tensors in Hugging Face's names and
  layouts (float32 numpy)."""

  config: ModelConfig
  context_length: int | None
  tokenizer: Any
  tensors: "_Tensors"
  # Where the config came from, for messages: "config.json" or the GGUF file's name.
  source: str
  # The tokens that end a generation (config.json's / generation_config.json's eos_token_id, a
  # GGUF's tokenizer.ggml.eos_token_id).
  eos_token_ids: tuple[int, ...] = ()


# ----------------------------------------------------------------------------- configs


def _field(where: str, name: str, value, expected: str) -> UnsupportedModelError:
  return UnsupportedModelError(f"{where}: {name}={value!r} is not supported: expected {expected}")


def rope_fields_from_hf(scaling: dict | None, *, where: str) -> dict[str, Any]:
  """ModelConfig's RoPE-scaling fields from a config.json `rope_scaling` (or `rope_parameters`)."""
  if not scaling:
    return {}
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return {}
  if kind == "linear":
    return {"rope_scaling": "linear", "rope_scaling_factor": float(scaling["factor"])}
  if kind == "llama3":
    return {"rope_scaling": "llama3", "rope_scaling_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_context": int(scaling["original_max_position_embeddings"])}
  raise _field(where, "rope_scaling.rope_type", kind, "'default', 'linear' or 'llama3'")


def config_from_hf(hf: dict, *, where: str = "config.json") -> tuple[ModelConfig, int | None]:
  """(ModelConfig, context length) of a Hugging Face config.json; UnsupportedModelError names the
  first field this decoder cannot represent."""
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise _field(where, "model_type", model_type, f"one of {MODEL_TYPES}")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise _field(where, "hidden_act", act, "'silu' (a SiLU-gated MLP)")
  if hf.get("mlp_bias", False):
    raise _field(where, "mlp_bias", hf["mlp_bias"], "false")
  if hf.get("use_sliding_window", False):
    raise _field(where, "use_sliding_window", hf["use_sliding_window"], "false")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise _field(where, "partial_rotary_factor", hf["partial_rotary_factor"], "1.0")
  windowed = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
  if windowed:
    raise _field(where, "layer_types", windowed, "'full_attention' in every layer")
  for moe in ("num_experts", "num_local_experts"):
    if hf.get(moe):
      raise _field(where, moe, hf[moe], "none (a dense MLP)")
  # transformers 5 keeps RoPE's base and scaling in one `rope_parameters` dict.
  rope = hf.get("rope_parameters") or {}
  base = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
  scaling = rope if "rope_parameters" in hf else hf.get("rope_scaling")
  heads = int(hf["num_attention_heads"])
  bias = bool(hf.get("attention_bias", False))
  cfg = ModelConfig(
      vocab_size=int(hf["vocab_size"]), vocab_pad_multiple=1,
      num_layers=int(hf["num_hidden_layers"]), d_model=int(hf["hidden_size"]),
      mlp_dim=int(hf["intermediate_size"]), num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
      rope_base=float(base), norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_fraction=1.0,
      # Qwen2 always has q, k, v biases; Llama's and Qwen3's attention_bias covers o too.
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=bias or model_type == "qwen2", out_bias=bias, qk_norm=model_type == "qwen3",
      attention="dense", param_dtype="float32",
      **rope_fields_from_hf(scaling, where=where),
  )
  _check_shapes(cfg, where)
  attention = hf.get(PISA_ATTENTION_KEY) or {}
  unknown = sorted(set(attention) - set(PISA_ATTENTION_FIELDS))
  if unknown:
    raise _field(where, f"{PISA_ATTENTION_KEY}.{unknown[0]}", attention[unknown[0]],
                 f"only the fields {PISA_ATTENTION_FIELDS}")
  cfg = dataclasses.replace(cfg, **attention)
  try:
    check_options(cfg)
  except ValueError as e:
    raise UnsupportedModelError(f"{where}: {PISA_ATTENTION_KEY}: {e}") from None
  return cfg, hf.get("max_position_embeddings")


def _check_shapes(cfg: ModelConfig, where: str) -> None:
  for name in ("vocab_size", "num_layers", "d_model", "mlp_dim", "num_heads", "num_kv_heads",
               "head_dim"):
    if getattr(cfg, name) < 1:
      raise UnsupportedModelError(f"{where}: model.{name}={getattr(cfg, name)} must be >= 1")
  if cfg.num_heads % cfg.num_kv_heads:
    raise UnsupportedModelError(f"{where}: num_attention_heads={cfg.num_heads} must be divisible "
                                f"by num_key_value_heads={cfg.num_kv_heads}")
  try:
    check_architecture(cfg)
  except ValueError as e:
    raise UnsupportedModelError(f"{where}: {e}") from None


def check_options(cfg: ModelConfig) -> None:
  """The attention and compute fields of `cfg`, each error naming the field (configs' rules)."""
  if cfg.attention not in ATTENTION_KINDS:
    raise ValueError(f"attention={cfg.attention!r} is unknown: expected one of {ATTENTION_KINDS}")
  if cfg.attention in ("nsa", "hils"):
    raise ValueError(f"attention={cfg.attention!r}: a Llama-family checkpoint holds no weights "
                     f"for NSA's gates and compression or HiLS's landmark projection; import it "
                     f"as dense or a PISA kind {tuple(SPARSE_ATTENTION_KINDS)}")
  if cfg.compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(f"compute_dtype={cfg.compute_dtype!r} must be one of {COMPUTE_DTYPES}")
  if cfg.remat not in REMAT_POLICIES:
    raise ValueError(f"remat={cfg.remat!r} must be one of {REMAT_POLICIES}")
  if cfg.attention in SPARSE_ATTENTION_KINDS:
    _checks.check_block_size(cfg.block_size)
    _checks.check_top_k(cfg.top_k)
    _checks.check_branching(cfg.branching)
    _checks.check_beam(cfg.beam, cfg.top_k, cfg.attention, selector_name="attention")
    _checks.check_implementation(cfg.attention_implementation,
                                 name="attention_implementation")
    _checks.summary_dtype_name(cfg.summary_dtype)
  elif cfg.attention_implementation is not None:
    raise ValueError(f"attention_implementation={cfg.attention_implementation!r} applies to "
                     f"sparse attention only; attention={cfg.attention!r}")
  check_architecture(cfg)


# ----------------------------------------------------------------------------- tensors


class _Tensors:
  """Tensors by Hugging Face name, each read when asked (float32 numpy, HF layout)."""

  def names(self) -> set[str]:
    raise NotImplementedError

  def get(self, name: str) -> np.ndarray:
    raise NotImplementedError

  def close(self) -> None:
    pass


class _SafetensorsFolder(_Tensors):
  """`*.safetensors` of a folder, through `model.safetensors.index.json` when there is one."""

  def __init__(self, folder: Path):
    import ml_dtypes  # noqa: F401  (numpy learns "bfloat16": bf16 checkpoints read as such)
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
      weight_map = json.loads(index.read_text())["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(p.name for p in folder.glob("*.safetensors"))
      if not files:
        raise UnsupportedModelError(f"{folder}: no *.safetensors file (and no "
                                    f"model.safetensors.index.json)")
      weight_map = None
    self._handles = {}
    self._where: dict[str, str] = {}
    for name in files:
      if not (folder / name).is_file():
        raise UnsupportedModelError(f"{index}: names {name}, which is missing")
      try:
        handle = safe_open(str(folder / name), framework="numpy")
      except Exception as e:  # a truncated or foreign file: safetensors' own error type
        raise UnsupportedModelError(f"{folder / name}: not a readable safetensors file "
                                    f"({_first_line(e)})") from None
      self._handles[name] = handle
      for key in handle.keys():
        if weight_map is None or weight_map.get(key) == name:
          self._where[key] = name

  def names(self) -> set[str]:
    return set(self._where)

  def get(self, name: str) -> np.ndarray:
    return np.asarray(self._handles[self._where[name]].get_tensor(name), np.float32)


# GGUF's tensor names -> Hugging Face's (llama.cpp's `tensor_mapping.py`, the llama family's).
_GGUF_NAMES = (
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's q / k permutation: rows (2j, 2j + 1) of a head back to (j, j + D/2).

  llama.cpp's converter (`LlamaModel.permute`) reshapes a projection's rows `[H, 2, D/2]` and
  swaps the last two axes; here `[H, D/2, 2]` swaps back. w: `[H * D, ...]` (weights or biases).
  """
  rows = w.shape[0]
  return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


class _GGUFFile(_Tensors):
  """A GGUF file's tensors under Hugging Face names, dequantized to float32, q / k of "llama"
  models un-permuted."""

  def __init__(self, reader, *, where: str, arch: str, heads: int, kv_heads: int):
    self._tensors = {}
    for tensor in reader.tensors:
      for pattern, name in _GGUF_NAMES:
        if re.fullmatch(pattern, tensor.name):
          self._tensors[re.sub(pattern, name, tensor.name)] = tensor
          break
      else:
        if tensor.name == ROPE_FREQS:  # read into the config (`rope_fields_from_freq_factors`)
          continue
        raise UnsupportedModelError(
            f"{where}: tensor {tensor.name!r} is not supported: a {arch} model has no such "
            f"tensor in this decoder")
    self._arch, self._heads, self._kv_heads = arch, heads, kv_heads
    self._file = where

  def names(self) -> set[str]:
    return set(self._tensors)

  def get(self, name: str) -> np.ndarray:
    from gguf.quants import dequantize

    tensor = self._tensors[name]
    # GGUF lists dims innermost first; numpy's order is Hugging Face's.
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    try:
      w = np.asarray(dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(shape)
    except (NotImplementedError, ValueError) as e:  # a type gguf cannot dequantize, short data
      raise UnsupportedModelError(f"{self._file}: tensor {name} of type "
                                  f"{tensor.tensor_type.name} cannot be read "
                                  f"({_first_line(e)})") from None
    if self._arch == "llama" and re.search(r"\.(q|k)_proj\.", name):
      w = _unpermute(w, self._heads if ".q_proj." in name else self._kv_heads)
    return w


def _gguf_value(reader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


# llama.cpp's per-frequency RoPE divisors: the frequency of pair j is inv_freq[j] / factors[j].
ROPE_FREQS = "rope_freqs.weight"
# How closely the decoder's frequencies must give a file's (its converter computes them in
# float32: a few float32 roundings apart).
_ROPE_FREQS_RTOL = 1e-5


def _scaled_inv_freq(base: float, head_dim: int, fields: dict[str, Any]) -> np.ndarray:
  """float64 `[D/2]`: the decoder's frequencies of a full RoPE with the scaling `fields`."""
  from pisa_jax.models.decoder import RopeSpec

  cfg = dataclasses.replace(ModelConfig(), head_dim=head_dim, rope_base=base, rope_fraction=1.0,
                            **fields)
  return RopeSpec.of(cfg).inv_freq()


def _llama3_candidates(factors: np.ndarray, wavelength: np.ndarray, factor: float):
  """(low_freq_factor, high_freq_factor, original context) that may give `factors` by the llama3
  rule (`RopeSpec.inv_freq`); each is checked by the caller.

  The rule keeps wavelengths below old / high (factor 1), divides those above old / low by
  `factor`, and between them 1 / f = (1 - s) / factor + s, s = (old / wavelength - low) /
  (high - low). Only the ratios of (low, high, old) matter. Llama 3.x uses low 1, high 4: the
  band's points then give old directly; otherwise two band points give old / (high - low) and
  low / (high - low), taken with low = 1.
  """
  tol = 1e-4
  band = (factors > 1 + tol) & (factors < factor * (1 - tol))
  s = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
  x = 1 / wavelength[band]
  if band.any():
    yield 1.0, 4.0, int(round(float(np.median((3 * s + 1) * wavelength[band]))))
  else:
    # No band point: any old between the kept and the divided wavelengths gives the same factors.
    kept, divided = wavelength[factors <= 1 + tol], wavelength[factors >= factor * (1 - tol)]
    lower = 4 * kept.max() if kept.size else 1.0
    upper = divided.min() if divided.size else 4 * lower
    yield 1.0, 4.0, int(round(math.sqrt(lower * upper)))
  if band.sum() >= 2:
    # s = a / wavelength - b with a = old / (high - low), b = low / (high - low).
    a, minus_b = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1), s, rcond=None)[0]
    if a > 0 and -minus_b > 0:
      span = 1 / -minus_b
      yield 1.0, float(f"{1 + span:.4g}"), int(round(a * span))


def rope_fields_from_freq_factors(factors: np.ndarray, *, base: float, head_dim: int,
                                  where: str) -> dict[str, Any]:
  """ModelConfig's RoPE-scaling fields from a GGUF's `rope_freqs.weight` `[D/2]`.

  llama.cpp's converter writes a Llama 3.1 / 3.2 model's "llama3" scaling as these per-frequency
  divisors and no scaling metadata. They are read back as the scaling whose frequencies the
  decoder computes equal to inv_freq / factors within float32 rounding: none (all ones), linear
  (all equal), or llama3 (`_llama3_candidates`). Anything else is refused naming the tensor.
  """
  if factors.shape != (head_dim // 2,):
    raise UnsupportedModelError(f"{where}: tensor {ROPE_FREQS} has shape {factors.shape}, "
                                f"expected ({head_dim // 2},): one factor per rotated pair")
  if not np.all(np.isfinite(factors)) or factors.min() <= 0:
    raise UnsupportedModelError(f"{where}: tensor {ROPE_FREQS} holds factors <= 0 or not finite")
  want = _scaled_inv_freq(base, head_dim, {}) / factors
  factor = float(factors.max())
  candidates = [{}] if factor <= 1 + _ROPE_FREQS_RTOL else [
      {"rope_scaling": "linear", "rope_scaling_factor": factor}]
  if factor > 1 + _ROPE_FREQS_RTOL:
    wavelength = 2 * np.pi / _scaled_inv_freq(base, head_dim, {})
    candidates += [{"rope_scaling": "llama3", "rope_scaling_factor": factor,
                    "rope_low_freq_factor": low, "rope_high_freq_factor": high,
                    "rope_original_context": old}
                   for low, high, old in _llama3_candidates(factors, wavelength, factor)
                   if old >= 1]
  worst = np.inf
  for fields in candidates:
    error = float(np.max(np.abs(_scaled_inv_freq(base, head_dim, fields) / want - 1)))
    if error <= _ROPE_FREQS_RTOL:
      return fields
    worst = min(worst, error)
  raise UnsupportedModelError(
      f"{where}: tensor {ROPE_FREQS} is not supported: its per-frequency factors are no "
      f"linear or llama3 scaling of rope.freq_base={base:g} (the closest is {worst:.2g} off)")


def config_from_gguf(reader, path: Path) -> tuple[ModelConfig, int | None]:
  """(ModelConfig, context length) from a GGUF file's metadata and tensor names."""
  where = path.name
  arch = _gguf_value(reader, "general.architecture")
  if arch not in MODEL_TYPES:
    raise _field(where, "general.architecture", arch, f"one of {MODEL_TYPES}")

  def meta(key: str, default=None):
    value = _gguf_value(reader, f"{arch}.{key}", default)
    if value is None:
      raise UnsupportedModelError(f"{where}: metadata {arch}.{key} is missing")
    return value

  names = {t.name for t in reader.tensors}
  heads = int(meta("attention.head_count"))
  d_model = int(meta("embedding_length"))
  head_dim = int(meta("attention.key_length", d_model // heads))
  rope_dims = int(meta("rope.dimension_count", head_dim))
  if rope_dims != head_dim:
    raise _field(where, f"{arch}.rope.dimension_count", rope_dims,
                 f"the head dimension {head_dim} (a full RoPE)")
  value_dim = int(meta("attention.value_length", head_dim))
  if value_dim != head_dim:
    raise _field(where, f"{arch}.attention.value_length", value_dim, f"{head_dim} (key_length)")
  scaling = _gguf_value(reader, f"{arch}.rope.scaling.type", "none")
  base = float(meta("rope.freq_base", 10_000.0))
  rope: dict[str, Any] = {}
  if scaling == "linear":
    rope = {"rope_scaling": "linear",
            "rope_scaling_factor": float(meta("rope.scaling.factor"))}
  elif scaling != "none":
    raise _field(where, f"{arch}.rope.scaling.type", scaling, "'none' or 'linear'")
  freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
  if freqs is not None:
    if rope:
      raise _field(where, f"{arch}.rope.scaling.type", scaling,
                   f"'none' beside tensor {ROPE_FREQS} (its factors are the scaling)")
    from gguf.quants import dequantize

    factors = np.asarray(dequantize(freqs.data, freqs.tensor_type), np.float64).reshape(-1)
    rope = rope_fields_from_freq_factors(factors, base=base, head_dim=head_dim, where=where)
  embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
  if embed is None:
    raise UnsupportedModelError(f"{where}: tensor token_embd.weight is missing")
  if any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", n) for n in names):
    raise _field(where, "general.architecture", f"{arch} with experts", "a dense MLP")
  cfg = ModelConfig(
      vocab_size=int(embed.shape[1]), vocab_pad_multiple=1,
      num_layers=int(meta("block_count")), d_model=d_model,
      mlp_dim=int(meta("feed_forward_length")), num_heads=heads,
      num_kv_heads=int(meta("attention.head_count_kv", heads)), head_dim=head_dim,
      rope_base=base,
      norm_eps=float(meta("attention.layer_norm_rms_epsilon")), rope_fraction=1.0,
      tie_embeddings="output.weight" not in names, qkv_bias="blk.0.attn_q.bias" in names,
      out_bias="blk.0.attn_output.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
      attention="dense", param_dtype="float32", **rope,
  )
  _check_shapes(cfg, where)
  context = _gguf_value(reader, f"{arch}.context_length")
  return cfg, None if context is None else int(context)


# ----------------------------------------------------------------------------- tokenizers

# GGUF `tokenizer.ggml.pre` -> the pre-tokenizer of the model's own tokenizer.json (llama.cpp's
# `llama-vocab.cpp` lists the same regexes). "smollm": digits one by one, then GPT-2's byte-level
# split; "llama-bpe" (Llama 3) and "qwen2": their split regex, then bytes to characters.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"
                r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZERS = ("smollm", "gpt2", "llama-bpe", "qwen2")


def _pre_tokenizer(pre: str):
  from tokenizers import Regex, pre_tokenizers

  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "gpt2":
    return byte_level
  if pre == "smollm":
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  pattern = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[pre]
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# `tokenizer.ggml.model`s that load: byte-level BPE and SentencePiece (Llama 1 / 2, Mistral, ...).
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")
# `tokenizer.ggml.token_type` (llama.cpp's llama_token_type, SentencePiece's piece types).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"  # SentencePiece's "▁": a space inside a piece


def tokenizer_from_gguf(reader, where: str):
  """A `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata: byte-level BPE ("gpt2") or
  SentencePiece ("llama"); any other `tokenizer.ggml.model` is refused naming the field."""
  kind = _gguf_value(reader, "tokenizer.ggml.model")
  if kind not in GGUF_TOKENIZER_MODELS:
    raise _field(where, "tokenizer.ggml.model", kind,
                 "'gpt2' (byte-level BPE) or 'llama' (SentencePiece)")
  if kind == "llama":
    return _sentencepiece_tokenizer(reader, where)
  return _byte_level_tokenizer(reader, where)


def _bos_processor(reader, tokens: list[str], *, add_bos_default: bool):
  """The post-processor that puts BOS first where the file asks for it (llama.cpp's default:
  SentencePiece yes, BPE no), else None."""
  from tokenizers import processors

  bos = _gguf_value(reader, "tokenizer.ggml.bos_token_id")
  if not _gguf_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default) or bos is None:
    return None
  return processors.TemplateProcessing(
      single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
      special_tokens=[(tokens[bos], int(bos))])


def _sentencepiece_tokenizer(reader, where: str):
  """llama.cpp's SentencePiece tokenizer (`llm_tokenizer_spm`) as a `tokenizers` BPE.

  SentencePiece's BPE merges, at each step, the adjacent pair whose joined piece has the highest
  score; a BPE whose merges are every split of a piece into two pieces, ranked by the joined
  piece's score, does the same (transformers' SentencePiece converter builds Llama's
  tokenizer.json so). Text: spaces become "▁", one "▁" leads each stretch of text when
  `tokenizer.ggml.add_space_prefix` (default true; llama.cpp adds it after every special token
  too); a character no piece holds becomes its UTF-8 byte tokens `<0xNN>` (byte fallback),
  else the unknown token. Decoding reverses each step and drops the leading space.
  """
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

  tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
  scores = _gguf_value(reader, "tokenizer.ggml.scores")
  if not tokens or scores is None:
    raise UnsupportedModelError(f"{where}: tokenizer.ggml.tokens / tokenizer.ggml.scores are "
                                f"missing: the file carries no SentencePiece tokenizer")
  if len(scores) != len(tokens):
    raise UnsupportedModelError(f"{where}: tokenizer.ggml.scores has {len(scores)} entries for "
                                f"{len(tokens)} tokens")
  types = _gguf_value(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
  vocab = {}
  for i, token in enumerate(tokens):
    # A repeated piece (some converted vocabularies pad with copies) keeps its first id.
    vocab.setdefault(token, i)
  mergeable = {t: i for t, i in vocab.items() if types[i] in (_NORMAL, _USER_DEFINED)}
  ranked = []
  for piece, i in mergeable.items():
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in mergeable and right in mergeable:
        # Highest score first; among one piece's splits, transformers' order (by the ids).
        ranked.append((-scores[i], i, mergeable[left], mergeable[right], left, right))
  ranked.sort()
  unknown = _gguf_value(reader, "tokenizer.ggml.unknown_token_id")
  if unknown is None:
    unknown = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
  byte_fallback = any(t == _BYTE for t in types)
  tokenizer = Tokenizer(models.BPE(
      vocab=vocab, merges=[(r[4], r[5]) for r in ranked],
      unk_token=None if unknown is None else tokens[unknown], fuse_unk=True,
      byte_fallback=byte_fallback))
  prefix = bool(_gguf_value(reader, "tokenizer.ggml.add_space_prefix", True))
  replace = normalizers.Replace(" ", _SPACE)
  tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPACE), replace]) if prefix
                          else replace)
  steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
  tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
  tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)])
  tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])
  processor = _bos_processor(reader, tokens, add_bos_default=True)
  if processor is not None:
    tokenizer.post_processor = processor
  return tokenizer


def _byte_level_tokenizer(reader, where: str):
  """A byte-level BPE ("gpt2") with the pre-tokenizer its `tokenizer.ggml.pre` names."""
  from tokenizers import AddedToken, Tokenizer, decoders, models

  pre = _gguf_value(reader, "tokenizer.ggml.pre", "gpt2")
  if pre not in GGUF_PRE_TOKENIZERS:
    raise _field(where, "tokenizer.ggml.pre", pre, f"one of {GGUF_PRE_TOKENIZERS}")
  tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
  merges = _gguf_value(reader, "tokenizer.ggml.merges")
  if not tokens or merges is None:
    raise UnsupportedModelError(f"{where}: tokenizer.ggml.tokens / tokenizer.ggml.merges are "
                                f"missing: the file carries no BPE tokenizer")
  vocab = {token: i for i, token in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise UnsupportedModelError(f"{where}: tokenizer.ggml.tokens repeats a token")
  types = _gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
  # llama.cpp skips the merges for a word the vocabulary holds whole (Llama 3's rule).
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                   ignore_merges=pre == "llama-bpe"))
  tokenizer.pre_tokenizer = _pre_tokenizer(pre)
  tokenizer.decoder = decoders.ByteLevel()
  # Control tokens (type 3) are special: "<|im_start|>" in a text is that one token.
  tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == 3])
  tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == 4])
  processor = _bos_processor(reader, tokens, add_bos_default=False)
  if processor is not None:
    tokenizer.post_processor = processor
  return tokenizer


# ----------------------------------------------------------------------------- reading


def read_pretrained(path: str | Path) -> Pretrained:
  """Reads a checkpoint's config, tokenizer and tensor index (no tensor data yet).

  path: a Hugging Face folder (config.json, *.safetensors with or without an index,
  tokenizer.json) or a .gguf file. Raises UnsupportedModelError in one line naming the field.
  """
  path = Path(path)
  if path.is_dir():
    config_file = path / "config.json"
    if not config_file.is_file():
      raise UnsupportedModelError(f"{path}: config.json is missing: a Hugging Face model folder "
                                  f"holds config.json, *.safetensors and tokenizer.json")
    try:
      hf = json.loads(config_file.read_text())
    except ValueError as e:
      raise UnsupportedModelError(f"{config_file}: not JSON ({e})") from None
    try:
      cfg, context = config_from_hf(hf)
    except KeyError as e:
      raise UnsupportedModelError(f"{config_file}: field {e.args[0]} is missing") from None
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
      raise UnsupportedModelError(f"{path}: tokenizer.json is missing: the model's own tokenizer "
                                  f"(written by transformers' save_pretrained) is needed")
    from tokenizers import Tokenizer

    generation = path / "generation_config.json"
    eos = (json.loads(generation.read_text()) if generation.is_file() else hf).get("eos_token_id")
    try:
      tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises its own Exception for a malformed file
      raise UnsupportedModelError(f"{tokenizer_file}: not a readable tokenizer.json "
                                  f"({_first_line(e)})") from None
    return Pretrained(config=cfg, context_length=context, tokenizer=tokenizer,
                      tensors=_SafetensorsFolder(path), source="config.json",
                      eos_token_ids=_ids(eos))
  if not path.is_file():
    raise FileNotFoundError(f"path: {path} does not exist: give a Hugging Face model folder or a "
                            f".gguf file")
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != b"GGUF":
    raise UnsupportedModelError(f"{path}: not a GGUF file (it starts with {magic!r}) nor a "
                                f"Hugging Face model folder")
  from gguf import GGUFReader

  try:
    reader = GGUFReader(str(path))
  except Exception as e:  # a truncated file fails inside numpy's memory map
    raise UnsupportedModelError(f"{path}: not a readable GGUF file ({_first_line(e)})") from None
  cfg, context = config_from_gguf(reader, path)
  tensors = _GGUFFile(reader, where=path.name, arch=_gguf_value(reader, "general.architecture"),
                      heads=cfg.num_heads, kv_heads=cfg.num_kv_heads)
  return Pretrained(config=cfg, context_length=context,
                    tokenizer=tokenizer_from_gguf(reader, path.name), tensors=tensors,
                    source=path.name,
                    eos_token_ids=_ids(_gguf_value(reader, "tokenizer.ggml.eos_token_id")))


def _ids(value) -> tuple[int, ...]:
  """An eos_token_id field (None, an int or a list of ints) as a tuple."""
  if value is None:
    return ()
  return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


class Layout:
  """How one kind of parameter is laid out here and in a Hugging Face checkpoint: `to_ours(w,
  cfg)` reads the checkpoint's array, `to_hf(w, cfg)` writes it back (`export_tensors`)."""

  def __init__(self, to_ours: Callable, to_hf: Callable):
    self.to_ours, self.to_hf = to_ours, to_hf


def _heads(which: str) -> Callable[[ModelConfig], int]:
  return (lambda cfg: cfg.num_heads) if which == "q" else (lambda cfg: cfg.num_kv_heads)


def _projection_in(which: str) -> Layout:
  """`[H * D, E]` (nn.Linear's [out, in]) <-> `[E, H, D]` (q, k, v projections)."""
  heads = _heads(which)
  return Layout(lambda w, cfg: w.T.reshape(cfg.d_model, heads(cfg), cfg.head_dim),
                lambda w, cfg: w.reshape(cfg.d_model, -1).T)


def _bias_in(which: str) -> Layout:
  """`[H * D]` <-> `[H, D]`."""
  heads = _heads(which)
  return Layout(lambda b, cfg: b.reshape(heads(cfg), cfg.head_dim), lambda b, cfg: b.reshape(-1))


def _padded(w, cfg):
  """`[V, E]`, zero rows appended up to the padded vocabulary; V must be the config's."""
  if w.shape[0] != cfg.vocab_size:
    raise ValueError(f"it has {w.shape[0]} rows, vocab_size={cfg.vocab_size}")
  return np.pad(w, ((0, cfg.padded_vocab_size - w.shape[0]), (0, 0)))


_SAME = Layout(lambda w, cfg: w, lambda w, cfg: w)
_TRANSPOSED = Layout(lambda w, cfg: w.T, lambda w, cfg: w.T)
# Our parameter -> (Hugging Face tensor, layout). `L` stands for the layer index.
_RULES: dict[str, tuple[str, Layout]] = {
    "embed": ("model.embed_tokens.weight",
              Layout(_padded, lambda w, cfg: w[:cfg.vocab_size])),
    "lm_head": ("lm_head.weight",
                Layout(lambda w, cfg: _padded(w, cfg).T, lambda w, cfg: w.T[:cfg.vocab_size])),
    "final_norm/scale": ("model.norm.weight", _SAME),
    "blocks/L/attn_norm/scale": ("model.layers.L.input_layernorm.weight", _SAME),
    "blocks/L/mlp_norm/scale": ("model.layers.L.post_attention_layernorm.weight", _SAME),
    "blocks/L/attn/wq": ("model.layers.L.self_attn.q_proj.weight", _projection_in("q")),
    "blocks/L/attn/wk": ("model.layers.L.self_attn.k_proj.weight", _projection_in("k")),
    "blocks/L/attn/wv": ("model.layers.L.self_attn.v_proj.weight", _projection_in("v")),
    # [E, HQ * D] <-> [HQ, D, E]
    "blocks/L/attn/wo": ("model.layers.L.self_attn.o_proj.weight", Layout(
        lambda w, cfg: w.T.reshape(cfg.num_heads, cfg.head_dim, cfg.d_model),
        lambda w, cfg: w.reshape(-1, cfg.d_model).T)),
    "blocks/L/attn/bq": ("model.layers.L.self_attn.q_proj.bias", _bias_in("q")),
    "blocks/L/attn/bk": ("model.layers.L.self_attn.k_proj.bias", _bias_in("k")),
    "blocks/L/attn/bv": ("model.layers.L.self_attn.v_proj.bias", _bias_in("v")),
    "blocks/L/attn/bo": ("model.layers.L.self_attn.o_proj.bias", _SAME),
    "blocks/L/attn/q_norm/scale": ("model.layers.L.self_attn.q_norm.weight", _SAME),
    "blocks/L/attn/k_norm/scale": ("model.layers.L.self_attn.k_norm.weight", _SAME),
    "blocks/L/mlp/w_gate": ("model.layers.L.mlp.gate_proj.weight", _TRANSPOSED),
    "blocks/L/mlp/w_up": ("model.layers.L.mlp.up_proj.weight", _TRANSPOSED),
    "blocks/L/mlp/w_down": ("model.layers.L.mlp.down_proj.weight", _TRANSPOSED),
}


def source_of(path: tuple) -> tuple[str, Layout]:
  """The checkpoint tensor and layout of our parameter at `path` (e.g. ("blocks", 3, "attn",
  "wq")); UnsupportedModelError for a parameter no Llama-family checkpoint has."""
  key = "/".join("L" if isinstance(p, int) else str(p) for p in path)
  if key not in _RULES:
    raise UnsupportedModelError(f"parameter {'/'.join(map(str, path))} has no tensor in a "
                                f"Llama-family checkpoint (it belongs to this decoder's "
                                f"attention or model options, not to the pretrained model)")
  name, layout = _RULES[key]
  layer = next((p for p in path if isinstance(p, int)), None)
  return (name if layer is None else name.replace(".L.", f".{layer}.")), layout


def _dtype_name(dtype) -> str:
  name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
  if name not in PARAM_DTYPES:
    raise ValueError(f"dtype={dtype!r} must be one of {PARAM_DTYPES}")
  return name


def load_pretrained(path: str | Path, *, attention: str | None = None, dtype="float32",
                    mesh=None, **attention_options):
  """(decoder, config, tokenizer) of a Llama-family checkpoint.

  path: a Hugging Face folder (config.json, *.safetensors with or without an index,
    tokenizer.json) or a .gguf file (quantized tensors are dequantized).
  attention: the decoder's attention ("dense", or a sparse kind: "pisa", "bsa", ...); None keeps
    the checkpoint's own (dense, or the sparse attention `export_config` recorded in config.json).
    attention_options set any other ModelConfig field the checkpoint does not fix (block_size,
    top_k, beam, attention_implementation, compute_dtype, rope_base, ...).
  dtype: the parameters' dtype, "float32" or "bfloat16".
  mesh: where the parameters go, each with its sharding from `pisa_jax.models.sharding`;
    default `make_mesh()` over the local devices.

  Returns the `Decoder`, its `ModelConfig` (vocabulary unpadded: vocab_pad_multiple=1) and the
  model's own `tokenizers.Tokenizer`. Raises UnsupportedModelError in one line naming the field
  of a checkpoint this decoder cannot represent, ValueError for a bad option.
  """
  source = read_pretrained(path)
  fixed = sorted(set(attention_options) & set(ARCHITECTURE_FIELDS))
  unknown = sorted(set(attention_options) - {f.name for f in dataclasses.fields(ModelConfig)})
  if fixed or unknown:
    name = (fixed or unknown)[0]
    raise ValueError(f"{name}={attention_options[name]!r}: " + (
        "the checkpoint fixes this field" if fixed else "is not a ModelConfig field"))
  if attention is not None:
    attention_options["attention"] = attention
  cfg = dataclasses.replace(source.config, param_dtype=_dtype_name(dtype), **attention_options)
  check_options(cfg)
  try:
    model = build_decoder(cfg, source.tensors, mesh=mesh, where=str(path))
  finally:
    source.tensors.close()
  return model, cfg, source.tokenizer


def build_decoder(cfg: ModelConfig, tensors: _Tensors, *, mesh=None, where: str = "checkpoint"):
  """The decoder of `cfg` with every parameter read from `tensors` and placed with its sharding.

  Every parameter is read, laid out and placed alone; a missing tensor, a tensor of the wrong
  shape, or a tensor no parameter takes raises UnsupportedModelError naming it.
  """
  import jax
  from flax import nnx

  from pisa_jax.models.decoder import Decoder
  from pisa_jax.models.sharding import make_mesh, param_shardings

  mesh = make_mesh() if mesh is None else mesh
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  shardings = param_shardings(params, mesh)
  available = tensors.names()
  # A tied checkpoint may still hold its output projection, the embedding again.
  used = {"lm_head.weight"} if cfg.tie_embeddings else set()
  values: dict = {}
  for path, var in nnx.to_flat_state(params):
    name, layout = source_of(path)
    if name not in available:
      raise UnsupportedModelError(f"{where}: tensor {name} is missing (for parameter "
                                  f"{'/'.join(map(str, path))})")
    used.add(name)
    shape, dtype = tuple(var.get_value().shape), var.get_value().dtype
    tensor = tensors.get(name)  # a file that cannot be read raises UnsupportedModelError here
    try:
      host = np.ascontiguousarray(layout.to_ours(tensor, cfg), dtype=dtype)
    except ValueError as e:
      raise UnsupportedModelError(f"{where}: tensor {name} does not fit parameter "
                                  f"{'/'.join(map(str, path))} {shape}: {e}") from None
    if host.shape != shape:
      raise UnsupportedModelError(f"{where}: tensor {name} gives shape {host.shape}, parameter "
                                  f"{'/'.join(map(str, path))} needs {shape}")
    sharding = shardings
    for p in path:
      sharding = sharding[p]
    values[path] = jax.make_array_from_callback(shape, sharding, lambda index, h=host: h[index])
  unused = sorted(n for n in available - used if not _IGNORED.fullmatch(n))
  if unused:
    raise UnsupportedModelError(f"{where}: tensor {unused[0]} is not supported: no parameter of "
                                f"this decoder takes it" + (f" ({len(unused)} such tensors)"
                                                            if len(unused) > 1 else ""))
  nested: dict = {}
  for path, value in values.items():
    node = nested
    for p in path[:-1]:
      node = node.setdefault(p, {})
    node[path[-1]] = value
  nnx.replace_by_pure_dict(params, nested)
  return nnx.merge(graphdef, params)


# ----------------------------------------------------------------------------- writing


def export_tensors(model) -> dict[str, np.ndarray]:
  """Every parameter of `model` as float32 numpy in Hugging Face's names and layouts (the loader's
  rules inverted: padding rows of the vocabulary dropped)."""
  import jax
  from flax import nnx

  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, layout = source_of(path)
    value = np.asarray(jax.device_get(var.get_value()), np.float32)
    out[name] = np.ascontiguousarray(layout.to_hf(value, model.cfg))
  return out


def export_config(cfg: ModelConfig, *, context_length: int,
                  eos_token_ids: tuple[int, ...] = ()) -> dict:
  """config.json of a Llama / Qwen2 / Qwen3 model equal to `cfg`; a sparse attention recorded
  under "pisa_attention". ValueError naming the field that no such model has."""
  if cfg.rope_fraction != 1.0:
    raise ValueError(f"model.rope_fraction={cfg.rope_fraction}: Llama-family models rotate every "
                     f"dim of a head (1.0); this decoder's own RoPE on part of the head has no "
                     f"Hugging Face equivalent")
  if cfg.rope_max_period:
    raise ValueError(f"model.rope_max_period={cfg.rope_max_period}: Llama-family models rotate "
                     f"every pair of a head; a HoPE cut has no Hugging Face equivalent")
  if cfg.qk_norm:
    model_type = "qwen3"
  elif cfg.qkv_bias and not cfg.out_bias:
    model_type = "qwen2"
  else:
    model_type = "llama"
  if cfg.out_bias != cfg.qkv_bias and model_type != "qwen2":
    raise ValueError(f"model.out_bias={cfg.out_bias} with model.qkv_bias={cfg.qkv_bias}: "
                     f"{model_type}'s attention_bias covers q, k, v and o together")
  scaling = None
  if cfg.rope_scaling == "linear":
    scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
  elif cfg.rope_scaling == "llama3":
    scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
               "low_freq_factor": cfg.rope_low_freq_factor,
               "high_freq_factor": cfg.rope_high_freq_factor,
               "original_max_position_embeddings": cfg.rope_original_context}
  hf = {
      "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM"}[model_type]],
      "model_type": model_type, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_base, "rope_scaling": scaling,
      "tie_word_embeddings": cfg.tie_embeddings, "max_position_embeddings": context_length,
      "torch_dtype": "float32",
  }
  if model_type != "qwen2":
    hf["attention_bias"] = cfg.out_bias
  if eos_token_ids:
    hf["eos_token_id"] = (int(eos_token_ids[0]) if len(eos_token_ids) == 1
                          else [int(t) for t in eos_token_ids])
  if cfg.attention != "dense":
    hf[PISA_ATTENTION_KEY] = {f: getattr(cfg, f) for f in PISA_ATTENTION_FIELDS}
  return hf


def save_pretrained(model, folder: str | Path, *, context_length: int, tokenizer=None,
                    eos_token_ids: tuple[int, ...] = ()) -> Path:
  """Writes `model` as a Hugging Face folder: config.json (`export_config`), model.safetensors
  (float32) and, given a `tokenizers.Tokenizer`, tokenizer.json."""
  from safetensors.numpy import save_file

  folder = Path(folder)
  hf = export_config(model.cfg, context_length=context_length, eos_token_ids=eos_token_ids)
  tensors = export_tensors(model)
  if model.cfg.tie_embeddings:
    tensors.pop("lm_head.weight", None)
  folder.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  if tokenizer is not None:
    tokenizer.save(str(folder / "tokenizer.json"))
  return folder
