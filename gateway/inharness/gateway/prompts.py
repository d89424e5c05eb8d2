"""Prompt token ids for a call: token-exact continuation of the attempt's earlier calls.

When a request's messages extend an earlier call of the same attempt (its messages plus its reply),
the prompt is that call's prompt ids + its response ids + the ids of only what came after: the
template's closing of the assistant turn and the new messages. Consecutive turns are then
prefix-exact and merge into one training sample. Where that cannot hold the prompt is the plain
tokenisation of the rendered conversation, and the call says why (`mismatch`).

The calls of an attempt form a tree: a call extends whichever earlier call its messages continue (a
sub-agent's second turn extends the sub-agent's first, not the main line's latest). A call that
extends none starts a new root; why is read from the conversation alone, in this order:

- `new_conversation`: the request holds no assistant turn (a sub-agent's first call, a side call
  such as a title, a compacted history resumed as a user message);
- `system_changed`: its user/assistant/tool turns extend an earlier reply's, but the system prompt
  or the tool list differs (a turns chain without system messages and tools matches);
- `history_rewritten`: it holds assistant turns, and its turns extend no earlier reply (a reply
  edited, history truncated or summarised in place);
- `template_not_prefix`: it does extend an earlier call, but the chat template renders that call's
  history differently once more follows, so the ids cannot be reused.

An attempt's first call is a root without a reason; so is a conversation asked again unchanged
(the same prompt as before).
"""

import asyncio
import hashlib
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import orjson

from inharness.gateway.conversation import TURNS_ROOT, Conversation
from inharness.gateway.errors import APIError
from inharness.gateway.store import ParentCall, Store

# The finish reason of a streamed call its harness hung up on after tokens had been sent: recorded with
# the tokens the harness was sent (docs/gateway.md, "A stream the harness cuts off"), and extended by the
# next turn like a `length` finish.
CLIENT_CUT = "client_cut"

# Why a call does not continue an earlier call of its attempt token-exactly (see the module docstring).
NEW_CONVERSATION = "new_conversation"  # no assistant turn: a sub-agent's or side call's first call
SYSTEM_CHANGED = "system_changed"  # the turns extend an earlier reply; the system prompt or tools differ
HISTORY_REWRITTEN = "history_rewritten"  # assistant turns that extend no earlier reply
TEMPLATE_NOT_PREFIX = "template_not_prefix"  # the chat template re-renders the history differently


# A conversation longer than this is rendered and tokenised on the builder's worker thread, not on
# the event loop: a 100k-token prompt takes a second or more of CPU that would stall every other
# request (and /healthz). Shorter ones stay on the loop, where they cost less than a thread hop.
OFF_LOOP_CHARS = 32_768
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    ids: list[int]
    request_digest: str
    parent_call_id: int | None
    prefix_reused: bool
    mismatch: str | None
    turns_digest: str  # the tip of the request's turns chain (Conversation.turns_chain)


@dataclass(slots=True)
class _Known:
    """What the builder remembers of an attempt's calls (ids only for the latest few)."""

    replies: dict[str, int]  # reply digest -> call id
    requests: dict[str, int]  # request digest -> call id
    turns: set[str]  # reply digests of the turns chains (no system messages, no tools)
    recent: deque[tuple[int, ParentCall]]


