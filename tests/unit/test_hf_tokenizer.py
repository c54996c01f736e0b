"""Hugging Face tokenizers on small real tokenizers written in the test: a directory and GGUF metadata, checked
against transformers; special ids, chat templates, refusals, the GGUF metadata reader, the recipe's `hf`
variant and its vocabulary rule, and the engine stopping on any of several eos ids."""

import struct

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from model.chat_template import render_chat_template
from model.config import HFTokenizerConfig
from model.gguf_metadata import read_gguf_metadata
from model.hf_tokenizer import load_hf_tokenizer
from model.tokenizer import CharTokenizer, Tokenizer
from rl.config import Recipe
from tests.tiny_tokenizer import write_gguf, write_hf_dir
from tests.tokenizer_corpus import CONVERSATIONS, corpus

STRINGS = corpus(300, seed=7)


def _recipe(tmp_path, tokenizer, vocab_size: int) -> dict:
    return {"tokenizer": tokenizer, "model": {"vocab_size": vocab_size}, "datasets": [{"type": "arithmetic"}],
            "stages": [{"type": "sft", "max_steps": 1}]}


def test_directory_reads_special_tokens_template_and_several_eos(tmp_path):
    d = write_hf_dir(tmp_path / "tok", generation={"eos_token_id": [3, 2], "bos_token_id": 1, "stop_strings": ["</s>"]})
    tok = load_hf_tokenizer(d)
    assert isinstance(tok, Tokenizer)
    assert (tok.eos_id, tok.eos_ids, tok.bos_id, tok.pad_id, tok.add_bos) == (2, (2, 3), 1, 0, False)
    assert tok.vocab_size == 600 and tok.stop_strings == ("</s>",)
    hf = AutoTokenizer.from_pretrained(d)
    for s in STRINGS:
        ids = tok.encode(s, bos=tok.add_bos)
        assert ids == hf.encode(s), s
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), s
    for conv in CONVERSATIONS:
        for gen in (True, False):
            assert tok.apply_chat_template(conv, add_generation_prompt=gen) == hf.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=gen)
    assert tok.encode("hi", bos=True, eos=True) == [1, *tok.encode("hi"), 2]
    assert tok.decode([*tok.encode("ok"), 2, 600, 5000]) == "ok"  # special ids and padded embedding rows: nothing


