"""Turns a `spes eval` task (OLMo's requests.jsonl.gz: one request per choice of each document,
context + continuation) into a local task of EleutherAI's lm-evaluation-harness: OUT/<name>.jsonl
(one document per line: context, the continuations, the gold index) and OUT/<name>.yaml, a
multiple_choice task over that file with the continuations appended to the context as they
are (target_delimiter ""), so that the harness scores the same strings as `spes eval`: its acc
is `spes eval`'s acc, its acc_norm (log-likelihood per character) is acc_per_char.
Usage: python scripts/lm_eval_task.py assets/eval/copa/requests.jsonl.gz OUT [--name spes_copa]
then: lm_eval --model hf --model_args pretrained=HFDIR --include_path OUT --tasks spes_copa
(docs/EVALUATION.md)."""
import argparse
import gzip
import json
import os


def documents(path):
    docs = {}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            d = docs.setdefault(r["doc_id"], {"doc_id": r["doc_id"], "context": r["request"]["context"],
                                             "choices": {}, "gold": r["doc"].get("gold", r.get("label"))})
            if d["context"] != r["request"]["context"]:
                raise SystemExit(f"{path}: document {r['doc_id']} has choices with different contexts")
            d["choices"][r["idx"]] = r["request"]["continuation"]
    out = []
    for doc_id in sorted(docs):
        d = docs[doc_id]
        d["choices"] = [d["choices"][k] for k in sorted(d["choices"])]
        out.append(d)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("requests")
    ap.add_argument("out")
    ap.add_argument("--name", help="task name (default: spes_ + the task's directory name)")
    a = ap.parse_args()
    name = a.name or "spes_" + os.path.basename(os.path.dirname(os.path.abspath(a.requests)))
    os.makedirs(a.out, exist_ok=True)
    data = os.path.abspath(os.path.join(a.out, name + ".jsonl"))
    docs = documents(a.requests)
    with open(data, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    with open(os.path.join(a.out, name + ".yaml"), "w", encoding="utf-8") as f:
        f.write(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    print(f"{len(docs)} documents: {data} and {name}.yaml in {a.out}")


if __name__ == "__main__":
    main()
