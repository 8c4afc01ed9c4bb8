"""The tokenizer built from a tiktoken rank file, checked against tiktoken itself."""

import base64
import json
import random
from pathlib import Path

import mlx.core as mx
import pytest
import tiktoken
from mlx_lm.generate import stream_generate
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kimi_k3.corpus import train_ranks
from kimi_k3.text.chat import encode_ordinary
from kimi_k3.text.tokenizer import (
    KIMI_PATTERN,
    SPECIAL_OFFSETS,
    load_tokenizer,
    read_ranks,
    read_special_tokens,
    write_synthetic_tokenizer,
)

MULTILINGUAL = [
    "Hello, world! This is a simple English sentence.",
    "They're sure it's fine; we've checked, you'll see, I'm done and he'd agree.",
    "SHOUTING CONTRACTIONS: IT'S, WE'RE, THEY'VE, I'LL, SHE'D, DON'T. Mixed: It'S We'Re",
    "camelCaseIdentifier HTTPServerError XMLHttpRequest iPhone McDonald's ABCdef",
    "我们今天去公园散步，天气非常好。机器学习需要大量数据！",
    "中文English混合text，数字123和符号。日本語とかな、한국어도.",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < 10; ++i) {\n\tsum += a[i];\n}\r\n",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "Emoji: 😀😃 🚀🔥 👍🏽 👨\u200d👩\u200d👧\u200d👦 🇯🇵 ❤️ ✨✨✨",
    "spaces:" + " " * 37 + "end" + "\t" * 5 + "tabs\n\n\n\n" + " " * 8 + "indented",
    "numbers 0 7 42 123 1234 12345 123456789 3.14159 1e-10 -273.15 ٣٤٥ Ⅻ x² ½",
    "Ünïcödé àccents Größe straße ǅungla ʰmodifier e\u0301 Ω≈ç√∫",
    "trailing spaces    \n   \n\r\n  \r  ",
    "   leading spaces and a lone newline\n",
    "<|open|> looks special but is text [BOS] <|reserved_token_5|>",
    "\u00a0non-breaking\u00a0space and ideographic\u3000space",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@c.org",
    "",
    "a",
    " ",
    "\n",
    "x" * 500,
]

POOL = [
    *"abcdefxyzABCDEFXYZ",
    "é",
    "Ö",
    "ß",
    "ǅ",
    "ʰ",
    "\u0301",
    *"中文字学",
    "の",
    "한",
    *"0123456789",
    "٣",
    "Ⅻ",
    "²",
    *".,!?'\"-_()[]{}<>|/\\:;#@&*+=~`$%^",
    "'s",
    "'S",
    "'ll",
    "'RE",
    " ",
    "  ",
    "\t",
    "\n",
    "\r",
    "\r\n",
    "\u00a0",
    "\u3000",
    "😀",
    "👍🏽",
    "🇯🇵",
    "❤️",
    "<|open|>",
    "[EOS]",
]


def random_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        chunks = [
            rng.choice(POOL) * rng.choice([1, 1, 1, 2, 3, 7]) for _ in range(rng.randint(1, 40))
        ]
        texts.append("".join(chunks))
    return texts


def tiktoken_for(path: Path) -> tiktoken.Encoding:
    ranks = read_ranks(path / "tiktoken.model")
    specials = read_special_tokens(path / "tokenizer_config.json", len(ranks))
    return tiktoken.Encoding(
        name=f"test-{path.name}",
        pat_str=KIMI_PATTERN,
        mergeable_ranks={t: r for r, t in enumerate(ranks)},
        special_tokens={s: len(ranks) + i for i, s in enumerate(specials)},
    )


def write_ranks(path: Path, ranks: list[bytes]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)]
    (path / "tiktoken.model").write_text("".join(lines))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("small")
    write_synthetic_tokenizer(path, 1024)
    return path


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth")
    write_synthetic_tokenizer(path, 4096, seed=1)
    return path


