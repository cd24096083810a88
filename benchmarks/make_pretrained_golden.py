"""Golden files of `pisa_jax.models.load_pretrained`: tiny random Llama, Qwen2 and Qwen3 models
made and run by Hugging Face `transformers`, with their float32 logits on a fixed prompt.

  python -m benchmarks.make_pretrained_golden --out tests/data/pretrained

Needs torch and transformers (not dependencies of this project). Each model is built from its
transformers config class with every parameter drawn at random (norm scales around 1, biases
nonzero: the defaults of 1 and 0 would hide a scale or bias loaded into the wrong place), saved
with `save_pretrained` (config.json, model.safetensors), and given a small byte-level BPE
tokenizer.json trained here with `tokenizers`. Beside them, golden.npz holds the prompt `[T]` and
transformers' float32 logits `[T, V]` (eager attention), and golden.json the versions that made
them. tests/test_pretrained.py loads each folder and must reproduce the logits.

  llama   Llama 3.2-like: "llama3" RoPE scaling (original context 256: at head dim 8 its
          wavelengths 6.3 / 167 / 4443 / 118K tokens fall in the kept band (below 64), the
          interpolated one (64-256) and the divided one), tied embeddings, GQA 4 / 2
  qwen2   q, k and v biases, untied embeddings, GQA 6 / 2 (groups of 3)
  qwen3   q / k RMSNorm, head_dim 16 beside hidden 32 / 4 heads, all four projections biased
          (attention_bias), tied embeddings, one KV head
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np

VOCAB = 320
PROMPT = [5, 17, 250, 3, 99, 310, 42, 7, 128, 64, 1, 300, 77, 12, 201, 9]
TOKENIZER_TEXTS = ["The pyramid selects blocks of keys.", "In 2024, 31 queries read 4096 tokens.",
                   "def attend(q, k, v):\n    return softmax(q @ k.T) @ v\n"] * 3
COMMON = dict(vocab_size=VOCAB, intermediate_size=40, num_hidden_layers=2, rms_norm_eps=1e-6,
              max_position_embeddings=256, hidden_act="silu")
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_theta=500_000.0,
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=48, num_attention_heads=6, num_key_value_heads=2, rope_theta=1_000_000.0,
        tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        rope_theta=1_000_000.0, tie_word_embeddings=True, attention_bias=True)),
}


def tokenizer():
  """A byte-level BPE of 300 tokens (SmolLM2's pre-tokenizer: digits one by one)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(TOKENIZER_TEXTS, trainer)
  return tok


def make(name: str, out: Path, seed: int) -> dict:
  import torch
  import transformers

  config_name, model_name, fields = MODELS[name]
  # transformers 4 and 5 both take rope_theta / rope_scaling (5 keeps them as rope_parameters).
  config = getattr(transformers, config_name)(attn_implementation="eager", **COMMON, **fields)
  torch.manual_seed(seed)
  model = getattr(transformers, model_name)(config).to(torch.float32).eval()
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:
        p.copy_((1.0 if "embed_tokens" in pname else 0.2) * torch.randn_like(p))
    logits = model(torch.tensor([PROMPT])).logits[0].float().numpy()
  folder = out / name
  folder.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(folder, safe_serialization=True)
  tokenizer().save(str(folder / "tokenizer.json"))
  np.savez(folder / "golden.npz", prompt=np.asarray(PROMPT, np.int32),
           logits=logits.astype(np.float32))
  record = {"model": model_name, "seed": seed, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "attention": "eager", "logits_shape": list(logits.shape)}
  (folder / "golden.json").write_text(json.dumps(record, indent=1) + "\n")
  size = sum(p.stat().st_size for p in folder.iterdir())
  print(f"{folder}: {size / 1024:.0f} KiB, logits {logits.shape}, |logits| max "
        f"{np.abs(logits).max():.2f}")
  return record


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=Path, default=Path("tests/data/pretrained"))
  parser.add_argument("--only", default=",".join(MODELS), help="comma-separated: "
                                                                + ", ".join(MODELS))
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  names = [n for n in args.only.split(",") if n]
  unknown = sorted(set(names) - set(MODELS))
  if unknown:
    parser.error(f"--only: {unknown} unknown: expected among {sorted(MODELS)}")
  for i, name in enumerate(names):
    make(name, args.out, args.seed + i)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
