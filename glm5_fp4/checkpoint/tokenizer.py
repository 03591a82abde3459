"""A byte-level BPE tokenizer trained locally (no downloads), sized exactly to the model's vocabulary.

Every id below ``vocab_size`` decodes to something, so random-weight models can emit any id safely.
A chat template in GLM style makes /v1/chat/completions work.
"""

from __future__ import annotations

import random
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
EOS_TOKEN = "<|endoftext|>"
# Byte-level BPE starts from all 256 bytes plus the special tokens; a smaller vocab_size still gets these ids.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but all "
    "model expert token layer weight scale block memory bandwidth kernel decode prefill attention router "
    "quantize tensor matrix shared cache graph step time latency throughput server request stream batch "
    "north river stone light garden window paper music winter summer number letter question answer system "
    "user assistant hello world please thanks because however therefore example simple small large fast slow"
).split()


def _corpus(seed: int, n_lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "tu", "sha", "vel", "or", "qui", "zan", "pe", "dri", "mo", "ny", "ex"]
    lines = []
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(4, 14)):
            if rng.random() < 0.7:
                words.append(rng.choice(_WORDS))
            else:
                words.append("".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))))
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 99999)))
        line = " ".join(words)
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0):
    """Train a byte-level BPE tokenizer with exactly ``vocab_size`` ids; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    # A small corpus may run out of merges before vocab_size: fill the rest so every id decodes.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|filler_{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tokenizer_id_count(path: Path) -> int:
    """1 + the highest id a tokenizer.json assigns (base vocabulary and added tokens)."""
    import json

    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id") for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    return max(ids) + 1 if ids else 0


def save_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> int:
    """Write the tokenizer files into ``out_dir``; returns the EOS token id."""
    fast = build_tokenizer(vocab_size, seed)
    fast.save_pretrained(str(out_dir))
    return fast.convert_tokens_to_ids(EOS_TOKEN)
