"""The Kimi K3 tokenizer, built from ``tiktoken.model`` without remote code or tiktoken.

The checkpoint ships a tiktoken rank file (one ``base64(token_bytes) rank`` per line) and a
``tokenizer_config.json`` naming the 256 special tokens that follow the ranks. This module
turns them into a Hugging Face ``tokenizers`` byte-level BPE that encodes exactly as tiktoken
does, wraps it for ``transformers`` and mlx-lm, and caches the built ``tokenizer.json`` in a
user cache directory keyed by the files' hash.

tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank. A
``tokenizers`` BPE merges listed pairs in list order. The two agree when the list holds, for
each multi-byte token in rank order, the pair that rank-ordered BPE over that token's own
bytes (using only lower ranks) leaves at the end, and when a word that is itself a token is
emitted whole (``ignore_merges``), as tiktoken does.

``write_synthetic_tokenizer`` writes a small rank file of the same format, learned from a
built-in multilingual text, for tests and synthetic checkpoints.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import hashlib
import heapq
import json
import os
import random
import tempfile
from collections import Counter
from itertools import pairwise
from pathlib import Path

import mlx.core as mx
import numpy as np
import tokenizers
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kimi_k3 import cache_dir
from kimi_k3.checkpoint.files import (
    MAX_CONFIG_BYTES,
    MAX_RANK_FILE_BYTES,
    CheckpointError,
    load_json_object,
    read_capped,
)
from kimi_k3.text.chat import encode_chat, parse_tool_calls, render_text

RANK_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
# The same tokenizer as a ``tokenizers`` file, for Hugging Face loaders (``transformers``,
# ``mlx_lm.load``) that would otherwise guess the pre-tokenizer: written beside the rank file.
HF_FILE = "tokenizer.json"
NUM_SPECIAL_TOKENS = 256

KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Offsets of the named K3 specials from the first special id (the number of ranks).
SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|end_of_msg|>": 2,
    "<|open|>": 3,
    "<|close|>": 4,
    "<|sep|>": 5,
    "[EOT]": 9,
    "[UNK]": 254,
    "[PAD]": 255,
}
BOS_TOKEN = "[BOS]"
EOS_TOKEN = "<|end_of_msg|>"
EXTRA_STOP_TOKENS = ("[EOS]",)
PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"

# Synthetic rank files learn at most this many ranks by BPE; more are filled cheaply.
LEARNED_RANKS = 8192

# Bump when the built tokenizer.json would change for the same input files.
_CACHE_FORMAT = 1


def byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in character for each byte value, indexed by byte.

    Printable Latin-1 bytes stand for themselves; the other 68 take the code points from 256
    upwards, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    for b in printable:
        table[b] = chr(b)
    others = [b for b in range(256) if not table[b]]
    for n, b in enumerate(others):
        table[b] = chr(256 + n)
    return table


def _to_unicode(token: bytes, table: list[str]) -> str:
    return "".join(table[b] for b in token)


def reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def special_token_ids(n_ranks: int) -> dict[str, int]:
    """Ids of the named K3 specials for a rank file of ``n_ranks`` ranks."""
    return {name: n_ranks + off for name, off in SPECIAL_OFFSETS.items()}


def read_rank_file(path: str | Path) -> bytes:
    """The bytes of a tiktoken rank file: a regular file of at most ``MAX_RANK_FILE_BYTES``
    (``kimi_k3.checkpoint.files.read_capped``), else ``CheckpointError`` naming it."""
    try:
        return read_capped(path, MAX_RANK_FILE_BYTES)
    except FileNotFoundError:
        raise FileNotFoundError(f"tokenizer rank file not found: {path}") from None


def read_ranks(path: str | Path, data: bytes | None = None) -> list[bytes]:
    """Token bytes by rank from a tiktoken rank file (its bytes ``data`` when given, else
    ``read_rank_file(path)``); ranks must be exactly 0..n-1."""
    path = Path(path)
    if data is None:
        data = read_rank_file(path)
    by_rank: dict[int, bytes] = {}
    seen: dict[bytes, int] = {}
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        token, rank = _parse_rank_line(line, path, lineno)
        if rank in by_rank:
            raise CheckpointError(f"{path}:{lineno}: duplicate rank {rank}")
        if token in seen:
            raise CheckpointError(
                f"{path}:{lineno}: duplicate token {token!r} (also rank {seen[token]})"
            )
        by_rank[rank] = token
        seen[token] = rank
    _check_ranks(by_rank, path)
    return [by_rank[r] for r in range(len(by_rank))]


def _parse_rank_line(line: bytes, path: Path, lineno: int) -> tuple[bytes, int]:
    fields = line.split()
    if len(fields) != 2:
        raise CheckpointError(f"{path}:{lineno}: expected 'base64 rank', got {line[:80]!r}")
    try:
        token = base64.b64decode(fields[0], validate=True)
    except (binascii.Error, ValueError) as e:
        raise CheckpointError(f"{path}:{lineno}: bad base64 {fields[0][:80]!r}: {e}") from None
    if not fields[1].isdigit():
        raise CheckpointError(f"{path}:{lineno}: bad rank {fields[1][:80]!r}")
    if not token:
        raise CheckpointError(f"{path}:{lineno}: empty token")
    return token, int(fields[1])


def _check_ranks(by_rank: dict[int, bytes], path: Path) -> None:
    if not by_rank:
        raise CheckpointError(f"{path}: no ranks")
    n = len(by_rank)
    if max(by_rank) != n - 1:
        missing = next(r for r in range(n) if r not in by_rank)
        raise CheckpointError(
            f"{path}: ranks must be 0..{n - 1} without gaps; {missing} is missing"
        )
    singles = {t for t in by_rank.values() if len(t) == 1}
    if len(singles) != 256:
        absent = [b for b in range(256) if bytes([b]) not in singles]
        raise CheckpointError(f"{path}: single-byte tokens missing for bytes {absent[:16]}")


def read_special_tokens(path: str | Path, n_ranks: int) -> list[str]:
    """The 256 special token names, by id - n_ranks, from ``tokenizer_config.json``.

    Ids absent from ``added_tokens_decoder`` are ``<|reserved_token_ID|>``. Without the
    file, the named K3 specials take their usual offsets.
    """
    path = Path(path)
    names = [reserved_name(n_ranks + i) for i in range(NUM_SPECIAL_TOKENS)]
    try:
        raw = read_capped(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        for name, off in SPECIAL_OFFSETS.items():
            names[off] = name
        return names
    doc = load_json_object(raw, path)
    decoder = doc.get("added_tokens_decoder", {})
    if not isinstance(decoder, dict):
        raise CheckpointError(f"{path}: added_tokens_decoder must be an object")
    for key, entry in decoder.items():
        if not key.isdigit() or not isinstance(entry, dict) or "content" not in entry:
            raise CheckpointError(f"{path}: bad added_tokens_decoder entry {key!r}: {entry!r}")
        token_id = int(key)
        if not n_ranks <= token_id < n_ranks + NUM_SPECIAL_TOKENS:
            raise CheckpointError(
                f"{path}: added token id {token_id} is outside the special range "
                f"{n_ranks}..{n_ranks + NUM_SPECIAL_TOKENS - 1}"
            )
        names[token_id - n_ranks] = entry["content"]
    if len(set(names)) != len(names):
        raise CheckpointError(f"{path}: special token names are not unique")
    return names


def _last_merge(token: bytes, rank_of: dict[bytes, int], limit: int) -> tuple[bytes, bytes] | None:
    """The pair rank-ordered BPE over ``token``'s bytes, using ranks below ``limit``, ends on."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = rank_of.get(parts[i] + parts[i + 1], limit)
            if r < best:
                best, at = r, i
        if at < 0:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def recover_merges(ranks: list[bytes]) -> list[tuple[bytes, bytes]]:
    """BPE merges, in priority order, that reproduce tiktoken's encoding of ``ranks``.

    A token that BPE cannot reach from lower ranks gets no merge; it is still produced
    when a whole pre-tokenized word equals it.
    """
    rank_of = {token: r for r, token in enumerate(ranks)}
    merges = []
    for r, token in enumerate(ranks):
        if len(token) >= 2 and (pair := _last_merge(token, rank_of, r)) is not None:
            merges.append(pair)
    return merges


