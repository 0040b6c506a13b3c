"""Generates tests/fixtures/hf/: tiny random transformers models and what transformers computes.

Needs the `parity` extra (torch CPU, transformers). For each architecture: a random model
built with transformers, every weight re-randomised (norms and biases too, so their mapping
is tested), saved as a Hugging Face directory in bfloat16 (small), reloaded in float32, then:
  expected.npz  tokens [T]; logits f32 [T, V] (dense forward);
                greedy_prompt [P], greedy_tokens [G] (transformers generate, greedy),
                greedy_logprobs [G] (log-softmax at them);
                sample_<name> f32 [T, V]: log-probs of the sampling distribution at every
                position, through transformers' own warpers in generate's order
                (temperature, then top-k, then top-p over the renormalised top-k set).
The qwen2 directory also carries a trained BPE tokenizer with a ChatML template, and
tokenizer.json expectations from transformers' AutoTokenizer.

    python scripts/make_parity_fixtures.py          # rewrites tests/fixtures/hf
    python scripts/make_parity_fixtures.py gemma    # rewrites tests/fixtures/hf/gemma only

Each architecture's seed is its position in ARCHS, so one regenerated alone (a new family
appended at the end) leaves the others' files as they are.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers as tf
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
VOCAB = 64
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=64)
ARCHS = {
    # q/k/v/o biases, decoupled head_dim, llama3 rope scaling that bites at these lengths
    "llama3": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        attention_bias=True, head_dim=12, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=16))),
    "llama_linear": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(
        num_key_value_heads=1, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=4.0))),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(
        sliding_window=24, tie_word_embeddings=False)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(tie_word_embeddings=True,
                                                         rope_theta=1000000.0)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=12,
                                                         tie_word_embeddings=False)),
    # GeGLU, norms by 1 + w, embeddings x sqrt(hidden), tied head; biases map q/k/v/o
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(
        head_dim=12, attention_bias=True, hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=True)),
}
PLUS_ONE_NORMS = ("gemma",)  # their RMSNorm scales by 1 + w
SAMPLING = {  # name: (temperature, top_k, top_p)
    "t07": (0.7, 0, 1.0),
    "k12": (1.0, 12, 1.0),
    "p085": (1.3, 0, 0.85),
    "k20_p07": (0.8, 20, 0.7),
}
SEQ_LEN, PROMPT_LEN, GREEDY_NEW = 20, 8, 12
CHAT = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["the cat sat on the mat", "a tiny test, with punctuation!", "cats and mats and hats"]
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "the cat sat"}]


def randomise(model: torch.nn.Module, gen: torch.Generator, norm_centre: float) -> None:
    """Every weight redrawn: matrices ~ N(0, 1/fan_in) * 1.5, embeddings N(0, 1), norm gains
    1 + 0.3 N(0, 1) (stored as norm_centre + 0.3 N(0, 1): 0 where the norm scales by 1 + w),
    biases 0.3 N(0, 1): wide logits, no unit norms or zero biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(norm_centre + 0.3 * z)
            elif name.endswith("bias"):
                p.copy_(0.3 * z)
            elif "embed" in name:
                p.copy_(z)
            else:
                p.copy_(z * 1.5 / p.shape[1] ** 0.5)


def behaviour_logprobs(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """[T, V] log-probs after transformers' warpers, applied as generate applies them."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.log_softmax(scores, dim=-1)


def write_tokenizer(path: pathlib.Path) -> dict:
    """A 64-token byte-level BPE with ChatML specials; returns AutoTokenizer expectations."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=sorted(set("".join(TEXTS) + "\n"
                                                              "abcdefghijklmnopqrstuvwxyz")))
    tok.train_from_iterator(TEXTS * 20 + ["system user assistant be brief"] * 20, trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                      pad_token="<|endoftext|>")
    fast.chat_template = CHAT
    fast.save_pretrained(path)
    stop = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    loaded = tf.AutoTokenizer.from_pretrained(path)
    chat_ids = loaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "input_ids"):
        chat_ids = chat_ids["input_ids"]
    return dict(texts=TEXTS, ids=[loaded.encode(t) for t in TEXTS],
                decoded=[loaded.decode(loaded.encode(t)) for t in TEXTS],
                messages=MESSAGES, chat_ids=list(chat_ids),
                chat_text=loaded.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                     tokenize=False),
                stop_token_ids=stop)


def make(name: str, seed: int) -> None:
    config_cls, model_cls, extra = ARCHS[name]
    path = OUT / name
    gen = torch.Generator().manual_seed(seed)
    model = model_cls(config_cls(**{**BASE, **extra}))
    randomise(model, gen, 0.0 if name in PLUS_ONE_NORMS else 1.0)
    model.to(torch.bfloat16).save_pretrained(path)
    model = model_cls.from_pretrained(path, dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (1, SEQ_LEN), generator=gen)
    with torch.no_grad():
        logits = model(tokens).logits[0].float()
        prompt = tokens[:, :PROMPT_LEN]
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=GREEDY_NEW, min_new_tokens=GREEDY_NEW,
                             eos_token_id=None, pad_token_id=0)
        greedy = out[0, PROMPT_LEN:]
        step_logits = model(out[:, :-1]).logits[0, PROMPT_LEN - 1:].float()
    top2 = torch.topk(step_logits, 2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, f"{name}: near-tie in greedy decoding"
    assert (step_logits.argmax(-1) == greedy).all()
    arrays = dict(tokens=tokens[0].numpy().astype(np.int32), logits=logits.numpy(),
                  greedy_prompt=prompt[0].numpy().astype(np.int32),
                  greedy_tokens=greedy.numpy().astype(np.int32),
                  greedy_logprobs=torch.log_softmax(step_logits, -1).gather(
                      -1, greedy[:, None])[:, 0].numpy())
    for key, (t, k, p) in SAMPLING.items():
        arrays[f"sample_{key}"] = behaviour_logprobs(logits, t, k, p).numpy()
    np.savez_compressed(path / "expected.npz", **arrays)
    (path / "generation_config.json").unlink(missing_ok=True)


def main() -> None:
    names = sys.argv[1:]
    if names:
        for name in names:
            shutil.rmtree(OUT / name, ignore_errors=True)
            make(name, list(ARCHS).index(name))
        print(f"wrote {', '.join(str(OUT / n) for n in names)} with transformers "
              f"{tf.__version__}, torch {torch.__version__}")
        return
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    for seed, name in enumerate(ARCHS):
        make(name, seed)
    (OUT / "sampling.json").write_text(json.dumps(SAMPLING, indent=1))
    (OUT / "qwen2" / "tokenizer_expected.json").write_text(
        json.dumps(write_tokenizer(OUT / "qwen2"), indent=1, ensure_ascii=False))
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB) with transformers {tf.__version__}, "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