@pytest.fixture(scope="module")
def bigger(tmp_path_factory):
    """About 8000 ranks learned by another trainer from a larger text."""
    path = tmp_path_factory.mktemp("bigger")
    rng = random.Random(5)
    text = "\n".join(MULTILINGUAL * 20 + random_texts(3000, seed=11))
    source = Path(json.__file__).parent.parent
    for name in ("textwrap.py", "argparse.py", "difflib.py", "inspect.py"):
        text += (source / name).read_text(encoding="utf-8")
    han = "的一是了我不人在他有这个上们来到时大地为子中你说生国年着就那和要"
    text += "".join(rng.choice(han) for _ in range(20000))
    write_ranks(path, train_ranks([text], 8192))  # the tokenizers trainer
    return path


def check_parity(path: Path, texts: list[str]) -> None:
    enc = tiktoken_for(path)
    tok = load_tokenizer(path)
    for text in texts:
        want = enc.encode_ordinary(text)
        assert encode_ordinary(tok, text) == want, text
        assert tok.decode(want) == text
        assert tok.encode(text) == enc.encode(text, allowed_special="all"), text


@pytest.mark.parametrize("which, seed", [("small", 1), ("synth", 2), ("bigger", 3)])
def test_parity_with_tiktoken(which, seed, request):
    path = request.getfixturevalue(which)
    check_parity(path, MULTILINGUAL + random_texts(300, seed=seed))


def test_whole_word_tokens(bigger):
    """Words that are tokens come out whole (``ignore_merges``), as in tiktoken."""
    enc = tiktoken_for(bigger)
    tok = load_tokenizer(bigger)
    ranks = read_ranks(bigger / "tiktoken.model")
    words = [t.decode() for t in ranks[256:] if _decodes(t)][-500:]
    for w in words:
        assert tok.encode(w) == enc.encode_ordinary(w), w


def _decodes(t: bytes) -> bool:
    try:
        t.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_unreachable_token(tmp_path):
    """A token no merge sequence reaches is still emitted for the whole word, as tiktoken does."""
    ranks = [bytes([b]) for b in range(256)] + [b"xyz", b"ab", b"abab"]
    write_ranks(tmp_path, ranks)
    check_parity(tmp_path, ["xyz", "xyzw", " xyz", "xy", "ababab", "abab", "abxyz"])
    tok = load_tokenizer(tmp_path)
    assert tok.encode("xyz") == [256]
    assert tok.encode("xyzw") == list(b"xyzw")


def test_special_ids(synth):
    tok = load_tokenizer(synth)
    n = 4096 - 256
    for name, off in SPECIAL_OFFSETS.items():
        assert tok.convert_tokens_to_ids(name) == n + off
        assert tok.encode(name) == [n + off]
    assert tok.convert_ids_to_tokens(n + 6) == f"<|reserved_token_{n + 6}|>"
    assert tok.convert_ids_to_tokens(n + 253) == f"<|reserved_token_{n + 253}|>"
    assert len(tok) == 4096
    assert tok.bos_token_id == n
    assert tok.eos_token_id == n + 2
    assert tok.pad_token_id == n + 255
    assert tok.unk_token_id == n + 254
    assert tok.eos_token_ids == {n + 1, n + 2}
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=True)  # no BOS
    assert tok.decode([n + 3, 104, 105, n + 5]) == "<|open|>hi<|sep|>"
    assert tok.decode([n + 3, 104, 105, n + 5], skip_special_tokens=True) == "hi"


def test_write_synthetic_tokenizer(tmp_path):
    ids = write_synthetic_tokenizer(tmp_path / "a", 1024, seed=3)
    assert ids == {
        "vocab_size": 1024,
        "bos_token_id": 768,
        "eos_token_id": 770,
        "pad_token_id": 1023,
    }
    write_synthetic_tokenizer(tmp_path / "b", 1024, seed=3)
    write_synthetic_tokenizer(tmp_path / "c", 1024, seed=4)
    a, b, c = (tmp_path / d / "tiktoken.model" for d in "abc")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()

    ranks = read_ranks(a)
    assert len(ranks) == 768
    assert ranks[:256] == [bytes([i]) for i in range(256)]
    assert all(is_merge_of_lower(ranks, r, set(ranks[:r])) for r in range(256, len(ranks)))

    config = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    decoder = config["added_tokens_decoder"]
    assert sorted(map(int, decoder)) == list(range(768, 1024))
    assert decoder["768"]["content"] == "[BOS]"
    assert decoder["770"]["content"] == "<|end_of_msg|>"
    assert decoder["777"]["content"] == "[EOT]"
    assert decoder["1022"]["content"] == "[UNK]"
    assert decoder["800"] == {"content": "<|reserved_token_800|>", "special": True}
    assert config["eos_token"] == "<|end_of_msg|>"
    with pytest.raises(ValueError, match="512"):
        write_synthetic_tokenizer(tmp_path / "d", 400)