def build_backend(ranks: list[bytes], specials: list[str]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equal to tiktoken over ``ranks`` plus ``specials``."""
    table = byte_to_unicode()
    vocab = {_to_unicode(t, table): r for r, t in enumerate(ranks)}
    merges = [(_to_unicode(a, table), _to_unicode(b, table)) for a, b in recover_merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for i, name in enumerate(specials):
        if tok.token_to_id(name) != len(ranks) + i:
            raise ValueError(f"special token {name!r} collides with a BPE token")
    return tok


def _cache_key(rank_bytes: bytes, specials: list[str]) -> str:
    h = hashlib.sha256(rank_bytes)
    h.update(json.dumps([_CACHE_FORMAT, tokenizers.__version__, specials]).encode())
    return h.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_backend(path: str | Path, cache: bool = True) -> tuple[Tokenizer, list[bytes], list[str]]:
    """The ``tokenizers.Tokenizer`` for a checkpoint dir, its ranks and special names.

    With ``cache``, the built ``tokenizer.json`` is kept under ``cache_dir()`` keyed by the
    hash of the rank file and the special names; the checkpoint dir is never written.
    """
    path = Path(path)
    rank_bytes = read_rank_file(path / RANK_FILE)
    ranks = read_ranks(path / RANK_FILE, rank_bytes)
    specials = read_special_tokens(path / CONFIG_FILE, len(ranks))
    if not cache:
        return build_backend(ranks, specials), ranks, specials
    cached = cache_dir() / f"tokenizer-{_cache_key(rank_bytes, specials)}.json"
    if cached.is_file():
        try:
            return Tokenizer.from_file(str(cached)), ranks, specials
        except Exception:  # tokenizers raises a bare Exception for a bad file: rebuild it
            pass
    backend = build_backend(ranks, specials)
    try:
        _write_atomic(cached, backend.to_str())
    except OSError:
        pass  # A read-only cache only costs the rebuild next time.
    return backend, ranks, specials


class ByteStreamingDetokenizer(StreamingDetokenizer):
    """Streams token bytes through an incremental UTF-8 decoder.

    A character split over tokens is held back until its last byte arrives, so ``text`` is
    always a prefix of ``decode(tokens)`` and equals it after ``finalize``; like ``decode``,
    ids past the vocabulary add nothing. Unlike mlx-lm's ``BPEStreamingDetokenizer`` it never
    drops a leading space and decodes byte 0.
    """

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        self.reset()

    def reset(self):
        self.offset = 0
        self.text = ""
        self.tokens = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add_token(self, token):
        self.tokens.append(token)
        if token < len(self.token_bytes):
            self.text += self._decoder.decode(self.token_bytes[token])

    def finalize(self):
        self.text += self._decoder.decode(b"", final=True)


class KimiTokenizerWrapper(TokenizerWrapper):
    """mlx-lm's wrapper whose tokenized chat template keeps message text plain.

    ``apply_chat_template(..., tokenize=True)`` encodes through ``chat.encode_chat``, so a
    ``<|open|>`` typed by a user stays text; ``tokenize=False`` returns the display string.
    Defaults follow Hugging Face's (no generation prompt unless asked); ``enable_thinking``
    and ``thinking`` are synonyms, on by default.
    """

    def apply_chat_template(
        self,
        messages,
        tools=None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        enable_thinking: bool | None = None,
        thinking: bool | None = None,
        **_template_kwargs,
    ):
        if thinking is None:
            thinking = True if enable_thinking is None else enable_thinking
        kwargs = dict(
            tools=tools,
            thinking=thinking,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
        )
        if tokenize:
            return encode_chat(self, messages, **kwargs)
        return render_text(messages, **kwargs)


def _tool_parser(text: str, tools=None) -> list[dict]:
    """mlx-lm's tool-parser contract: the calls in a tools section, ValueError if none."""
    calls = parse_tool_calls(text)
    if not calls:
        raise ValueError("no complete Kimi K3 tool call")
    return calls


def wrap_backend(backend: Tokenizer, ranks: list[bytes], specials: list[str]) -> TokenizerWrapper:
    """Wrap a built backend for ``transformers`` and mlx-lm generation."""
    for name in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN, *EXTRA_STOP_TOKENS):
        if name not in specials:
            raise ValueError(f"special token {name!r} missing from the tokenizer config")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    token_bytes = ranks + [s.encode("utf-8") for s in specials]
    return KimiTokenizerWrapper(
        hf,
        detokenizer_class=lambda _: ByteStreamingDetokenizer(token_bytes),
        eos_token_ids=[len(ranks) + specials.index(s) for s in EXTRA_STOP_TOKENS],
        chat_template=render_text,
        tool_parser=_tool_parser,
        tool_call_start="<|open|>tools<|sep|>",
        tool_call_end="<|close|>tools<|sep|>",
    )


