"""A tiny random-init Qwen2 model with a Qwen-compatible tokenizer and chat template, built fully offline.

Tests and the demo need a real transformers checkpoint (same architecture, tokenizer class, special tokens
and chat markup as Qwen2.5) without a model hub, so this module trains a small byte-level BPE on a
synthetic corpus and saves it next to a randomly initialised ``Qwen2ForCausalLM``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from inharness.engine import TINY_CONTEXT

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Added but not special, as in Qwen: they survive decode(skip_special_tokens=True), so tool calls stay
# visible in the text.
MARKUP_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)

CHAT_TEMPLATE = (Path(__file__).with_name("chat_template.jinja")).read_text(encoding="utf-8")

VOCAB_SIZE = 3072
_CORPUS_SEED = 1234  # fixed: the tokenizer must not depend on the model seed

# A few hundred common words; the corpus below draws sentences, identifiers and inflections from them.
_WORD_TEXT = """
the of and to in is you that it he was for on are as with his they at be this have from or one had by word
but not what all were we when your can said there use an each which she do how their if will up other about
out many then them these so some her would make like him into time has look two more write go see number no
way could people my than first water been call who oil its now find long down day did get come made may part
answer question result value tool function call name arguments expression compute calculate add subtract
multiply divide sum total number numbers list string error response request user assistant system message
content model please thanks sure here let me check the weather city temperature search query file read write
open close data python json code example test output input return print true false null none yes okay done
step plan think because while where why after before again always never every small large big little new old
good bad right wrong hello world today tomorrow yesterday morning evening night week month year hour minute
second price cost money
"""
_WORDS = _WORD_TEXT.split()

_CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Oslo", "Lima", "Cairo", "Delhi"]


_SUFFIXES = ["", "", "", "s", "ed", "ing", "er", "ly"]


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS) + rng.choice(_SUFFIXES)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(3, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", "?", "!", ","])


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*/")
    result = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 3) if b else 0}[op]
    return rng.choice([f"{a}{op}{b} = {result}", f"{a} {op} {b} = {result}", f"What is {a} {op} {b}?"])


def _json_line(rng: random.Random) -> str:
    if rng.random() < 0.5:
        expr = f"{rng.randint(0, 99)}{rng.choice('+-*/')}{rng.randint(0, 99)}"
        return f'{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}'
    city = rng.choice(_CITIES)
    return (
        f'{{"type": "function", "function": {{"name": "get_weather", "description": "Weather in {city}", '
        f'"parameters": {{"type": "object", "properties": {{"city": {{"type": "string"}}}}, '
        f'"required": ["city"]}}}}}}'
    )


def _python(rng: random.Random) -> str:
    name = f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}"
    arg = rng.choice(["x", "items", "data", "value", "n", rng.choice(_WORDS)])
    return rng.choice(
        [
            f"def {name}({arg}):\n    return {arg} + {rng.randint(0, 9)}\n",
            f"for i in range({rng.randint(1, 20)}):\n    print(i, {arg})\n",
            f"if {arg} is None:\n    raise ValueError('{name}')\nelse:\n    {arg} = [{arg}]\n",
            f"import json\nresult = json.loads({arg})\n",
        ]
    )


def _chat(rng: random.Random) -> str:
    q = _arithmetic(rng)
    return (
        f"{IM_START}system\nYou are a helpful assistant.{IM_END}\n{IM_START}user\n{q}{IM_END}\n"
        f"{IM_START}assistant\n{TOOL_CALL_OPEN}\n{_json_line(rng)}\n{TOOL_CALL_CLOSE}{IM_END}\n"
        f"{IM_START}user\n{TOOL_RESPONSE_OPEN}\n{rng.randint(0, 999)}\n{TOOL_RESPONSE_CLOSE}{IM_END}\n"
        f"{IM_START}assistant\n{_sentence(rng)}{IM_END}\n"
    )


def _corpus(lines: int = 12000) -> Iterator[str]:
    rng = random.Random(_CORPUS_SEED)
    makers = [_sentence, _sentence, _arithmetic, _json_line, _python, _chat]
    for _ in range(lines):
        yield rng.choice(makers)(rng)


def build_tokenizer(context: int = TINY_CONTEXT) -> Qwen2Tokenizer:
    """Train the byte-level BPE and wrap it as the tokenizer class transformers picks for Qwen2 checkpoints.

    ``AutoTokenizer`` always rebuilds a ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer`` (NFC
    normaliser, Qwen's split regex, byte-level BPE from vocab + merges), so the merges are trained under
    exactly that pipeline; the tokenizer in memory then tokenizes like the one loaded back from disk.
    Deterministic: fixed corpus, fixed order.
    """
    proto = Qwen2Tokenizer(vocab={ENDOFTEXT: 0}, merges=[]).backend_tokenizer
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = proto.normalizer
    bpe.pre_tokenizer = proto.pre_tokenizer
    bpe.decoder = proto.decoder
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(MARKUP_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    trained = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    # Fixed ids after the learned vocabulary, in Qwen's order: <|endoftext|>, <|im_start|>, <|im_end|>,
    # then the tool markup.
    for token in (*SPECIAL_TOKENS, *MARKUP_TOKENS):
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(m) for m in trained["merges"]],
        unk_token=None,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=context,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer


def init_tiny(out_dir: str | Path, *, seed: int = 0, context: int = TINY_CONTEXT) -> Path:
    """Save a random-init tiny Qwen2 causal LM, its tokenizer and generation config to ``out_dir``.

    The tokenizer is identical for every seed; ``seed`` only drives the weights. ``context`` is the
    model's context in tokens (``max_position_embeddings``): the default fits the calc example; a real
    harness's first request is 10-20k tokens of this tokenizer (Claude Code's 48 KB system prompt and
    tools), so the harness tests ask for 65536. It changes no weight shape (rotary positions), only what
    the engine and the gateway accept. Global torch RNG state is left untouched.
    """
    if context < 16:
        raise ValueError(f"context must be at least 16 tokens, got {context}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(context)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