def is_merge_of_lower(ranks: list[bytes], r: int, lower: set[bytes]) -> bool:
    t = ranks[r]
    return any(t[:k] in lower and t[k:] in lower for k in range(1, len(t)))


@pytest.mark.slow
def test_full_size_synthetic(tmp_path):
    """A K3-size vocabulary: specials at the published ids, tiktoken parity, load time."""
    ids = write_synthetic_tokenizer(tmp_path, 163840)
    assert ids == {
        "vocab_size": 163840,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
    }
    ranks = read_ranks(tmp_path / "tiktoken.model")
    lower = set(ranks[:-2000])
    for r in range(len(ranks) - 2000, len(ranks)):
        assert is_merge_of_lower(ranks, r, lower)
        lower.add(ranks[r])
    tok = load_tokenizer(tmp_path)
    for name, token_id in [("<|open|>", 163587), ("[EOT]", 163593), ("[UNK]", 163838)]:
        assert tok.convert_tokens_to_ids(name) == token_id
    check_parity(tmp_path, MULTILINGUAL + random_texts(50, seed=9))


def test_config_names_specials(small, tmp_path):
    """Names come from ``added_tokens_decoder``; unnamed slots are reserved."""
    (tmp_path / "tiktoken.model").write_bytes((small / "tiktoken.model").read_bytes())
    names = {768 + off: name for name, off in SPECIAL_OFFSETS.items()}
    names[786] = "<|media_begin|>"
    decoder = {str(i): {"content": c, "special": True} for i, c in names.items()}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))
    tok = load_tokenizer(tmp_path)
    assert tok.convert_tokens_to_ids("<|media_begin|>") == 786
    assert tok.convert_ids_to_tokens(787) == "<|reserved_token_787|>"
    assert tok.encode("a<|media_begin|>") == [97, 786]

    (tmp_path / "tokenizer_config.json").unlink()
    defaults = load_tokenizer(tmp_path)
    assert defaults.convert_tokens_to_ids("<|sep|>") == 773
    assert defaults.convert_ids_to_tokens(786) == "<|reserved_token_786|>"


def stream(tok: TokenizerWrapper, ids: list[int]) -> tuple[str, list[str]]:
    detok = tok.detokenizer
    pieces = []
    for i in ids:
        detok.add_token(i)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    return detok.text, pieces


def test_streaming_detokenizer(synth):
    tok = load_tokenizer(synth)
    for text in MULTILINGUAL + random_texts(100, seed=2):
        ids = tok.encode(text)
        full, pieces = stream(tok, ids)
        assert full == tok.decode(ids) == text
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)


def test_streaming_holds_split_characters(synth):
    tok = load_tokenizer(synth)
    detok = tok.detokenizer
    emitted = []
    for b in " 你😀".encode():  # ranks 0..255 are the single bytes
        detok.add_token(b)
        emitted.append(detok.text)
    assert emitted == [" ", " ", " ", " 你", " 你", " 你", " 你", " 你😀"]
    eom = tok.convert_tokens_to_ids("<|end_of_msg|>")
    detok.add_token(eom)
    assert detok.text == " 你😀<|end_of_msg|>"


TRICKY_BYTES = [0x41, 0x20, 0x00, 0x80, 0xBF, 0xC3, 0xE4, 0xF0, 0x9F, 0xFF, 0xED, 0xA0]


def test_streaming_ids_past_vocabulary(synth):
    tok = load_tokenizer(synth)
    assert stream(tok, [104, 5000, 105])[0] == tok.decode([104, 5000, 105]) == "hi"


def test_streaming_invalid_utf8_matches_decode(synth):
    """Broken byte sequences decode to the same replacement characters both ways."""
    tok = load_tokenizer(synth)
    rng = random.Random(0)
    for _ in range(300):
        ids = rng.choices(TRICKY_BYTES, k=rng.randint(1, 12))
        full, pieces = stream(tok, ids)
        assert full == "".join(pieces) == tok.decode(ids), bytes(ids)


