// Reference ids for hf_bpe_tokenizer_test.cpp from Hugging Face's `tokenizers` (npm build).
// Usage: node hf_tokenizers_reference.js NODE_MODULES_DIR TOKENIZER_JSON INPUTS_JSON
// INPUTS_JSON holds a JSON array of strings; prints a JSON array with, per string,
// {"ids": [...], "decoded": "..."} (encode without special tokens; decode keeping them).
const path = require('path');
const fs = require('fs');

async function main() {
  const [modulesDir, tokenizerFile, inputsFile] = process.argv.slice(2);
  const { Tokenizer } = require(path.join(modulesDir, 'tokenizers'));
  const tok = Tokenizer.fromFile(tokenizerFile);
  const inputs = JSON.parse(fs.readFileSync(inputsFile, 'utf8'));
  const out = [];
  for (const text of inputs) {
    const enc = await tok.encode(text, null, { addSpecialTokens: false });
    const ids = Array.from(enc.getIds());
    out.push({ ids, decoded: await tok.decode(ids, false) });
  }
  process.stdout.write(JSON.stringify(out) + '\n');
}

main().catch((e) => {
  process.stderr.write(String(e && e.stack ? e.stack : e) + '\n');
  process.exit(1);
});
