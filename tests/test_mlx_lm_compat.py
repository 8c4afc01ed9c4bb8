"""``kimi_k3.load`` returns what ``mlx_lm.load`` does; mlx-lm's generation and prompt-cache
functions drive the model as they drive mlx-lm's own."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import generate, stream_generate
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from mlx_lm.tokenizer_utils import TokenizerWrapper

import kimi_k3
from kimi_k3.model.config import ConfigError
from kimi_k3.text.chat import encode_chat


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KIMI_K3_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def loaded(tiny_ckpt):
    return kimi_k3.load(tiny_ckpt, dtype=mx.float32)


def tokens(model, tok, prompt, n, cache=None):
    return [r.token for r in stream_generate(model, tok, prompt, max_tokens=n, prompt_cache=cache)]


def test_load_returns_model_and_tokenizer(tiny_ckpt, loaded):
    model, tok = loaded
    assert isinstance(model, kimi_k3.Model) and isinstance(tok, TokenizerWrapper)
    _, _, config = kimi_k3.load(tiny_ckpt, return_config=True)
    assert config == json.loads((tiny_ckpt / "config.json").read_text())
    m16, _ = kimi_k3.load(tiny_ckpt)
    assert m16.language_model.lm_head.weight.dtype == mx.bfloat16


def test_load_options(tiny_ckpt):
    model, tok = kimi_k3.load(
        tiny_ckpt,
        model_config={"max_position_embeddings": 77},
        tokenizer_config={"eos_token": "<|sep|>"},
    )
    assert model.args.max_position_embeddings == 77
    assert tok.convert_tokens_to_ids("<|sep|>") in tok.eos_token_ids
    with pytest.raises(ConfigError, match="model_config key 'hidden_size'"):
        kimi_k3.load(tiny_ckpt, model_config={"hidden_size": 8})
    with pytest.raises(ValueError, match="tokenizer_config key 'chat_template'"):
        kimi_k3.load(tiny_ckpt, tokenizer_config={"chat_template": "x"})


def test_generate_matches_greedy_decoding(loaded):
    """mlx-lm's generate/stream_generate give the tokens of a plain argmax loop."""
    model, tok = loaded
    ids = encode_chat(tok, [{"role": "user", "content": "Hello"}])
    got = tokens(model, tok, ids, 10)
    cache, want = model.make_cache(), []
    logits = model(mx.array([ids]), cache=cache)
    while len(want) < 10:
        want.append(int(mx.argmax(logits[0, -1])))
        if want[-1] in tok.eos_token_ids:
            break
        logits = model(mx.array([[want[-1]]]), cache=cache)
    assert got == want
    assert generate(model, tok, ids, max_tokens=10) == tok.decode(
        [t for t in got if t not in tok.eos_token_ids]
    )


def test_make_prompt_cache_is_the_models(loaded):
    model, _ = loaded
    kinds = [type(c) for c in make_prompt_cache(model)]
    assert kinds == [type(c) for c in model.make_cache()]
    assert set(kinds) == {ArraysCache, KVCache}


def test_saved_prompt_cache_continues_like_an_uninterrupted_run(loaded, tmp_path):
    """Generate, save the cache, reload it, go on with a new message: the same tokens as one
    uninterrupted run over the whole history, and as the cache that was never saved."""
    model, tok = loaded
    first = encode_chat(tok, [{"role": "user", "content": "Hi"}])
    cache = make_prompt_cache(model)
    reply = tokens(model, tok, first, 6, cache)
    file = str(tmp_path / "cache.safetensors")
    save_prompt_cache(file, cache, metadata={"tokens": json.dumps(first + reply)})
    loaded_cache, meta = load_prompt_cache(file, return_metadata=True)
    history = json.loads(meta["tokens"])
    more = encode_chat(tok, [{"role": "user", "content": "More"}])
    resumed = tokens(model, tok, more, 8, loaded_cache)
    assert resumed == tokens(model, tok, history + more, 8)
    assert resumed == tokens(model, tok, more, 8, cache)


def test_import_is_cheap_and_exports_lazily():
    code = (
        "import sys, kimi_k3; heavy = [m for m in ('mlx.core', 'mlx_lm', 'transformers') "
        "if m in sys.modules]; assert not heavy, heavy; "
        "assert callable(kimi_k3.trace) and kimi_k3.ModelArgs.__name__ == 'ModelArgs'; "
        "import kimi_k3.trace; assert callable(kimi_k3.trace)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
