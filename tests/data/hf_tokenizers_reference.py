"""Reference ids for hf_bpe_tokenizer_test.cpp from Hugging Face's `tokenizers` (the Rust library,
from PyPI). Usage: python hf_tokenizers_reference.py TOKENIZER_JSON INPUTS_JSON
INPUTS_JSON holds a JSON array of strings; prints a JSON array with, per string,
{"ids": [...], "decoded": "..."} (encoded without special tokens; decoded keeping them)."""
import json
import sys

from tokenizers import Tokenizer


def main() -> None:
    tokenizer_file, inputs_file = sys.argv[1:3]
    tok = Tokenizer.from_file(tokenizer_file)
    with open(inputs_file, encoding="utf-8") as f:
        inputs = json.load(f)
    out = []
    for text in inputs:
        ids = tok.encode(text, add_special_tokens=False).ids
        out.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
