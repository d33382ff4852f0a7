"""The builtin models' character-level tokenizer: one token per character, pad=0, eos=1, built offline.

>>> build_tokenizer().decode(build_tokenizer().encode("next:7="))
'next:7='
"""

from __future__ import annotations

import string

PAD, EOS = "<|pad|>", "<|eos|>"
# One token per character; small so a random model can learn the task in minutes.
CHARS = string.digits + string.ascii_lowercase + " +-*/=:?.,#\n"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (pad=0, eos=1) built offline."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=PAD, clean_up_tokenization_spaces=False
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