def test_mlx_lm_stream_generate(small):
    """mlx-lm's generation loop streams the same text as ``decode`` of its tokens."""
    tok = load_tokenizer(small)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=1024,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    messages = [{"role": "user", "content": "你好, stream!"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    responses = list(stream_generate(model, tok, prompt, max_tokens=48))
    tokens = [r.token for r in responses if r.token not in tok.eos_token_ids]
    assert "".join(r.text for r in responses) == tok.decode(tokens)
    assert len(tokens) > 10


def test_cache(synth, tmp_path, monkeypatch):
    cache = tmp_path / "c"
    monkeypatch.setenv("KIMI_K3_CACHE", str(cache))
    before = sorted(p.name for p in synth.iterdir())
    first = load_tokenizer(synth)
    files = list(cache.glob("tokenizer-*.json"))
    assert len(files) == 1
    assert sorted(p.name for p in synth.iterdir()) == before
    second = load_tokenizer(synth)
    text = MULTILINGUAL[4] + MULTILINGUAL[6]
    assert (
        second.encode(text) == first.encode(text) == load_tokenizer(synth, cache=False).encode(text)
    )
    files[0].write_text("{corrupt")
    assert load_tokenizer(synth).encode(text) == first.encode(text)
    assert json.loads(files[0].read_text())["model"]["type"] == "BPE"

    changed = tmp_path / "changed"
    write_synthetic_tokenizer(changed, 1024)
    load_tokenizer(changed)
    assert len(list(cache.glob("tokenizer-*.json"))) == 2
    assert not list(cache.glob("*.tmp"))


def test_load_builds_merges_for_full_range(synth):
    """Every multi-byte rank is either reachable by a merge or only emitted whole."""
    backend = json.loads(load_tokenizer(synth).backend_tokenizer.to_str())["model"]
    assert backend["ignore_merges"] is True
    assert len(backend["merges"]) == 4096 - 256 - 256  # all synthetic ranks are reachable


def rank_lines(tokens: list[bytes]) -> str:
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens))


BYTES = [bytes([b]) for b in range(256)]


@pytest.mark.parametrize(
    "text, message",
    [
        (rank_lines(BYTES) + "!!!notbase64 256\n", "bad base64"),
        (rank_lines(BYTES) + "YWI= x2\n", "bad rank"),
        (rank_lines(BYTES) + "YWI= -3\n", "bad rank"),
        (rank_lines(BYTES) + "YWI= 255\n", "duplicate rank 255"),
        (rank_lines(BYTES) + "YQ== 256\n", "duplicate token"),
        (rank_lines(BYTES) + "YWI= 257\n", "256 is missing"),
        (rank_lines(BYTES) + "YWI=\n", "expected 'base64 rank'"),
        (rank_lines(BYTES[:7] + BYTES[8:]), "missing for bytes \\[7\\]"),
        ("", "no ranks"),
    ],
)
def test_malformed_rank_file(tmp_path, text, message):
    (tmp_path / "tiktoken.model").write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_tokenizer(tmp_path)
    assert "tiktoken.model" in str(err.value)


def test_missing_rank_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiktoken.model"):
        load_tokenizer(tmp_path)


def test_bad_config(small, tmp_path):
    (tmp_path / "tiktoken.model").write_bytes((small / "tiktoken.model").read_bytes())
    config = tmp_path / "tokenizer_config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)
    config.write_text(
        json.dumps({"added_tokens_decoder": {"5": {"content": "x", "special": True}}})
    )
    with pytest.raises(ValueError, match="outside the special range"):
        load_tokenizer(tmp_path)
    config.write_text(json.dumps({"added_tokens_decoder": {"770": {"special": True}}}))
    with pytest.raises(ValueError, match="bad added_tokens_decoder entry '770'"):
        load_tokenizer(tmp_path)
    config.write_text(json.dumps({"added_tokens_decoder": {}}))
    with pytest.raises(ValueError, match="missing from the tokenizer config"):
        load_tokenizer(tmp_path)
