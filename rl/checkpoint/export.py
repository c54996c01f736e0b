"""A run's checkpoint as a Hugging Face directory (config.json, safetensors, generation_config.json, tokenizer
files) that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads as is (model/pretrained.py
`export_checkpoint`): `rl export` (rl/cli/export.py), and the job's export at the end of every stage of a run
started from a pretrained model. `recipe` is the run's `Recipe` (its tokenizer and `model.init`)."""

from __future__ import annotations

from pathlib import Path


def export_run_checkpoint(recipe, checkpoint: Path, out: Path) -> Path:
    """Export `checkpoint` of a run of `recipe` to `out`, with the tokenizer's special ids and, when the run
    started from a Hugging Face directory, its tokenizer files (for a GGUF start the tokenizer files must
    come from the tokenizer itself: see the note in model/pretrained.py `export_hf`)."""
    from model.formats import checkpoint_kind
    from model.registry import resolve_model_source
    from model.pretrained import export_checkpoint

    tok = recipe.tokenizer.build()
    tokenizer_from = None
    init = None if recipe.model.init is None else resolve_model_source(recipe.model.init)
    if init is not None and checkpoint_kind(init) == "hf":
        tokenizer_from = Path(init)
    elif callable(getattr(tok, "save_hf_files", None)):  # a tokenizer that can write its own HF files
        tokenizer_from = tok.save_hf_files
    return export_checkpoint(checkpoint, out, tokenizer_from=tokenizer_from, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)


def stage_end_export(recipe, checkpoint: Path, run_dir: Path) -> Path | None:
    """For runs started from a pretrained model (`model.init`): the stage-end checkpoint exported to
    RUN_DIR/export/<checkpoint name>; None (nothing written) for runs from random initialisation."""
    if recipe.model.init is None:
        return None
    return export_run_checkpoint(recipe, checkpoint, run_dir / "export" / checkpoint.name)