def load_tokenizer(path: str | Path, cache: bool = True) -> TokenizerWrapper:
    """Load the tokenizer of a checkpoint dir holding ``tiktoken.model``.

    Returns a ``TokenizerWrapper`` (mlx-lm) around a ``PreTrainedTokenizerFast``: eos is
    ``<|end_of_msg|>`` with ``[EOS]`` as an extra stop id, bos ``[BOS]``, pad ``[PAD]``,
    unk ``[UNK]``. ``encode`` adds no BOS.
    """
    return wrap_backend(*load_backend(path, cache=cache))


def never_sampled_ids(tokenizer) -> list[int]:
    """Special ids no reply may contain: the reserved slots, ``[BOS]``, ``[PAD]`` and
    ``[UNK]``. Stop tokens and the chat markers stay."""
    banned = (BOS_TOKEN, PAD_TOKEN, UNK_TOKEN)
    return sorted(
        i
        for i, t in tokenizer.added_tokens_decoder.items()
        if t.content in banned or t.content.startswith("<|reserved_token_")
    )


def never_sample(tokenizer):
    """An mlx-lm logits processor that gives ``never_sampled_ids`` no probability."""
    ids = np.array(never_sampled_ids(tokenizer), dtype=np.int64)
    banned: dict[int, mx.array] = {}  # by vocabulary size: True where banned

    def mask(tokens: mx.array, logits: mx.array) -> mx.array:
        n = logits.shape[-1]
        if n not in banned:
            row = np.zeros(n, bool)
            row[ids[ids < n]] = True
            banned[n] = mx.array(row)
        return mx.where(banned[n], -mx.inf, logits)

    return mask