def test_directory_fallbacks_and_bos_from_the_post_processor(tmp_path):
    d = write_hf_dir(tmp_path / "a", config={"bos_token": None, "eos_token": None, "pad_token": None, "chat_template": None},
                     special_map={"eos_token": {"content": "<|eot|>"}, "bos_token": "<|im_start|>"}, template_file="{{ bos_token }}J")
    tok = load_hf_tokenizer(d)
    assert (tok.eos_ids, tok.bos_id, tok.pad_id) == ((3,), 1, 3)  # no pad: the eos id
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>J"  # chat_template.jinja, bos_token
    assert not tok.add_bos
    d2 = write_hf_dir(tmp_path / "b")
    import json

    from tokenizers import Tokenizer as Backend, processors
    backend = Backend.from_file(str(d2 / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    backend.save(str(d2 / "tokenizer.json"))
    tok2 = load_hf_tokenizer(d2)
    assert tok2.add_bos and tok2.encode("a", bos=tok2.add_bos) == AutoTokenizer.from_pretrained(d2).encode("a")
    cfg = json.loads((d2 / "tokenizer_config.json").read_text())
    (d2 / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    assert not load_hf_tokenizer(d2).add_bos  # an explicit flag wins; a changed file is read again (cache key)


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_gguf_matches_transformers_gguf_converter(tmp_path, pre):
    path = write_gguf(tmp_path / "t.gguf", pre=pre)
    tok = load_hf_tokenizer(path)
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    assert tok.vocab_size == len(hf) == 600
    mismatched = [s for s in STRINGS if tok.encode(s) != hf.encode(s)]
    assert not mismatched, mismatched[:5]
    assert all(tok.decode(tok.encode(s)) == hf.decode(hf.encode(s), skip_special_tokens=True) for s in STRINGS)
    for conv in CONVERSATIONS:
        assert tok.apply_chat_template(conv) == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def test_gguf_smollm_splits_digits_like_llama_cpp(tmp_path):
    """llama.cpp's "smollm" (and "starcoder", "refact") isolate every digit before the GPT-2 regex."""
    plain, digits = (load_hf_tokenizer(write_gguf(tmp_path / f"{p}.gguf", pre=p)) for p in ("gpt2", "smollm"))
    s = "in 2024 and  12 or\n\n7"
    assert [t for t in digits.backend.encode(s).tokens if any(c.isdigit() for c in t)] == list("2024127")
    assert any(len(t) > 1 for t in plain.backend.encode(s).tokens if any(c.isdigit() for c in t))  # e.g. "Ġ2"
    assert digits.decode(digits.encode(s)) == s


def test_gguf_special_ids_and_flags(tmp_path):
    tok = load_hf_tokenizer(write_gguf(tmp_path / "t.gguf", eot=3, add_bos=True))
    assert (tok.eos_ids, tok.bos_id, tok.pad_id, tok.add_bos) == ((2, 3), 1, 0, True)
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tok.encode("<|eot|>") == [3] and tok.decode([3, 1, 2]) == ""


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "llama"}, "GGUF tokenizer model 'llama' is not supported"),
    ({"pre": "made-up"}, "GGUF pre-tokenizer 'made-up' is not supported"),
    ({"eos": 900}, "eos_token_id 900 is outside its 600 tokens"),
])
def test_gguf_refusals_are_one_line(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        load_hf_tokenizer(write_gguf(tmp_path / "t.gguf", **kwargs))
    assert "\n" not in str(e.value)


def test_gguf_metadata_reader_refuses_malformed_files(tmp_path):
    good = write_gguf(tmp_path / "t.gguf")
    meta = read_gguf_metadata(good)
    assert meta["general.architecture"] == "llama" and len(meta["tokenizer.ggml.tokens"]) == 600
    data = good.read_bytes()
    cases = {"short": b"GGUF", "magic": b"XXXX" + data[4:], "version": data[:4] + struct.pack("<I", 9) + data[8:],
             "truncated": data[: len(data) // 2]}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ValueError) as e:
            read_gguf_metadata(tmp_path / name)
        assert str(tmp_path / name) in str(e.value) and "\n" not in str(e.value), name
    with pytest.raises(ValueError, match="does not exist"):
        load_hf_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_hf_tokenizer(tmp_path / "empty")


def test_chat_template_sandbox_and_helpers():
    special = {"bos_token": "<s>"}
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat_template("{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}", msgs,
                                add_generation_prompt=False, special_tokens=special) == '<s>"hi"'
    with pytest.raises(ValueError, match="chat template: only users"):
        render_chat_template("{{ raise_exception('only users') }}", msgs, add_generation_prompt=True, special_tokens={})
    with pytest.raises(ValueError, match="chat template"):  # the sandbox: no reaching Python internals
        render_chat_template("{{ messages.__class__.__mro__ }}", msgs, add_generation_prompt=True, special_tokens={})
    with pytest.raises(ValueError, match="does not compile"):
        render_chat_template("{% for %}", msgs, add_generation_prompt=True, special_tokens={})
    out = render_chat_template("{% generation %}{{ strftime_now('%Y') | length }}{% endgeneration %}", msgs,
                               add_generation_prompt=True, special_tokens={})
    assert out == "4"


def test_recipe_hf_variant_and_vocab_rule(tmp_path):
    d = write_hf_dir(tmp_path / "tok")
    r = Recipe.model_validate(_recipe(tmp_path, {"type": "hf", "path": str(d)}, 640))  # a padded embedding is fine
    assert isinstance(r.tokenizer, HFTokenizerConfig) and r.tokenizer.build().vocab_size == 600
    with pytest.raises(ValidationError, match=r"model.vocab_size=599 is smaller than the hf tokenizer's 600 ids"):
        Recipe.model_validate(_recipe(tmp_path, {"type": "hf", "path": str(d)}, 599))
    with pytest.raises(ValidationError, match=r"model.vocab_size=100 but the char tokenizer has 99 ids"):
        Recipe.model_validate(_recipe(tmp_path, "char", 100))
    with pytest.raises(ValidationError, match="tokenizer.path is null and no model.init"):
        Recipe.model_validate(_recipe(tmp_path, {"type": "hf"}, 640))


def test_recipe_takes_the_tokenizer_of_model_init(tmp_path):
    """`path: null` reads `model.init`: a real tiny checkpoint directory with its tokenizer files."""
    from tests.hf_tiny import make_hf

    d = tmp_path / "ckpt"
    make_hf("llama", d, vocab_size=600, max_position_embeddings=512)
    write_hf_dir(d)
    recipe = Recipe.model_validate({**_recipe(tmp_path, {"type": "hf", "path": None}, 600), "model": {"init": str(d)}})
    assert recipe.tokenizer.path == str(d) and recipe.model.vocab_size == 600
    assert recipe.tokenizer.build().vocab_size == 600
    explicit = Recipe.model_validate({**_recipe(tmp_path, {"type": "hf", "path": str(d)}, 600), "model": {"init": str(d)}})
    assert explicit.tokenizer.path == str(d)


def test_rollouts_are_token_in_token_out(tmp_path):
    """A response the engine spelled with non-canonical ids is stored and trained as those ids, not re-encoded."""
    from rewards.task import Problem, Verdict
    from rl.algo.rendering import Renderer
    from rl.train.trainer import TrainBatch
    from rl.types import Prompt
    from rollout.types import Generation

    tok = load_hf_tokenizer(write_hf_dir(tmp_path / "tok"))
    pieces = tuple(i for ch in "the model" for i in tok.encode(ch))  # one token per character
    assert list(pieces) != tok.encode("the model") and tok.decode(pieces) == "the model"
    g = Generation("p0-0", (1, 5), pieces, (0.0,) * len(pieces), (0,) * len(pieces), "eos", None)
    s = Renderer(tok, {}).to_sample(Prompt("p0", "d", "q", (1, 5), "a", 1, 0), Problem("d:1", "d", "q"), g, Verdict(1.0, True))
    batch = TrainBatch.from_samples([s], [1.0], float(len(pieces)))
    assert s.response_text == "the model" and s.response_tokens == pieces and list(batch.responses_B[0]) == list(pieces)


def test_char_tokenizer_keeps_its_single_eos():
    assert CharTokenizer().eos_ids == (CharTokenizer.eos_id,) == (2,)


def test_engine_stops_on_any_eos_id(moe_model):
    """Greedy decoding from fixed prompts: the tokens it produces, each declared an eos id, end those samples there."""
    from rollout.config import EngineConfig
    from rollout.engine import Engine
    from rollout.types import GenerationRequest

    def reqs(ignore_eos: bool):
        return [GenerationRequest(f"s{i}", (1, 10 + i, 20 + i), 12, seed=i, temperature=0.0, ignore_eos=ignore_eos)
                for i in range(6)]

    cfg = EngineConfig(max_batch_size=8, block_size=4, max_seq_len=32)
    free = Engine(moe_model, cfg, eos_id=2).generate(reqs(ignore_eos=True))  # greedy, full length
    unused = min(set(range(99)) - {t for g in free for t in g.response_tokens})
    stops = {free[0].response_tokens[3], free[1].response_tokens[5]}
    gens = Engine(moe_model, cfg, eos_id=unused, eos_ids=sorted(stops)).generate(reqs(ignore_eos=False))
    for f, g in zip(free, gens):
        cut = next((i for i, t in enumerate(f.response_tokens) if t in stops), None)
        if cut is None:
            assert g.response_tokens == f.response_tokens and g.finish_reason == "length"
        else:
            assert g.response_tokens == f.response_tokens[: cut + 1] and g.finish_reason == "eos"
    assert sum(g.finish_reason == "eos" for g in gens) >= 2


@pytest.mark.integration
@pytest.mark.parametrize("tokenizer, vocab, expected", [
    ("{type: hf, path: TOK}", 99, "model.vocab_size=99 is smaller than the hf tokenizer's 600 ids"),
    ("{type: hf, path: TOK/missing}", 600, "tokenizer path 'TOK/missing' does not exist"),
    ("{type: hf, path: null}", 600, "tokenizer.path is null and no model.init"),
], ids=["vocab-too-small", "missing-path", "null-path"])
@pytest.mark.slow
def test_cli_validate_refuses_a_tokenizer_that_does_not_fit_in_one_line(tmp_path, tokenizer, vocab, expected):
    from tests.unit.test_recipe import run_cli

    tok = write_hf_dir(tmp_path / "tok")
    (tmp_path / "r.yaml").write_text(f"tokenizer: {tokenizer.replace('TOK', str(tok))}\nmodel: {{vocab_size: {vocab}}}\n"
                                     "datasets: [{type: arithmetic}]\nstages: [{type: sft, max_steps: 1}]\n")
    proc = run_cli("validate", "r.yaml", cwd=tmp_path)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("rl validate: recipe error: r.yaml") and expected.replace("TOK", str(tok)) in lines[0]
    if vocab != 99:
        return
    (tmp_path / "ok.yaml").write_text(f"tokenizer: {{type: hf, path: {tok}}}\nmodel: {{vocab_size: 640}}\n"
                                      "datasets: [{type: arithmetic}]\nstages: [{type: sft, max_steps: 1}]\n")
    assert run_cli("validate", "ok.yaml", cwd=tmp_path).returncode == 0


def test_a_gguf_tokenizer_writes_hf_files_that_transformers_and_asyncrl_read_alike(tmp_path):
    """What an export of a GGUF-started run carries: the same ids, specials and chat template on both sides."""
    tok = load_hf_tokenizer(write_gguf(tmp_path / "t.gguf", pre="default"))
    out = tmp_path / "hf"
    out.mkdir()
    tok.save_hf_files(out)
    again, hf = load_hf_tokenizer(out), AutoTokenizer.from_pretrained(out)
    for s in STRINGS[:200]:
        assert again.encode(s) == tok.encode(s) == hf.encode(s, add_special_tokens=False), s
    assert (again.eos_id, again.bos_id, again.pad_id, again.add_bos) == (tok.eos_id, tok.bos_id, tok.pad_id, tok.add_bos)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert again.apply_chat_template(conv) == tok.apply_chat_template(conv) == hf.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=True)


def test_a_padded_char_tokenizer_sizes_the_vocabulary_and_decodes_the_padding_to_nothing():
    """`tokenizer: {type: char, vocab_size: N}`: a synthetic task at a real model's output-head size (bench/lora.py's
    8B GRPO job, vocabulary 151,936); a random policy samples ids past the characters, which must decode to nothing."""
    from tests.unit.test_worker import RECIPE

    tok = CharTokenizer(1000)
    text = "What is 7 + 5?\n"
    assert tok.vocab_size == 1000 and tok.decode(tok.encode(text)) == text
    assert tok.decode([*tok.encode("ab"), 99, 500, 999, *tok.encode("c")]) == "abc"
    assert CharTokenizer().decode([500]) == ""  # a reader that builds the plain tokenizer decodes such ids too
    with pytest.raises(ValueError, match="at least 99 ids"):
        CharTokenizer(50)
    padded = {**RECIPE, "tokenizer": {"type": "char", "vocab_size": 1000}, "model": {**RECIPE["model"], "vocab_size": 1000}}
    assert Recipe.model_validate(padded).tokenizer.build().vocab_size == 1000
    with pytest.raises(ValueError, match="model.vocab_size=99 but the char tokenizer has 1000 ids"):
        Recipe.model_validate({**padded, "model": RECIPE["model"]})
