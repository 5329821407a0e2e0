"""Helpers for tests and ``make gateway``: a small tokenizer built with ``tokenizers`` itself."""
from __future__ import annotations

from pathlib import Path

__all__ = ["build_tokenizer", "DEMO_WORDS"]

DEMO_WORDS = ("the quick brown fox jumps over lazy dog a an of to in is you that it he was for on are "
              "as with his they I at be this have from or one had by word but not what all were we "
              "when your can said there use each which she do how their if will up other about out "
              "many then them these so some her would make like him into time has look two more "
              "write go see number no way could people my than first water been call who oil its "
              "now find long down day did get come made may part system user assistant hello world "
              "summarise document question answer cache block tenant model").split()


def build_tokenizer(path: "str | Path", words=DEMO_WORDS) -> str:
    """Write a word-level tokenizer (whitespace pre-tokenizer, [UNK] for the rest) to ``path``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    vocab = {"[UNK]": 0}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return str(path)
