"""The checkpoint every program here loads: a tiny Qwen2 saved as a user saves one (``save_pretrained``)."""

import sys
from pathlib import Path

from transformers import Qwen2Config, Qwen2ForCausalLM


def save(directory: str) -> str:
    if not (Path(directory) / "config.json").exists():
        Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=256)).save_pretrained(directory)
    return directory


if __name__ == "__main__":
    save(sys.argv[1])
