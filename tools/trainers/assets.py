"""What torchtitan reads that its wheel does not ship, made here: a byte-level BPE tokenizer and a
small dataset in its ``c4_test`` layout, both from this repository's own docs (deterministic)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VOCAB = 2000  # under the debug model's 2048


def paragraphs() -> list[str]:
    """The paragraphs of the repository's docs and README, in a fixed order."""
    found = []
    for path in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        found += [p.strip() for p in path.read_text().split("\n\n") if len(p.strip()) > 40]
    return found


def make_assets(folder: Path) -> tuple[Path, Path]:
    """(tokenizer folder, dataset folder) under ``folder``, made once."""
    tokenizer_dir, dataset_dir = folder / "tokenizer", folder / "c4_test"
    if (tokenizer_dir / "tokenizer.json").exists() and (dataset_dir / "c4_sample.json").exists():
        return tokenizer_dir, dataset_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = paragraphs()
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
    tokenizer.train_from_iterator(texts * 3, trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=special))
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    config = {"bos_token": special[1], "eos_token": special[2], "add_bos_token": True, "add_eos_token": True}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    dataset_dir.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"text": " ".join(texts[(i * 7 + k) % len(texts)] for k in range(4))}) for i in range(400))
    (dataset_dir / "c4_sample.json").write_text("\n".join(lines) + "\n")
    return tokenizer_dir, dataset_dir