def stop_ids(tokenizer) -> list[int]:
    """The ids that end a reply (the server stops on them, and a grammar ends with one):
    ``<|end_of_msg|>`` and ``[EOS]`` for a K3 tokenizer."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or [])
    ids.add(tokenizer.eos_token_id)
    return sorted(ids)


_CORPUS = """\
The quick brown fox jumps over the lazy dog. It's a sentence that we've used, and you'll see
it again; they're testing whether the tokenizer can't handle contractions like I'm or she'd.
Numbers: 0 1 12 123 1234 12345 3.14159 2026-11-30 +44 20 7946 0958, 1,000,000 and 99%.
MIXED Case WORDS like McDonald, iPhone, HTTPServer, camelCaseName and snake_case_name.
Whitespace:    four spaces,\ttab,\t\ttwo tabs,\r\nwindows line end,\n\n\nthree newlines.
        indented eight
                sixteen spaces of indentation

人工智能正在改变我们的生活方式。今天天气很好，我们去公园散步吧！
机器学习模型需要大量的数据来训练，分词器把文本切成小块。
中文和English混合的句子也很常见，比如：我喜欢用Python写代码。
北京、上海、广州和深圳都是中国的大城市，人口超过一千万。
日本語のテキストも少し入れておきます。こんにちは、世界！ 한국어 문장도 있습니다.
Ein kurzer deutscher Satz über Größe und Straße. Une phrase française: où est l'hôtel?
Русский текст: привет, как дела? Ελληνικά: καλημέρα κόσμε. مرحبا بالعالم

