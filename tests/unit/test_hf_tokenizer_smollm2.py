"""Parity with transformers on the real SmolLM2-135M-Instruct tokenizer (`rl models fetch smollm2-135m-instruct`):
1,000 strings (ASCII, Unicode, code, whitespace runs, chat turns with special tokens) encoded and decoded, and
chat templates rendered, from the GGUF file and from a Hugging Face directory.

transformers 5.x builds no pre-tokenizer for the GGUF's `tokenizer.ggml.pre = "smollm"` and falls back to
the plain GPT-2 regex; llama.cpp (and SmolLM2's own tokenizer.json) isolate digits first. asyncrl follows
the model, so the GGUF reference here is transformers' tokenizer with that one piece set as llama.cpp
defines it; `test_transformers_smollm_gap_is_only_whitespace_before_digits` pins down where the unpatched
transformers differs.
"""

import copy

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from model.hf_tokenizer import bytes_to_unicode, load_hf_tokenizer
from tests.real_models import smollm2_gguf
from tests.tokenizer_corpus import CONVERSATIONS, corpus

pytestmark = pytest.mark.slow  # the real model's tokenizer against transformers: ~10 s

STRINGS = corpus(1000, seed=0)
LLAMA_CPP_SMOLLM = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False)])


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def transformers_plain(gguf_path):
    """transformers' own GGUF tokenizer, untouched."""
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def reference(transformers_plain):
    """transformers' GGUF tokenizer with the "smollm" pre-tokenizer as llama.cpp defines it (module docstring)."""
    tok = copy.deepcopy(transformers_plain)
    tok.backend_tokenizer.pre_tokenizer = LLAMA_CPP_SMOLLM
    return tok


@pytest.fixture(scope="module")
def hf_dir(reference, tmp_path_factory):
    """A Hugging Face directory as transformers writes it (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    d = tmp_path_factory.mktemp("smollm2-tokenizer")
    reference.save_pretrained(d)
    return d


def transformers_decode(tok, s):
    return tok.decode(tok.encode(s), skip_special_tokens=True)


def _parity(ours, theirs, strings):
    enc = [s for s in strings if ours.encode(s, bos=ours.add_bos) != theirs.encode(s)]
    dec = [s for s in strings if ours.decode(ours.encode(s)) != theirs.decode(theirs.encode(s), skip_special_tokens=True)]
    return enc, dec


def test_gguf_tokenizer_matches_transformers_on_1000_strings(gguf_path, reference):
    ours = load_hf_tokenizer(gguf_path)
    assert (ours.vocab_size, ours.eos_ids, ours.bos_id, ours.pad_id, ours.add_bos) == (49152, (2,), 1, 2, False)
    assert ours.vocab_size == len(reference) and ours.eos_id == reference.eos_token_id and ours.pad_id == reference.pad_token_id
    assert len(STRINGS) == 1000
    enc, dec = _parity(ours, reference, STRINGS)
    assert not enc and not dec, (enc[:3], dec[:3])
    # byte-level BPE loses nothing, except bytes the vocabulary lacks (SmolLM2 has no token for six control
    # characters, 0x04 0x06 0x13 0x14 0x16 0x1d): those are dropped, by transformers too
    vocab = ours.backend.get_vocab()
    missing = {b for b, c in bytes_to_unicode().items() if c not in vocab}
    plain = [s for s in STRINGS if "<|" not in s and not missing & set(s.encode())]
    assert len(plain) > 700 and all(ours.decode(ours.encode(s)) == s for s in plain)
    assert ours.decode(ours.encode("a\x16b")) == "ab" == transformers_decode(reference, "a\x16b")


def test_directory_tokenizer_matches_transformers_on_1000_strings(hf_dir, gguf_path):
    ours = load_hf_tokenizer(hf_dir)
    theirs = AutoTokenizer.from_pretrained(hf_dir)
    assert (ours.vocab_size, ours.eos_ids, ours.bos_id, ours.pad_id, ours.add_bos) == (49152, (2,), 1, 2, False)
    enc, dec = _parity(ours, theirs, STRINGS)
    assert not enc and not dec, (enc[:3], dec[:3])
    from_gguf = load_hf_tokenizer(gguf_path)
    assert all(ours.encode(s) == from_gguf.encode(s) for s in STRINGS)  # the two loaders agree


def test_chat_templates_match_apply_chat_template(gguf_path, hf_dir, reference):
    for ours in (load_hf_tokenizer(gguf_path), load_hf_tokenizer(hf_dir)):
        for conv in CONVERSATIONS:
            for gen in (True, False):
                text = ours.apply_chat_template(conv, add_generation_prompt=gen)
                assert text == reference.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            ids = reference.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
            assert ours.encode(ours.apply_chat_template(conv)) == list(ids)
    no_system = load_hf_tokenizer(gguf_path).apply_chat_template(CONVERSATIONS[0])
    assert no_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert no_system.endswith("<|im_start|>assistant\n")


def test_transformers_smollm_gap_is_only_whitespace_before_digits(gguf_path, transformers_plain):
    ours = load_hf_tokenizer(gguf_path)
    differ = [s for s in STRINGS if ours.encode(s) != transformers_plain.encode(s)]
    assert differ, "transformers now splits digits for 'smollm': use it unpatched as the reference"
    assert all(any(a.isspace() and b.isnumeric() for a, b in zip(s, s[1:])) for s in differ)
    assert ours.encode("a\n\n1") == [81, 1116, 33] != transformers_plain.encode("a\n\n1")  # "\n\n" is one token, as trained
