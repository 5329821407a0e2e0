"""The text of a chat request: one function for the gateway (which hashes it to route) and the
simulated engine (which computes it), so that both see the same blocks.

With a Jinja chat template (the gateway's ``chat_template``) the template renders the
messages; without one, the plain format ``<|role|>\\ncontent\\n`` per message, then
``<|assistant|>\\n``.  Either way the messages are checked first, the same way for both:

* a role must be one of OpenAI's (``CHAT_ROLES``); an unknown role is refused, never
  rendered as another one (it would hash as a prompt the engine did not compute, and
  OpenAI's API refuses it too);
* content is a string, null (an assistant turn with tool calls only: no text), or a list of
  parts of which only text parts are accepted (an image part cannot be hashed here).
"""
from __future__ import annotations

from typing import Any

from quillcache.errors import InvalidArgument

__all__ = ["render_chat", "check_messages", "CHAT_ROLES", "MAX_MESSAGES"]

MAX_MESSAGES = 4096              # chat messages in one request at most
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_text(content: Any, i: int, error: type[Exception]) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise error(f"messages[{i}].content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise error(f"messages[{i}].content must be a string or a list of text parts")


def check_messages(messages: Any, error: type[Exception] = InvalidArgument) -> list[dict]:
    """The messages as ``[{"role", "content"}]`` with text content; raises ``error`` naming the
    first one that is not a message of ``CHAT_ROLES``."""
    if not isinstance(messages, list) or not messages:
        raise error("messages must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise error(f"{len(messages)} messages: at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise error(f"messages[{i}] must be an object with a string role")
        if m["role"] not in CHAT_ROLES:
            raise error(f"messages[{i}].role {m['role'][:64]!r} is not one of {', '.join(CHAT_ROLES)}")
        out.append({"role": m["role"], "content": _message_text(m.get("content"), i, error)})
    return out


def render_chat(messages: Any, template=None, error: type[Exception] = InvalidArgument) -> str:
    """The prompt text of a chat request: ``template`` (a compiled Jinja template) if given,
    else the plain format.  Raises ``error`` for messages that ``check_messages`` refuses."""
    msgs = check_messages(messages, error)
    if template is not None:
        return template.render(messages=msgs, add_generation_prompt=True, bos_token="", eos_token="")
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + "<|assistant|>\n"
