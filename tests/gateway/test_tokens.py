import asyncio
import json

import pytest

from quillcache.errors import InvalidArgument
from quillcache.gateway.tokens import OFFLOAD_CHARS, PromptTokenizer, render_chat


def test_exact_tokenizer_from_a_local_file(tokenizer_file):
    tok = PromptTokenizer(tokenizer_file)
    assert not tok.approximate
    ids = asyncio.run(tok.encode("the quick brown fox zebra"))
    assert len(ids) == 5 and ids[-1] == 0          # zebra is not in the vocabulary: [UNK]
    assert ids[:4] == asyncio.run(tok.encode("the quick brown fox"))


def test_long_prompts_are_encoded_off_the_loop_with_the_same_result(tokenizer_file):
    tok = PromptTokenizer(tokenizer_file)
    text = "the dog " * (OFFLOAD_CHARS // 4)
    assert asyncio.run(tok.encode(text)) == tok._encode(text)


def test_approximate_mode_counts_characters():
    tok = PromptTokenizer()
    assert tok.approximate
    assert len(asyncio.run(tok.encode("héllo"))) == 5


def test_missing_or_bad_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidArgument, match="cannot load"):
        PromptTokenizer(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidArgument, match="cannot load"):
        PromptTokenizer(str(bad))


def test_chat_template_is_applied(tmp_path, tokenizer_file):
    t = tmp_path / "chat.jinja"
    t.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    tok = PromptTokenizer(tokenizer_file, str(t))
    text = tok.prompt_of({"messages": [{"role": "user", "content": "hello world"}]}, chat=True)
    assert text == "[user] hello world [assistant]"


def test_plain_chat_fallback_and_content_parts():
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
    text = render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": parts}])
    assert text == "<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n"


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"content": "x"}]}, "string role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
])
def test_bad_chat_bodies(body, message):
    with pytest.raises(InvalidArgument, match=message):
        PromptTokenizer().prompt_of(body, chat=True)


def test_prompt_forms():
    tok = PromptTokenizer()
    assert tok.prompt_of({"prompt": "abc"}, chat=False) == "abc"
    assert tok.prompt_of({"prompt": ["abc"]}, chat=False) == "abc"
    assert tok.prompt_of({"prompt": [1, 2, 3]}, chat=False) == [1, 2, 3]
    for bad in (None, 5, [1, "a"], [-1], ["a", "b"]):
        with pytest.raises(InvalidArgument):
            tok.prompt_of({"prompt": bad}, chat=False)


@pytest.mark.parametrize("role", ["narrator", "function", "User"])
def test_an_unknown_role_is_refused_by_the_gateway_and_the_engine_alike(role):
    from quillcache.control.sim.engine import SimEngineError
    from quillcache.control.sim.server import render_chat as engine_render
    messages = [{"role": role, "content": "once upon a time"}]
    with pytest.raises(InvalidArgument, match="is not one of"):
        PromptTokenizer().prompt_of({"messages": messages}, chat=True)
    with pytest.raises(SimEngineError, match="is not one of"):
        engine_render(messages)


def test_the_gateway_and_the_simulated_engine_hash_a_chat_to_the_same_blocks():
    """End to end: the gateway's blocks of a chat (predicted on its engine) are kept past the
    sweep only as far as the engine's own KV events show the same block chain; a second
    request then has every full block credited, and the engine itself reports them cached."""
    from quillcache.gateway.routing import CONFIRM_AFTER_S
    from tests._support.gateway import harness

    messages = [{"role": "system", "content": "You answer in French. " * 8},
                {"role": "user", "content": [{"type": "text", "text": "Bonjour, "},
                                             {"type": "text", "text": "ca va ?"}]},
                {"role": "assistant", "content": None},
                {"role": "tool", "content": "42 " * 30}]
    # The engine's tokens are UTF-8 bytes, the gateway's (approximate mode) code points: ASCII.
    blocks = len(render_chat(messages).encode()) // 16

    async def main():
        async with harness(n=1) as h:             # a tenant: its predictions are checked
            st, _, _ = await h.complete(messages, path="/v1/chat/completions", stream=False)
            assert st == 200
            await asyncio.sleep(CONFIRM_AFTER_S + 1.5)    # the sweep has checked the engine's events
            st, hd, body = await h.complete(messages, path="/v1/chat/completions", stream=False)
            assert st == 200
            return hd, body
    hd, body = asyncio.run(main())
    assert hd["x-quillcache-local-hits"] == str(blocks)
    assert json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"] >= (blocks - 1) * 16
