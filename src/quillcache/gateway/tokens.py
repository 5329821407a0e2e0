"""Prompts to token ids: HF ``tokenizers`` from a local tokenizer.json, chat templates, and the
approximate mode.

Never a hub download: a tokenizer is a file named in the config.  Without one the gateway
runs in approximate mode: a prompt's "tokens" are its characters (code points), so its
length is its length in characters and its blocks are runs of ``block_size`` characters.
Those blocks are consistent for predict-on-route, but never match an engine's KV events
(which carry real token ids); the decision headers say ``x-quillcache-tokenizer: approximate``.
"""
from __future__ import annotations

import asyncio
from typing import Sequence

from quillcache.control.chat import MAX_MESSAGES, render_chat
from quillcache.errors import InvalidArgument

__all__ = ["PromptTokenizer", "TokenizerCache", "render_chat", "MAX_MESSAGES", "OFFLOAD_CHARS"]

OFFLOAD_CHARS = 16_384           # characters above which encoding runs off the event loop


class PromptTokenizer:
    """One engine's tokenizer (shared by engines naming the same files)."""

    def __init__(self, path: str = "", chat_template: str = "") -> None:
        self.path = path
        self._tok = None
        self._template = None
        if path:
            try:
                from tokenizers import Tokenizer
            except ImportError as exc:      # a dependency of the package: only a broken install
                raise InvalidArgument(f"tokenizer {path}: the tokenizers package is missing") from exc
            try:
                self._tok = Tokenizer.from_file(path)
            except Exception as exc:        # tokenizers raises plain Exception for a bad file
                raise InvalidArgument(f"tokenizer {path}: cannot load: {exc}") from None
        if chat_template:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
                with open(chat_template, encoding="utf-8") as f:
                    source = f.read()
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                self._template = env.from_string(source)
            except OSError as exc:
                raise InvalidArgument(f"chat_template {chat_template}: cannot read: {exc.strerror}") from None
            except Exception as exc:        # jinja2.TemplateSyntaxError and friends
                raise InvalidArgument(f"chat_template {chat_template}: {exc}") from None

    @property
    def approximate(self) -> bool:
        return self._tok is None

    def prompt_of(self, body: dict, chat: bool) -> "str | list[int]":
        """The prompt of a request body: text, or token ids given by the client."""
        if chat:
            return render_chat(body.get("messages"), self._template)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       and 0 <= t < 1 << 31 for t in prompt):
            return prompt
        raise InvalidArgument("prompt must be a string, a list of one string, or a list of token ids")

    def _encode(self, text: str) -> list[int]:
        if self._tok is None:
            return [ord(c) for c in text]
        return self._tok.encode(text, add_special_tokens=False).ids

    async def encode(self, prompt: "str | Sequence[int]") -> list[int]:
        """Token ids of the prompt (characters in approximate mode); long texts off the loop."""
        if not isinstance(prompt, str):
            return list(prompt)
        if len(prompt) < OFFLOAD_CHARS:
            return self._encode(prompt)
        return await asyncio.get_running_loop().run_in_executor(None, self._encode, prompt)


class TokenizerCache:
    """One PromptTokenizer per distinct (tokenizer, chat_template) of the engines, loaded
    when the first engine naming them arrives (from the config or from etcd)."""

    def __init__(self) -> None:
        self._by_files: dict[tuple[str, str], PromptTokenizer] = {}

    def get(self, spec) -> PromptTokenizer:
        """The engine's tokenizer; raises InvalidArgument when its files do not load."""
        key = (spec.tokenizer, spec.chat_template)
        tok = self._by_files.get(key)
        if tok is None:
            tok = self._by_files[key] = PromptTokenizer(*key)
        return tok