Emoji: 😀 😃 😄 🚀🔥✨ 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🎉🎉🎉 ☕️ 🤖💬

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = [0, 1]
    for i in range(2, n):
        result.append(result[i - 1] + result[i - 2])
    return result[:n]

class TokenCounter:
    def __init__(self, vocab_size=4096):
        self.counts = {}  # token -> count
        self.vocab_size = vocab_size

    def update(self, tokens):
        for t in tokens:
            self.counts[t] = self.counts.get(t, 0) + 1

if __name__ == "__main__":
    print(f"{fibonacci(10)!r} and {'key': [1, 2, 3]}")

for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // C loop
const total = items.reduce((acc, x) => acc + x.price, 0); /* JS */
SELECT name, COUNT(*) AS n FROM users WHERE age >= 18 GROUP BY name;
<div class="note">Hello &amp; welcome</div> {"json": true, "list": [1, 2.5, null]}
"""

_SYLLABLES = (
    "ka to ri en an er in on th he re at st nd ou ing tion ment able ly ed es al "
    "pre con com pro dis un ver sch str ight ough ch sh qu ph wh ee oo ai"
).split()


def _synthetic_corpus(n_words: int, seed: int) -> str:
    """The built-in text plus ``n_words`` seeded pseudo-words, numbers, code and Han runs."""
    rng = random.Random(seed)
    han = [c for c in _CORPUS if "\u4e00" <= c <= "\u9fff"]
    emoji = ["😀", "🚀", "🔥", "✨", "👍", "🎉", "🤖", "❤️", "🌍", "📈"]
    out = [_CORPUS]
    for _ in range(n_words):
        kind = rng.random()
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        if kind < 0.55:
            out.append(" " + (word.capitalize() if rng.random() < 0.2 else word))
        elif kind < 0.7:
            out.append("".join(rng.choice(han) for _ in range(rng.randint(2, 6))))
        elif kind < 0.8:
            out.append(" " + str(rng.randint(0, 10 ** rng.randint(1, 6))))
        elif kind < 0.88:
            out.append(f" {word}_{rng.choice(_SYLLABLES)}({rng.randint(0, 9)});")
        elif kind < 0.94:
            out.append(rng.choice(["\n", "\n\n", "\n    ", "\n        ", "\t", "  "]))
        else:
            out.append(" " + "".join(rng.choice(emoji) for _ in range(rng.randint(1, 3))))
    return "".join(out)


def _train_ranks(words: Counter[bytes], n_ranks: int) -> list[bytes]:
    """Byte-level BPE training: the 256 bytes, then the most frequent pair, repeatedly.

    Ties go to the pair whose bytes sort first, so the result is deterministic. A merge
    whose bytes are already a token adds no rank.
    """
    tokens = [bytes([b]) for b in range(256)]
    index = {t: i for i, t in enumerate(tokens)}
    seqs = [list(w) for w in words]
    freq = list(words.values())
    pair_count: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for wi, seq in enumerate(seqs):
        for pair in pairwise(seq):
            pair_count[pair] += freq[wi]
            where.setdefault(pair, set()).add(wi)
    heap = [(-c, tokens[a], tokens[b], (a, b)) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    while len(tokens) < n_ranks:
        if not heap:
            raise ValueError(f"synthetic corpus supports only {len(tokens)} ranks, not {n_ranks}")
        neg, _, _, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or neg == 0:
            continue
        merged = tokens[pair[0]] + tokens[pair[1]]
        if merged not in index:
            index[merged] = len(tokens)
            tokens.append(merged)
        new_id = index[merged]
        touched = set()
        for wi in where.pop(pair):
            touched |= _merge_word(seqs, wi, freq[wi], pair, new_id, pair_count, where)
        for p in touched:
            if pair_count.get(p, 0) > 0:
                heapq.heappush(heap, (-pair_count[p], tokens[p[0]], tokens[p[1]], p))
    return tokens


def _merge_word(seqs, wi, f, pair, new_id, pair_count, where) -> set[tuple[int, int]]:
    seq = seqs[wi]
    for p in pairwise(seq):
        pair_count[p] -= f
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and (seq[i], seq[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    seqs[wi] = out
    for p in pairwise(out):
        pair_count[p] += f
        if p != pair:
            where.setdefault(p, set()).add(wi)
    return set(pairwise(seq)) | set(pairwise(out))


def _fill_ranks(tokens: list[bytes], n_ranks: int, seed: int) -> list[bytes]:
    """Extend ``tokens`` to ``n_ranks`` with seeded new pairs of existing tokens (<= 16 bytes)."""
    rng = random.Random(seed)
    tokens = list(tokens)
    seen = set(tokens)
    while len(tokens) < n_ranks:
        t = tokens[rng.randrange(len(tokens))] + tokens[rng.randrange(len(tokens))]
        if len(t) <= 16 and t not in seen:
            seen.add(t)
            tokens.append(t)
    return tokens


def write_synthetic_tokenizer(out_dir: str | Path, vocab_size: int, seed: int = 0) -> dict:
    """Write a ``tiktoken.model`` and ``tokenizer_config.json`` of ``vocab_size`` ids.

    The first ``vocab_size - 256`` ids are ranks: the 256 bytes, then byte-level BPE merges
    learned from a built-in multilingual text plus seeded pseudo-text, up to
    ``LEARNED_RANKS``; beyond that (full-size vocabularies) seeded concatenations of two
    lower ranks fill the rest, so every rank is still a merge of lower ones. The same
    arguments give the same files. The last 256 ids are specials at the K3 offsets
    (``SPECIAL_OFFSETS``).

    Returns the config keys a model needs: ``vocab_size``, ``bos_token_id``,
    ``eos_token_id`` (``<|end_of_msg|>``) and ``pad_token_id``.
    """
    n_ranks = vocab_size - NUM_SPECIAL_TOKENS
    if n_ranks < 256:
        raise ValueError(f"vocab_size must be at least 512, got {vocab_size}")
    splitter = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated")
    learned = min(n_ranks, LEARNED_RANKS)
    text = _synthetic_corpus(n_words=3 * learned, seed=seed)
    words = Counter(p.encode("utf-8") for p, _ in splitter.pre_tokenize_str(text))
    ranks = _fill_ranks(_train_ranks(words, learned), n_ranks, seed)
    return write_tokenizer_files(out_dir, ranks)


def write_hf_tokenizer(path: str | Path) -> Path:
    """Write ``tokenizer.json`` (``HF_FILE``) into the checkpoint dir ``path`` from its
    ``tiktoken.model`` and ``tokenizer_config.json``: ``build_backend``'s tokenizer, which
    splits with Kimi's pattern and encodes as tiktoken does, so a loader that reads
    ``tokenizer.json`` (mlx-lm's, through ``transformers``) needs no remote code and
    tokenizes as this package does. Returns the file."""
    backend, _, _ = load_backend(path, cache=False)
    out = Path(path) / HF_FILE
    _write_atomic(out, backend.to_str())
    os.chmod(out, 0o644)  # a checkpoint file, readable by all like its neighbours
    return out


def write_tokenizer_files(out_dir: str | Path, ranks: list[bytes]) -> dict:
    """Write ``ranks`` as ``tiktoken.model`` and a ``tokenizer_config.json`` whose 256
    special ids follow the ranks, the named K3 specials at ``SPECIAL_OFFSETS`` and the rest
    ``<|reserved_token_ID|>``, and the same tokenizer as ``tokenizer.json``
    (``write_hf_tokenizer``).

    Returns the config keys a model needs: ``vocab_size``, ``bos_token_id``,
    ``eos_token_id`` (``<|end_of_msg|>``) and ``pad_token_id``.
    """
    n_ranks = len(ranks)
    vocab_size = n_ranks + NUM_SPECIAL_TOKENS
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)]
    (out_dir / RANK_FILE).write_text("".join(lines), encoding="utf-8")
    names = {n_ranks + off: name for name, off in SPECIAL_OFFSETS.items()}
    decoder = {
        str(i): {"content": names.get(i, reserved_name(i)), "special": True}
        for i in range(n_ranks, vocab_size)
    }
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    write_hf_tokenizer(out_dir)
    ids = special_token_ids(n_ranks)
    return {
        "vocab_size": vocab_size,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
    }