class PromptBuilder:
    def __init__(self, tokenizer: Any, store: Store, *, max_attempts_cached: int = 4096) -> None:
        self._tok = tokenizer
        self._store = store
        self._cache: OrderedDict[str, _Known] = OrderedDict()
        self._max = max_attempts_cached
        eos = tokenizer.eos_token
        self._eos_text: str = eos if isinstance(eos, str) else ""
        self._fast = fast_encoder(tokenizer)
        self._rendered = _Rendered()
        # One thread: large prompts are built one at a time, so that their memory stays bounded too.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-builder")

    async def _cpu(self, conv: Conversation, fn: Callable[[], T]) -> T:
        """`fn()`, on the worker thread when `conv` is large (OFF_LOOP_CHARS)."""
        if conv.size() < OFF_LOOP_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn)

    async def first_turn_ids(self, conv: Conversation) -> list[int]:
        """The prompt ids of `conv` asked as a first turn (no earlier call to extend)."""
        return await self._cpu(conv, lambda: self.encode(self.render(conv, generation_prompt=True)))

    def render(self, conv: Conversation, upto: int | None = None, *, generation_prompt: bool) -> str:
        """The chat template's text of `conv.messages[:upto]`. A continuation's "history before the
        reply" is its parent's whole prompt, rendered when the parent was built: the text is kept
        (`_Rendered`) under a digest of the template's exact input, so it is rendered once, not twice."""
        if not conv.messages:  # e.g. every block of an Anthropic request was one the prompt leaves out
            raise APIError(
                400, "the request holds no message the model can read", param="messages", code="empty_prompt"
            )
        messages, tools = conv.template_messages(upto), list(conv.tools) or None
        key = _Rendered.key(messages, tools, generation_prompt)
        text = self._rendered.get(key)
        if text is None:
            text = self._tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
            self._rendered.put(key, text)
        return text

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._tok.encode(text, add_special_tokens=False)

    async def build(self, attempt_id: str, conv: Conversation, chain: list[str]) -> BuiltPrompt:
        known = await self._known(attempt_id)
        request_digest = chain[-1]
        turns = conv.turns_chain()
        turns_tip = turns[-1][1] if turns else TURNS_ROOT
        n = len(conv.messages)
        full = await self._cpu(conv, partial(self.render, conv, generation_prompt=True))

        # Longest earlier conversation that this one extends by at least one new message.
        for j in range(n - 1, 0, -1):
            if conv.messages[j - 1].role != "assistant" or chain[j] not in known.replies:
                continue
            parent = await self._parent(attempt_id, known, known.replies[chain[j]], chain[j])
            if parent is None:
                break
            delta = await self._cpu(conv, partial(self._delta_text, conv, j, full, parent))
            if delta is None:
                ids = await self._cpu(conv, partial(self.encode, full))
                return BuiltPrompt(ids, request_digest, parent.id, False, TEMPLATE_NOT_PREFIX, turns_tip)
            ids = parent.prompt_ids + parent.response_ids + await self._cpu(conv, partial(self.encode, delta))
            return BuiltPrompt(ids, request_digest, parent.id, True, None, turns_tip)

        if request_digest in known.requests:  # the same conversation asked again: the same prompt
            same = await self._store.find_call_by_request(attempt_id, request_digest)
            if same is not None:
                return BuiltPrompt(same, request_digest, None, False, None, turns_tip)
        reason = root_reason(conv, turns, known.turns) if known.replies else None
        ids = await self._cpu(conv, partial(self.encode, full))
        return BuiltPrompt(ids, request_digest, None, False, reason, turns_tip)

    def remember(
        self,
        attempt_id: str,
        call_id: int,
        request_digest: str,
        reply_digest: str,
        turns_digest: str,
        parent: ParentCall,
    ) -> None:
        known = self._cache.get(attempt_id)
        if known is None:
            return
        known.replies[reply_digest] = call_id
        known.requests.setdefault(request_digest, call_id)
        known.turns.add(turns_digest)
        known.recent.append((call_id, parent))

    def forget(self, attempt_id: str) -> None:
        self._cache.pop(attempt_id, None)

    def _delta_text(self, conv: Conversation, j: int, full: str, parent: ParentCall) -> str | None:
        """Text after the parent's response: the rest of its assistant turn, then the new messages."""
        history = self.render(conv, j, generation_prompt=False)
        before_reply = self.render(conv, j - 1, generation_prompt=True)
        if not full.startswith(history) or not history.startswith(before_reply):
            return None
        turn = history[len(before_reply) :]  # how the template renders the assistant turn
        cut_short = parent.finish_reason in ("length", CLIENT_CUT)  # no stop token ends the reply
        last = [] if cut_short else parent.response_ids[-1:]
        stop_text = self._tok.decode(last, skip_special_tokens=False) if last else ""
        if stop_text and stop_text in turn:
            closing = turn[turn.rfind(stop_text) + len(stop_text) :]
        elif self._eos_text and self._eos_text in turn:  # cut short: close the turn as the template does
            closing = turn[turn.rfind(self._eos_text) :]
        else:
            closing = ""
        return closing + full[len(history) :]

    async def _known(self, attempt_id: str) -> _Known:
        known = self._cache.get(attempt_id)
        if known is not None:
            self._cache.move_to_end(attempt_id)
            return known
        replies, requests, turns = await self._store.call_digests(attempt_id)
        known = _Known(replies=replies, requests=requests, turns=turns, recent=deque(maxlen=4))
        self._cache[attempt_id] = known
        while len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return known

    async def _parent(self, attempt_id: str, known: _Known, call_id: int, digest: str) -> ParentCall | None:
        for cid, parent in known.recent:
            if cid == call_id:
                return parent
        found = await self._store.find_call_by_reply(attempt_id, [digest])
        return None if found is None else found[0]


class _Rendered:
    """Rendered prompts by a digest of the template's input (messages, tools, generation prompt), the
    most recent first out of `max_chars` characters in all. Locked: large prompts render on the
    builder's thread while others render on the event loop."""

    def __init__(self, max_chars: int = 16 * 1024 * 1024) -> None:
        self._texts: OrderedDict[bytes, str] = OrderedDict()
        self._chars = 0
        self._max = max_chars
        self._lock = threading.Lock()

    @staticmethod
    def key(
        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool
    ) -> bytes | None:
        """None where the input is not JSON orjson writes (then it is rendered every time)."""
        try:
            return hashlib.blake2b(orjson.dumps([messages, tools, generation]), digest_size=16).digest()
        except orjson.JSONEncodeError:
            return None

    def get(self, key: bytes | None) -> str | None:
        if key is None:
            return None
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
            return text

    def put(self, key: bytes | None, text: str) -> None:
        if key is None or len(text) > self._max:
            return
        with self._lock:
            if key in self._texts:
                return
            self._texts[key] = text
            self._chars += len(text)
            while self._chars > self._max:
                _, old = self._texts.popitem(last=False)
                self._chars -= len(old)


def root_reason(conv: Conversation, turns: list[tuple[int, str]], known_turns: set[str]) -> str:
    """Why a call that extends no earlier call of its attempt starts a new root (module docstring).
    `turns` is `conv.turns_chain()`, `known_turns` the turns digests of the attempt's replies."""
    after_assistant = [d for k, d in turns if conv.messages[k - 1].role == "assistant"]
    if not after_assistant:
        return NEW_CONVERSATION
    if any(d in known_turns for d in after_assistant):
        return SYSTEM_CHANGED
    return HISTORY_REWRITTEN


def fast_encoder(tokenizer: Any) -> Any:
    """The Rust `tokenizers.Tokenizer` behind a fast HF tokenizer, when it encodes exactly as the
    wrapper does (checked on a probe with chat markup); it skips a large per-call Python overhead."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "encode"):
        return None
    probe = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there: 2+3 = ? ünï ✓"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    same = backend.encode(probe, add_special_tokens=False).ids == tokenizer.encode(
        probe, add_special_tokens=False
    )
    return backend if same else None
