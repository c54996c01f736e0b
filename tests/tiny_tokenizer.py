"""Small real tokenizers written to disk for tests: a byte-level BPE trained in milliseconds with `tokenizers`,
saved as a Hugging Face directory or as a GGUF file's tokenizer metadata (`gguf.GGUFWriter`, no tensors)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import gguf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.tokenizer_corpus import corpus

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>"]
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@lru_cache(maxsize=1)
def _trained_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(300, seed=123) * 3, trainer)  # whitespace runs, digits, Unicode: merges across them
    return tok.to_str()


def tiny_tokenizer() -> Tokenizer:
    """ids 0-3: <|endoftext|>, <|im_start|>, <|im_end|>, <|eot|>; then the byte alphabet and ~340 merges."""
    return Tokenizer.from_str(_trained_json())


def write_hf_dir(d: Path, *, config: dict | None = None, generation: dict | None = None, special_map: dict | None = None,
                 template_file: str | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    tiny_tokenizer().save(str(d / "tokenizer.json"))
    cfg = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    cfg = {k: v for k, v in {**cfg, **(config or {})}.items() if v is not None}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name, content in (("generation_config.json", generation), ("special_tokens_map.json", special_map)):
        if content is not None:
            (d / name).write_text(json.dumps(content))
    if template_file is not None:
        (d / "chat_template.jinja").write_text(template_file)
    return d


def write_gguf(path: Path, *, model: str = "gpt2", pre: str | None = "default", eos: int = 2, eot: int | None = None,
               add_bos: bool | None = None, template: str | None = CHATML) -> Path:
    j = json.loads(_trained_json())
    vocab = j["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in j["model"]["merges"]])
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(0)
    if eot is not None:
        w.add_eot_token_id(eot)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
