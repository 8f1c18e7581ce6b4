"""A tiny model directory with text: the stored qwen3_moe golden model (vocab 96) and a
character tokenizer built here with the `tokenizers` library, plus a chat template.

Ids 0..2 are <s>, </s>, <unk>; ids 3..95 are the printable ASCII characters from " " on, so
every id the model can produce decodes to text and any ASCII text of those characters encodes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden" / "qwen3_moe"
SPECIALS = ["<s>", "</s>", "<unk>"]
CHARS = [chr(c) for c in range(32, 32 + 93)]  # " " .. "|"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def make_text_model(directory: Path, eos_token_id=None) -> Path:
    """The golden model + tokenizer in `directory`; `eos_token_id` (an id or a list) goes into
    generation_config.json."""
    shutil.copytree(GOLDEN, directory, dirs_exist_ok=True, ignore=shutil.ignore_patterns("expected.npz"))
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE})
    )
    if eos_token_id is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return directory
