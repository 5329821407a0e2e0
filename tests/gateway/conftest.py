import pytest


@pytest.fixture(scope="session")
def tokenizer_file(tmp_path_factory):
    """A small word-level tokenizer.json, built with the tokenizers library itself."""
    from tests._support.tokenizer import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
